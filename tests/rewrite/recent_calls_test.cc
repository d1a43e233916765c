// A step just found, observed from the calls the detector already saw repeat
// (rewrite/recent_calls.h): which held calls are seeded, at which positions, and as how many
// complete steps.
#include "rewrite/recent_calls.h"

#include <gtest/gtest.h>

#include <memory>
#include <ostream>
#include <vector>

namespace magi::rewrite {
namespace {

// A gather whose shape says its position in a step of `period` from collective `origin`, and
// whose send buffer says which collective it was (not part of the key: the default mode).
CallFacts call(uint64_t index, uint64_t origin, uint32_t period) {
  CallFacts f;
  f.op = trace::Op::AllGather;
  f.dtype = static_cast<uint8_t>(ncclFloat);
  f.callsite = 7;
  f.count = index < origin ? 999 : 100 * ((index - origin) % period + 1);
  f.sendbuf = 0x1000 + index;
  return f;
}

// Positions' facts as the seed left them: (count, steps stable, collective of the last call).
struct Seen {
  uint64_t count;
  uint32_t stable_steps;
  uint64_t collective;
  bool operator==(const Seen&) const = default;
};
std::ostream& operator<<(std::ostream& out, const Seen& s) {
  return out << "{count " << s.count << ", stable " << s.stable_steps << ", #" << s.collective
             << "}";
}
std::vector<Seen> positions(const StepObservation& seen) {
  std::vector<Seen> out;
  for (uint32_t p = 0; p < seen.period(); ++p)
    out.push_back({seen.at(p).count, seen.at(p).stable_steps, seen.at(p).sendbuf - 0x1000});
  return out;
}

TEST(RecentCalls, SeedsTheHeldCallsFromTheRunsOriginAsWholeSteps) {
  auto recent = std::make_unique<RecentCalls>();
  for (uint64_t i = 0; i < 9; ++i) recent->add(i, call(i, 1, 3));
  StepObservation seen;
  seen.reset(3);
  // The run began at collective 1: collectives 1, 4 and 7 begin a step; 0 is before it.
  recent->seed(seen, 1, 3, 9, ce::Backend::Host);
  EXPECT_EQ(seen.complete_steps(), 2u);
  EXPECT_EQ(positions(seen), (std::vector<Seen>{{100, 3, 7}, {200, 3, 8}, {300, 2, 6}}));
}

TEST(RecentCalls, StopsBeforeTheCallItIsAskedAt) {
  auto recent = std::make_unique<RecentCalls>();
  for (uint64_t i = 0; i < 9; ++i) recent->add(i, call(i, 0, 3));
  StepObservation seen;
  seen.reset(3);
  recent->seed(seen, 0, 3, 6, ce::Backend::Host);
  EXPECT_EQ(seen.complete_steps(), 1u);
  EXPECT_EQ(positions(seen), (std::vector<Seen>{{100, 2, 3}, {200, 2, 4}, {300, 2, 5}}));
}

TEST(RecentCalls, SeedsNoCallThatWasNeverAdded) {
  auto recent = std::make_unique<RecentCalls>();
  for (uint64_t i = 0; i < 5; ++i) recent->add(i, call(i, 0, 2));
  StepObservation seen;
  seen.reset(2);
  recent->seed(seen, 0, 2, 100, ce::Backend::Host);
  EXPECT_EQ(seen.complete_steps(), 2u);
  EXPECT_EQ(positions(seen), (std::vector<Seen>{{100, 3, 4}, {200, 2, 3}}));
}

TEST(RecentCalls, HoldsOnlyTheLatestCallsAndCountsPositionsFromTheOriginStill) {
  auto recent = std::make_unique<RecentCalls>();
  const uint64_t added = RecentCalls::kRecentCalls + 10;
  for (uint64_t i = 0; i < added; ++i) recent->add(i, call(i, 0, 3));
  StepObservation seen;
  seen.reset(3);
  recent->seed(seen, 0, 3, added, ce::Backend::Host);
  // Collectives 10 to 1033 are held; 10 and 11 come before the first position 0 held (12), so
  // they begin no step and are not observed.
  EXPECT_EQ(seen.complete_steps(), 340u);
  EXPECT_EQ(positions(seen),
            (std::vector<Seen>{{100, 341, 1032}, {200, 341, 1033}, {300, 340, 1031}}));
}

TEST(RecentCalls, AStepOfNoCallsSeedsNothing) {
  auto recent = std::make_unique<RecentCalls>();
  for (uint64_t i = 0; i < 4; ++i) recent->add(i, call(i, 0, 2));
  StepObservation seen;
  seen.reset(2);
  recent->seed(seen, 0, 0, 4, ce::Backend::Host);
  EXPECT_EQ(seen.complete_steps(), 0u);
  EXPECT_FALSE(seen.at(0).seen);
  EXPECT_FALSE(seen.at(1).seen);
}

}  // namespace
}  // namespace magi::rewrite
