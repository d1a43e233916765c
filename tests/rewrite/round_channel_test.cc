// The round channel of one communicator (rewrite/round_channel.h), in one process over fake
// exchanges: a contribution's header, a round issued (alone, or voting no from a group it cannot
// leave), refused, read and recorded, and its buffers reused.
#include "rewrite/round_channel.h"

#include <gtest/gtest.h>

#include <string>

#include "tests/rewrite/round_fakes.h"
#include "tests/support/has_line.h"
#include "tests/support/info_logged.h"

namespace magi::rewrite {
namespace {

using fakes::RoundWorld;

ncclComm_t comm() { return reinterpret_cast<ncclComm_t>(uintptr_t{0x1000}); }

struct Channel {
  explicit Channel(Options o = fakes::round_options())
      : options(std::move(o)),
        world(fakes::round_world(options, state)),
        info(fakes::round_comm_info()),
        policy(options),
        log(info.identity),
        channel(comm(), info, world, policy, log) {}

  RoundStamp stamp() const {
    RoundStamp s;
    s.comm_id = info.identity;
    s.rank = info.rank;
    s.step_digest = 0xd15e57;
    s.round = policy.rounds();
    s.period = 3;
    return s;
  }
  std::unique_ptr<Round> issue(RoundKind kind, uint64_t seq) {
    Contribution c = channel.header(kind, stamp());
    return channel.issue(kind, c, seq, stamp());
  }

  RoundWorld state;
  Options options;
  AgreementWorld world;
  capture::CommInfo info;
  ExplorationPolicy policy;
  AgreementLog log;
  RoundChannel channel;
};

TEST(RoundChannel, AHeaderCarriesThisRanksFactsAndTheStepItIsFor) {
  Channel c(fakes::round_options({{"MAGI_DRY_RUN", "1"}, {"MAGI_STATIC_WEIGHTS", "1"}}));
  const Contribution made = c.channel.header(RoundKind::Publish, c.stamp());
  const ContributionHeader& h = made.header;
  EXPECT_EQ(h.magic, kContributionMagic);
  EXPECT_EQ(h.version, kContributionVersion);
  EXPECT_EQ(h.kind, static_cast<uint8_t>(RoundKind::Publish));
  EXPECT_EQ(h.backend, static_cast<uint8_t>(ce::Backend::Host));
  EXPECT_EQ(h.rank, 0);
  EXPECT_EQ(h.nranks, fakes::kRoundRanks);
  EXPECT_EQ(h.step_digest, 0xd15e57u);
  EXPECT_EQ(h.period, 3u);
  EXPECT_TRUE(h.flags & kDryRun);
  EXPECT_TRUE(h.flags & kStaticWeights);
}

TEST(RoundChannel, GraphSlotsAreAskedForOnceAGatherWasCapturedUnderAuto) {
  Channel automatic;
  EXPECT_FALSE(automatic.channel.header(RoundKind::Propose, automatic.stamp()).header.flags &
               (kWantsGraphSlots | kRefusesGraphSlots));
  automatic.channel.saw_capture();
  EXPECT_TRUE(automatic.channel.header(RoundKind::Propose, automatic.stamp()).header.flags &
              kWantsGraphSlots);
  Channel never(fakes::round_options({{"MAGI_GRAPH_SLOTS", "never"}}));
  never.channel.saw_capture();
  const uint32_t flags = never.channel.header(RoundKind::Propose, never.stamp()).header.flags;
  EXPECT_TRUE(flags & kRefusesGraphSlots);
  EXPECT_FALSE(flags & kWantsGraphSlots);
  Channel always(fakes::round_options({{"MAGI_GRAPH_SLOTS", "always"}}));
  EXPECT_TRUE(always.channel.header(RoundKind::Propose, always.stamp()).header.flags &
              kWantsGraphSlots);
}

TEST(RoundChannel, ARoundIsLaunchedNumberedCountedAndRecordedAsIssued) {
  Channel c;
  c.policy.next_round();
  const std::unique_ptr<Round> round = c.issue(RoundKind::Propose, 42);
  ASSERT_NE(round, nullptr);
  EXPECT_EQ(round->kind, RoundKind::Propose);
  EXPECT_EQ(round->number, 1u);
  EXPECT_FALSE(round->voted_no);
  EXPECT_EQ(c.state.launched, 1);
  EXPECT_EQ(c.policy.rounds_issued(), 1u);
  ASSERT_EQ(c.state.staged.size(), 1u);
  EXPECT_EQ(c.state.staged[0].header.round, 1u);
  EXPECT_FALSE(c.state.staged[0].header.flags & kIssuedInGroup);
  ASSERT_EQ(c.state.rounds.size(), 1u);
  const trace::AgreementRecord& r = c.state.rounds[0];
  EXPECT_EQ(r.event, static_cast<uint8_t>(trace::RoundEvent::Issued));
  EXPECT_EQ(r.kind, static_cast<uint8_t>(RoundKind::Propose));
  EXPECT_EQ(r.seq, 42u);
  EXPECT_EQ(r.round, 1u);
  EXPECT_EQ(r.comm_id, c.info.identity);
}

TEST(RoundChannel, ARoundInAGroupHoldingSendRecvVotesNoAndCannotServe) {
  Channel c;
  c.state.group = {1, true, 2};
  Contribution confirm = c.channel.header(RoundKind::Confirm, c.stamp());
  confirm.header.flags |= kCanServe;
  const std::unique_ptr<Round> round = c.channel.issue(RoundKind::Confirm, confirm, 7, c.stamp());
  ASSERT_NE(round, nullptr);
  EXPECT_TRUE(round->voted_no);
  ASSERT_EQ(c.state.staged.size(), 1u);
  EXPECT_TRUE(c.state.staged[0].header.flags & kIssuedInGroup);
  EXPECT_FALSE(c.state.staged[0].header.flags & kCanServe);
  // A group without Send/Recv is launched in two parts: the round goes alone, and says yes.
  c.state.group = {1, false, 2};
  EXPECT_FALSE(c.issue(RoundKind::Propose, 8)->voted_no);
}

TEST(RoundChannel, ARoundThatCannotBeIssuedIsSaidAndNeitherCountedNorRecorded) {
  test::InfoLogged logged;
  for (const bool nccl_refuses : {false, true}) {
    Channel c;
    if (nccl_refuses)
      c.state.nccl_answer = ncclSystemError;
    else
      c.state.exchange_throws = true;
    testing::internal::CaptureStderr();
    EXPECT_EQ(c.issue(RoundKind::Propose, 5), nullptr);
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_TRUE(test::has_line(err, nccl_refuses ? "WARN.*NCCL refused an agreement round"
                                                 : "WARN.*cannot prepare an agreement round"))
        << err;
    EXPECT_EQ(c.policy.rounds_issued(), 0u);
    EXPECT_TRUE(c.state.rounds.empty());
  }
}

TEST(RoundChannel, AReadRoundHandsEveryRanksContributionAndItsBuffersServeTheNext) {
  Channel c;
  c.state.peer = [](int rank, Contribution& peer) { peer.header.period = 10 + rank; };
  std::unique_ptr<Round> round = c.issue(RoundKind::Propose, 1);
  const std::span<const uint8_t> all = c.channel.read(*round);
  ASSERT_EQ(all.size(), fakes::kRoundRanks * kContributionBytes);
  for (int r = 0; r < fakes::kRoundRanks; ++r) {
    Contribution parsed;
    ASSERT_TRUE(
        Contribution::parse(all.subspan(r * kContributionBytes, kContributionBytes), parsed));
    EXPECT_EQ(parsed.header.rank, r);
    EXPECT_EQ(parsed.header.period, r == 0 ? 3u : 10u + r);
  }
  EXPECT_EQ(c.state.made, 1);
  c.channel.keep(*round);
  std::unique_ptr<Round> next = c.issue(RoundKind::Publish, 4);
  EXPECT_EQ(c.state.made, 1);  // the read round's buffers
  // A round nobody reads is retired: its buffers wait until it completes.
  c.state.ready = false;
  c.channel.retire(*next);
  EXPECT_TRUE(c.channel.any_retired());
  c.channel.free_ready();
  EXPECT_TRUE(c.channel.any_retired());
  c.state.ready = true;
  c.channel.free_ready();
  EXPECT_FALSE(c.channel.any_retired());
}

TEST(RoundChannel, OneRoundWaitsToBeReadUntilTheAnchorTakesIt) {
  Channel c;
  EXPECT_FALSE(c.channel.pending());
  c.channel.pend(c.issue(RoundKind::Propose, 1));
  EXPECT_TRUE(c.channel.pending());
  const std::unique_ptr<Round> taken = c.channel.take_pending();
  ASSERT_NE(taken, nullptr);
  EXPECT_EQ(taken->kind, RoundKind::Propose);
  EXPECT_FALSE(c.channel.pending());
}

}  // namespace
}  // namespace magi::rewrite
