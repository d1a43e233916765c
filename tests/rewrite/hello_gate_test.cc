// The hello gate of one communicator (rewrite/hello_gate.h), in one process over fake exchanges:
// who owes a hello, what a read hello lets through, and how a rank that takes no part only looks.
#include "rewrite/hello_gate.h"

#include <gtest/gtest.h>

#include <cstring>

#include <string>

#include "tests/rewrite/round_fakes.h"
#include "tests/support/has_line.h"
#include "tests/support/info_logged.h"

namespace magi::rewrite {
namespace {

using fakes::RoundWorld;

struct Gate {
  explicit Gate(Options o = fakes::round_options(), capture::CommInfo i = fakes::round_comm_info(),
                bool can_issue = true)
      : options(std::move(o)),
        world(fakes::round_world(options, state)),
        info(i),
        policy(options),
        log(info.identity),
        channel(reinterpret_cast<ncclComm_t>(uintptr_t{0x1000}), info, world, policy, log),
        gate(info, options, can_issue, log) {}

  RoundStamp stamp() const {
    RoundStamp s;
    s.comm_id = info.identity;
    return s;
  }
  // The hello's reads recorded so far: their reasons.
  std::vector<Reason> reads() const {
    std::vector<Reason> out;
    for (const trace::AgreementRecord& r : state.rounds)
      if (r.kind == static_cast<uint8_t>(RoundKind::Hello) &&
          r.event == static_cast<uint8_t>(trace::RoundEvent::Read))
        out.push_back(static_cast<Reason>(r.reason));
    return out;
  }

  RoundWorld state;
  Options options;
  AgreementWorld world;
  capture::CommInfo info;
  ExplorationPolicy policy;
  AgreementLog log;
  RoundChannel channel;
  HelloGate gate;
};

// A peer's hello with MAGI_WARMUP_STEPS=7 where this rank has the default.
void peer_warms_up_longer(int rank, Contribution& c) {
  if (rank != 2) return;
  c.table =
      hello_payload(schedule_settings(fakes::round_options({{"MAGI_WARMUP_STEPS", "7"}}), true));
  c.header.table_bytes = static_cast<uint32_t>(c.table.size());
}

TEST(HelloGate, ACommunicatorThatCanNeverTakePartOwesNoHello) {
  capture::CommInfo one = fakes::round_comm_info();
  one.nranks = 1;
  Gate single(fakes::round_options(), one);
  EXPECT_EQ(single.gate.never(), Reason::SingleRank);
  EXPECT_FALSE(single.gate.owed());
  EXPECT_FALSE(single.gate.takes_part());
  // Said once, at its first collective, for the trace.
  EXPECT_EQ(single.gate.at_collective(0), Reason::SingleRank);
  EXPECT_EQ(single.gate.at_collective(1), Reason::None);

  for (const capture::CommOrigin origin :
       {capture::CommOrigin::InitAll, capture::CommOrigin::Unknown}) {
    capture::CommInfo info = fakes::round_comm_info();
    info.origin = origin;
    Gate g(fakes::round_options(), info);
    EXPECT_EQ(g.gate.never(), Reason::CommNotAgreeable);
    EXPECT_FALSE(g.gate.owed());
    EXPECT_EQ(g.gate.at_collective(0), Reason::None);  // not said: every rank knows it
  }
  capture::CommInfo nonblocking = fakes::round_comm_info();
  nonblocking.nonblocking = true;
  EXPECT_FALSE(Gate(fakes::round_options(), nonblocking).gate.owed());
  // Without the real NCCL's all-gather no round can be issued at all.
  EXPECT_FALSE(Gate(fakes::round_options(), fakes::round_comm_info(), false).gate.owed());
}

TEST(HelloGate, ARankOnNcclStillOwesTheHelloButTakesNoPart) {
  Gate g(fakes::round_options({{"MAGI_TRANSPORT", "nccl"}}));
  EXPECT_EQ(g.gate.never(), Reason::None);
  EXPECT_TRUE(g.gate.owed());
  EXPECT_FALSE(g.gate.takes_part());
  Gate taking_part;
  EXPECT_TRUE(taking_part.gate.owed());
  EXPECT_TRUE(taking_part.gate.takes_part());
}

TEST(HelloGate, SettingsAlikeLetTheFirstRoundThroughOnceTheHelloIsRead) {
  Gate g;
  ASSERT_TRUE(g.gate.issue(g.channel, g.stamp(), 0, 42));
  EXPECT_FALSE(g.gate.owed());
  EXPECT_TRUE(g.gate.in_flight());
  EXPECT_EQ(g.state.launched, 1);
  ASSERT_EQ(g.state.staged.size(), 1u);
  EXPECT_EQ(g.state.staged[0].header.kind, static_cast<uint8_t>(RoundKind::Hello));
  EXPECT_EQ(g.state.results_read, 0);  // not waited for at the first collective
  EXPECT_TRUE(g.gate.read(g.channel, g.stamp(), 9));
  EXPECT_EQ(g.state.results_read, 1);
  EXPECT_FALSE(g.gate.in_flight());
  EXPECT_EQ(g.reads(), std::vector<Reason>{Reason::None});
  // Read once: the next round needs no hello.
  EXPECT_TRUE(g.gate.read(g.channel, g.stamp(), 12));
  EXPECT_EQ(g.state.results_read, 1);
}

// The hello carries where each rank runs: rounds at a graph capture go through shared memory,
// so they need every rank on this host. A rank elsewhere changes no setting.
TEST(HelloGate, TheHelloSaysWhetherEveryRankRunsOnThisHost) {
  for (const bool elsewhere : {false, true}) {
    Gate g;
    if (elsewhere)
      g.state.peer = [](int rank, Contribution& c) {
        if (rank != 1) return;
        ScheduleSettings s{};
        std::memcpy(&s, c.table.data(), sizeof s);
        s.host = 43;
        c.table = hello_payload(s);
      };
    EXPECT_FALSE(g.gate.one_host());  // not before it is read
    ASSERT_TRUE(g.gate.issue(g.channel, g.stamp(), 0, 42));
    ScheduleSettings mine{};
    ASSERT_EQ(g.state.staged[0].table.size(), sizeof mine);
    std::memcpy(&mine, g.state.staged[0].table.data(), sizeof mine);
    EXPECT_EQ(mine.host, 42u);
    EXPECT_TRUE(g.gate.read(g.channel, g.stamp(), 9));
    EXPECT_TRUE(g.gate.agreed());
    EXPECT_EQ(g.gate.one_host(), !elsewhere);
  }
}

TEST(HelloGate, SettingsThatDifferStopEveryRoundAndNameTheSetting) {
  test::InfoLogged logged;
  Gate g;
  g.state.peer = peer_warms_up_longer;
  ASSERT_TRUE(g.gate.issue(g.channel, g.stamp(), 0, 42));
  testing::internal::CaptureStderr();
  EXPECT_FALSE(g.gate.read(g.channel, g.stamp(), 9));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(test::has_line(err, "comm .*MAGI_WARMUP_STEPS")) << err;
  EXPECT_EQ(g.reads(), std::vector<Reason>{Reason::SettingsDiffer});
}

TEST(HelloGate, AHelloIssuedInAGroupHoldingSendRecvIsANoWithoutWaiting) {
  test::InfoLogged logged;
  Gate g;
  g.state.group = {1, true, 1};
  testing::internal::CaptureStderr();
  EXPECT_FALSE(g.gate.issue(g.channel, g.stamp(), 0, 42));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_TRUE(test::has_line(err, "settings check inside a group holding Send/Recv")) << err;
  EXPECT_FALSE(g.gate.in_flight());
  EXPECT_EQ(g.state.results_read, 0);
  EXPECT_EQ(g.reads(), std::vector<Reason>{Reason::AnchorInGroup});
}

TEST(HelloGate, AHelloThatCannotBeIssuedStopsTheRounds) {
  Gate g;
  g.state.nccl_answer = ncclInvalidUsage;
  testing::internal::CaptureStderr();
  EXPECT_FALSE(g.gate.issue(g.channel, g.stamp(), 0, 42));
  testing::internal::GetCapturedStderr();
  EXPECT_FALSE(g.gate.in_flight());
}

TEST(HelloGate, ARankTakingNoPartOnlyLooksOnceCompleteAndSaysOnlyADifference) {
  for (const bool differ : {false, true}) {
    Gate g(fakes::round_options({{"MAGI_TRANSPORT", "nccl"}}));
    if (differ) g.state.peer = peer_warms_up_longer;
    ASSERT_TRUE(g.gate.issue(g.channel, g.stamp(), 0, 42));
    g.gate.at_collective(5);
    g.state.ready = false;
    g.gate.look(g.channel, g.stamp());
    EXPECT_TRUE(g.gate.in_flight());  // never waited for
    g.state.ready = true;
    testing::internal::CaptureStderr();
    g.gate.look(g.channel, g.stamp());
    testing::internal::GetCapturedStderr();
    EXPECT_FALSE(g.gate.in_flight());
    if (differ) {
      ASSERT_EQ(g.reads(), std::vector<Reason>{Reason::SettingsDiffer});
      EXPECT_EQ(g.state.rounds.back().seq, 5u);  // at the latest collective
    } else {
      EXPECT_TRUE(g.reads().empty());
    }
  }
}

}  // namespace
}  // namespace magi::rewrite
