// Committing a plan (rewrite/commit.h), in one process with a fake transport: the publish and
// confirm this rank contributes, set up at the call or off it, their failures, and the back-off of
// a round issued again while some rank is still setting up.
#include "rewrite/commit.h"

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "tests/rewrite/round_fakes.h"
#include "tests/support/has_line.h"
#include "tests/support/info_logged.h"

namespace magi::rewrite {
namespace {

constexpr uint32_t kPeriod = 3;
float g_shard[1000];  // the send buffer of position 1's gather
float g_output[3000];

struct Committing {
  explicit Committing(Options o = fakes::round_options())
      : options(std::move(o)),
        world(fakes::round_world(options, state,
                                 [this]() -> std::unique_ptr<ce::Transport> {
                                   if (transport_fails) throw Error(ErrorKind::Cuda, "no window");
                                   ++transports;
                                   return std::make_unique<fakes::MovingTransport>(nullptr);
                                 })),
        info(fakes::round_comm_info()),
        log(info.identity),
        serving(world, info, reinterpret_cast<ncclComm_t>(uintptr_t{0x1000})),
        commit(world, info, serving, log) {
    seen.reset(kPeriod, info.rank);
    CallFacts gather;
    gather.op = trace::Op::AllGather;
    gather.dtype = static_cast<uint8_t>(ncclFloat);
    gather.count = 1000;
    gather.sendbuf = reinterpret_cast<uint64_t>(g_shard);
    gather.recvbuf = reinterpret_cast<uint64_t>(g_output);
    seen.observe(1, gather, ce::Backend::Host);
  }
  ~Committing() { serving.drop(); }

  // Position 1 moves, alone in bucket 0 (`bound`: static weights).
  void read_plan(bool bound) {
    plan.decision = Decision{};
    plan.decision.bound = bound;
    plan.decision.gathers = {{1, 0, true, Reason::None, -1}};
    plan.decision.moved = 1;
    plan.decision.hash = 0xdec;
    plan.round = 4;
    plan.layout = lay_out_slots(seen, plan.decision.gathers, bound);
  }
  // Every rank's publish as read: this rank's handle for each.
  CommitOutcome everyone_published() const {
    CommitOutcome read;
    read.agreed = true;
    read.handles.resize(fakes::kRoundRanks);
    read.tables.resize(fakes::kRoundRanks);
    return read;
  }
  Contribution confirmed(uint64_t seq) {
    Contribution c;
    commit.confirm(c, plan, seq);
    return c;
  }

  fakes::RoundWorld state;
  Options options;
  AgreementWorld world;
  capture::CommInfo info;
  AgreementLog log;
  Serving serving;
  Commit commit;
  StepObservation seen;
  ActivePlan plan;
  int transports = 0;
  bool transport_fails = false;
};

// Waits (a little) for a set-up off the calls to end.
template <typename Poll>
bool eventually(Poll poll) {
  for (int i = 0; i < 2000; ++i) {
    if (poll()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

TEST(PlanCommit, ARoundStillSettingUpIsIssuedAgainOneStepLaterThenTwoFourUpToSixtyFour) {
  Committing c;
  uint64_t step = 10;
  // The first pending read: issued again at once (one step after the last).
  EXPECT_TRUE(c.commit.wait(RoundKind::Confirm, 0xdec, step));
  EXPECT_EQ(c.commit.waiting_for(), RoundKind::Confirm);
  EXPECT_EQ(c.commit.waiting_hash(), 0xdecu);
  for (const uint64_t gap : {2, 4, 8, 16, 32, 64, 64}) {
    EXPECT_FALSE(c.commit.wait(RoundKind::Confirm, 0xdec, step));
    EXPECT_FALSE(c.commit.due(step + gap - 2)) << gap;
    EXPECT_TRUE(c.commit.due(step + gap - 1)) << gap;
    step += gap;
  }
  // A read that was not pending: the next wait starts from one step again.
  c.commit.stop_waiting();
  EXPECT_TRUE(c.commit.wait(RoundKind::Publish, 0xdec, step));
  EXPECT_EQ(c.commit.waiting_for(), RoundKind::Publish);
}

TEST(PlanCommit, AQuickWindowIsPreparedAtTheCallAndSaidOnce) {
  test::InfoLogged logged;
  Committing c;
  c.read_plan(false);
  Contribution publish;
  testing::internal::CaptureStderr();
  c.commit.prepare(publish, c.plan, c.seen);
  Contribution again;
  c.commit.prepare_again(again, c.plan);
  const std::string err = testing::internal::GetCapturedStderr();
  for (const Contribution* p : {&publish, &again}) {
    EXPECT_TRUE(p->header.flags & kCanServe);
    EXPECT_FALSE(p->header.flags & kSettingUp);
    EXPECT_EQ(p->header.handle.bytes[0], 0x5a);  // the fake transport's handle
  }
  EXPECT_EQ(c.transports, 1);
  EXPECT_EQ(test::count_lines(err, "window of [0-9]+ bytes \\(two staging slots"), 1u) << err;
}

TEST(PlanCommit, AWindowThatCannotBePreparedRefusesThePlan) {
  test::InfoLogged logged;
  Committing c;
  c.transport_fails = true;
  c.read_plan(false);
  Contribution publish;
  testing::internal::CaptureStderr();
  c.commit.prepare(publish, c.plan, c.seen);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(publish.header.reason, static_cast<uint8_t>(Reason::TransportFailed));
  EXPECT_FALSE(publish.header.flags & kCanServe);
  EXPECT_TRUE(test::has_line(err, "WARN.*cannot prepare a window: .*no window")) << err;
}

TEST(PlanCommit, ASlowOwnersSideRunsOffTheCallsAndThePublishSaysSoUntilItIsReady) {
  Committing c;
  c.world.make.export_ns = 2 * kSetUpAtTheCallNs;  // one bound shard: longer than at a call
  c.read_plan(true);
  Contribution publish;
  c.commit.prepare(publish, c.plan, c.seen);
  EXPECT_TRUE(publish.header.flags & kCanServe);
  EXPECT_TRUE(publish.header.flags & kSettingUp);
  Contribution again;
  ASSERT_TRUE(eventually([&] {
    again = Contribution{};
    c.commit.prepare_again(again, c.plan);
    return !(again.header.flags & kSettingUp);
  }));
  EXPECT_TRUE(again.header.flags & kCanServe);
  EXPECT_EQ(again.header.handle.bytes[0], 0x5a);
  EXPECT_NE(again.header.table_bytes, 0u);  // a static plan publishes its source table
}

TEST(PlanCommit, AConfirmSaysTheSetUpIsDoneOnceTheWindowsAreOpen) {
  Committing c;
  c.read_plan(false);
  Contribution publish;
  c.commit.prepare(publish, c.plan, c.seen);
  c.commit.attach(c.everyone_published());
  const Contribution first = c.confirmed(20);
  EXPECT_TRUE(first.header.flags & kCanServe);
  EXPECT_FALSE(first.header.flags & kSettingUp);
  EXPECT_EQ(first.header.reason, 0);
}

TEST(PlanCommit, ASlowReadersSideRunsOffTheCallsAndTheConfirmWaitsForIt) {
  Committing c;
  c.world.make.mapping_ns = kSetUpAtTheCallNs;  // two peers to map: longer than at a call
  c.read_plan(false);
  Contribution publish;
  c.commit.prepare(publish, c.plan, c.seen);
  c.commit.attach(c.everyone_published());
  Contribution confirm;
  ASSERT_TRUE(eventually([&] {
    confirm = c.confirmed(20);
    EXPECT_TRUE(confirm.header.flags & kCanServe);
    return !(confirm.header.flags & kSettingUp);
  }));
  EXPECT_EQ(confirm.header.reason, 0);
}

TEST(PlanCommit, APlanWhoseWindowIsGoneIsNotConfirmed) {
  test::InfoLogged logged;
  Committing c;
  c.world.make.mapping_ns = kSetUpAtTheCallNs;  // off the calls, where a missing window throws
  c.read_plan(false);
  Contribution publish;
  c.commit.prepare(publish, c.plan, c.seen);
  c.serving.drop();  // nothing to attach: the set-up cannot start
  c.commit.attach(c.everyone_published());
  testing::internal::CaptureStderr();
  const Contribution confirm = c.confirmed(20);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(confirm.header.reason, static_cast<uint8_t>(Reason::TransportFailed));
  EXPECT_FALSE(confirm.header.flags & kCanServe);
  EXPECT_TRUE(test::has_line(err, "WARN.*cannot open the peers' windows")) << err;
  // Asked again, it stays refused.
  testing::internal::CaptureStderr();
  EXPECT_EQ(c.confirmed(23).header.reason, static_cast<uint8_t>(Reason::TransportFailed));
  testing::internal::GetCapturedStderr();
}

TEST(PlanCommit, AStaticShardThatMovedSinceThePublishIsNotConfirmed) {
  Committing c;
  c.read_plan(true);
  Contribution publish;
  c.commit.prepare(publish, c.plan, c.seen);
  c.commit.attach(c.everyone_published());
  // Position 1's next call sends another buffer than the one bound at the publish.
  static float moved[1000];
  c.plan.sources.observe(1, reinterpret_cast<uint64_t>(moved), sizeof moved,
                         c.plan.sources.slot_of(1));
  ASSERT_TRUE(c.plan.sources.changed());
  testing::internal::CaptureStderr();
  const Contribution confirm = c.confirmed(20);
  testing::internal::GetCapturedStderr();
  EXPECT_EQ(confirm.header.reason, static_cast<uint8_t>(Reason::BindingChanged));
}

}  // namespace
}  // namespace magi::rewrite
