// When a static binding is checked (ce_transport/verify_schedule.h): on the first calls and then
// every so many, never on a call the cost trial times, and nothing due is lost.
#include <gtest/gtest.h>

#include <vector>

#include "ce_transport/verify_schedule.h"

namespace magi::ce {
namespace {

constexpr auto kTimed = Transport::Timing::Timed;
constexpr auto kUntimed = Transport::Timing::Untimed;

// The calls (1-based) of one binding on which a check runs, given each call's timing.
std::vector<int> checked_calls(VerifySchedule& s, const std::vector<Transport::Timing>& calls) {
  std::vector<int> checked;
  for (size_t i = 0; i < calls.size(); ++i)
    if (s.on_call(0, calls[i])) checked.push_back(static_cast<int>(i) + 1);
  return checked;
}

TEST(VerifySchedule, FirstCallsThenEveryNth) {
  VerifySchedule s;
  s.reset(3, 4);
  EXPECT_EQ(checked_calls(s, std::vector<Transport::Timing>(12, kUntimed)),
            (std::vector<int>{1, 2, 3, 4, 8, 12}));
}

TEST(VerifySchedule, TimedCallsAreNeverCheckedAndWhatWasDueRunsAfter) {
  // The cost trial times calls 1-3 (as it does the first moved calls): the three checks due
  // there run on calls 4, 5 and 6, one a call; the one due on call 8 runs on 9, after a timed 8.
  VerifySchedule s;
  s.reset(3, 8);
  std::vector<Transport::Timing> calls(10, kUntimed);
  calls[0] = calls[1] = calls[2] = calls[7] = kTimed;
  EXPECT_EQ(checked_calls(s, calls), (std::vector<int>{4, 5, 6, 9}));
}

TEST(VerifySchedule, ACheckOwedNowRunsOnThisCallOrTheNextUntimedOne) {
  // Past the first calls, nothing is due until call 64; the caller owes one now (a send buffer
  // that is not the bound one, GatherOp::verify_now) on call 10 (untimed: runs there) and on
  // call 20 (timed: runs on call 21).
  VerifySchedule s;
  s.reset(1, 64);
  std::vector<int> checked;
  for (int call = 1; call <= 30; ++call) {
    if (call == 10 || call == 20) s.owe(0);
    if (s.on_call(0, call == 20 ? kTimed : kUntimed)) checked.push_back(call);
  }
  EXPECT_EQ(checked, (std::vector<int>{1, 10, 21}));
}

TEST(VerifySchedule, ACheckThatCouldNotStartIsOwedNotLost) {
  VerifySchedule s;
  s.reset(1, 0);
  ASSERT_TRUE(s.on_call(0, kUntimed));
  s.owe(0);  // the backend had another check in flight
  EXPECT_FALSE(s.on_call(0, kTimed));
  EXPECT_TRUE(s.on_call(0, kUntimed));
  EXPECT_FALSE(s.on_call(0, kUntimed));  // every = 0: nothing more after the first
}

TEST(VerifySchedule, OwedChecksDoNotPileUp) {
  // The backend's check is still in flight on a stream that lags far behind, call after call,
  // so every check that falls due is owed back: what is owed stays bounded (first = 2 here).
  VerifySchedule s;
  s.reset(2, 1);
  for (int call = 0; call < 1000; ++call)
    if (s.on_call(0, kTimed) || s.on_call(0, kUntimed)) s.owe(0);
  for (int call = 0; call < 1000; ++call) s.owe(0);
  // The stream caught up: one check a call runs from here, and the calls now owe nothing more
  // than their own due check.
  int run = 0;
  for (int call = 0; call < 10; ++call) run += s.on_call(0, kUntimed) ? 1 : 0;
  EXPECT_EQ(run, 10);
  EXPECT_FALSE(s.on_call(0, kTimed));
  // Capped: a hundred owed back count as two. Calls 1 and 2 are due too but find the cap
  // reached, and each runs one: three checks in all, where without the cap all ten calls would.
  int capped = 0;
  s.reset(2, 1000000);
  for (int call = 0; call < 100; ++call) s.owe(0);
  for (int call = 0; call < 10; ++call) capped += s.on_call(0, kUntimed) ? 1 : 0;
  EXPECT_EQ(capped, 3);
}

TEST(VerifySchedule, BindingsAreCountedApart) {
  VerifySchedule s;
  s.reset(1, 2);
  EXPECT_TRUE(s.on_call(0, kUntimed));
  EXPECT_TRUE(s.on_call(256, kUntimed));  // its own first call
  EXPECT_TRUE(s.on_call(0, kUntimed));    // call 2 of binding 0
  EXPECT_FALSE(s.on_call(0, kUntimed));
  s.reset(1, 2);  // a new plan starts over
  EXPECT_TRUE(s.on_call(0, kUntimed));
}

TEST(VerifySchedule, ChecksAreNumberedPerBindingFromZero) {
  // The ordinal picks the sweep's lines (sample_plan.h): each binding's own count.
  VerifySchedule s;
  s.reset(1, 1);
  EXPECT_EQ(s.begin_check(0), 0u);
  EXPECT_EQ(s.begin_check(0), 1u);
  EXPECT_EQ(s.begin_check(512), 0u);
  EXPECT_EQ(s.begin_check(0), 2u);
  s.reset(1, 1);
  EXPECT_EQ(s.begin_check(0), 0u);
}

}  // namespace
}  // namespace magi::ce
