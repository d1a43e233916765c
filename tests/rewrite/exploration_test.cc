// The exploration policy alone, in one process: when rounds come, what is remembered, when it
// stops (rewrite/exploration.h).
#include "rewrite/exploration.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "rewrite/observation.h"
#include "tests/support/options_env.h"

namespace magi::rewrite {
namespace {

using Verdict = ExplorationPolicy::SizeVerdict;

Options options_with(std::map<std::string, std::string> env) {
  env.emplace("MAGI_WARMUP_STEPS", "2");
  env.emplace("MAGI_REAGREE_STEPS", "64");
  return test::options_from(env);
}

// The anchor counts (steps) at which a propose comes due, over `steps` steps, when every round
// is read a step after it was issued and is short of what it could move.
std::vector<uint64_t> proposes_when_unsettled(ExplorationPolicy& policy, uint64_t steps) {
  std::vector<uint64_t> at;
  bool pending = false;
  for (uint64_t s = 0; s < steps; ++s) {
    policy.pass_anchor();
    if (pending) {
      policy.retry_soon();
      pending = false;
    } else if (policy.propose_due(100)) {
      at.push_back(policy.steps());
      pending = true;
    }
  }
  return at;
}

TEST(Exploration, OneRankNeverExploresUnlessForced) {
  EXPECT_EQ(ExplorationPolicy::never_explores(options_with({}), 1), Reason::SingleRank);
  EXPECT_EQ(ExplorationPolicy::never_explores(options_with({{"MAGI_CE_FORCE", "1"}}), 1),
            Reason::None);
  EXPECT_EQ(ExplorationPolicy::never_explores(options_with({}), 2), Reason::None);
  EXPECT_EQ(ExplorationPolicy::never_explores(options_with({}), 8), Reason::None);
}

TEST(Exploration, TheFirstProposeWaitsForTheWarmup) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  policy.restart(0xa, 3, 1);
  EXPECT_FALSE(policy.propose_due(1));
  EXPECT_TRUE(policy.propose_due(2));
}

// The anchor is where the first propose comes soonest: the call that found the step when the
// seeded warmup is complete there, else position 0, where the step that completes it is counted.
TEST(Exploration, TheAnchorIsWhereTheWarmupCompletes) {
  const Options options = options_with({});  // a warmup of 2 steps
  ExplorationPolicy policy(options);
  policy.restart(0xa, 3, 2);
  EXPECT_EQ(policy.anchor(), 3u);
  policy.restart(0xa, 3, 1);
  EXPECT_EQ(policy.anchor(), 0u);
  const Options static_options =
      options_with({{"MAGI_STATIC_WEIGHTS", "1"}, {"MAGI_WARMUP_STEPS", "1"}});
  ExplorationPolicy static_weights(static_options);
  static_weights.restart(0xa, 3, 1);  // two looks at a buffer, whatever the warmup
  EXPECT_EQ(static_weights.anchor(), 0u);
  static_weights.restart(0xa, 3, 2);
  EXPECT_EQ(static_weights.anchor(), 3u);
}

// A propose, publish or confirm is read a quarter step after its issue (at least a call on); a
// cost round a step on; once an in-step commit failed, every round a step on until the step
// changes.
TEST(Exploration, RoundsAreReadAQuarterStepOnUntilACommitFails) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  policy.restart(0xa, 0, 0);
  EXPECT_EQ(policy.read_distance(RoundKind::Propose, 40), 10u);
  EXPECT_EQ(policy.read_distance(RoundKind::Publish, 40), 10u);
  EXPECT_EQ(policy.read_distance(RoundKind::Confirm, 7), 1u);
  EXPECT_EQ(policy.read_distance(RoundKind::Propose, 1), 1u);
  EXPECT_EQ(policy.read_distance(RoundKind::Cost, 40), 40u);
  policy.read_at_anchor();
  EXPECT_EQ(policy.read_distance(RoundKind::Propose, 40), 40u);
  policy.restart(0xb, 0, 0);
  EXPECT_EQ(policy.read_distance(RoundKind::Propose, 40), 10u);
}

// A round read inside the step it was issued in brings the next one no sooner than a round read
// a step later did: the wait counts from the step after the issue.
TEST(Exploration, ARoundReadSoonerBringsTheNextNoSooner) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  policy.restart(0xa, 0, 2);
  policy.pass_anchor();
  ASSERT_TRUE(policy.propose_due(2));
  policy.count_round_issued();
  EXPECT_EQ(policy.waits_from(), 2u);  // read in step 1: as if read at the next anchor
  policy.retry_soon();                 // back-off 1
  EXPECT_FALSE(policy.propose_due(2));
  policy.pass_anchor();
  EXPECT_FALSE(policy.propose_due(2));
  policy.pass_anchor();
  EXPECT_TRUE(policy.propose_due(2));  // step 3, as when the round was read at step 2
}

// Static weights take two alike steps of a position whatever MAGI_WARMUP_STEPS says; the first
// propose waits for two whole steps too, or the positions past the anchor would be one short.
TEST(Exploration, WithStaticWeightsTheFirstProposeWaitsForTwoStepsEvenAtAWarmupOfOne) {
  const Options plain_options = options_with({{"MAGI_WARMUP_STEPS", "1"}});
  ExplorationPolicy plain(plain_options);  // keeps a reference to its options
  plain.restart(0xa, 3, 0);
  EXPECT_TRUE(plain.propose_due(1));
  const Options static_options =
      options_with({{"MAGI_WARMUP_STEPS", "1"}, {"MAGI_STATIC_WEIGHTS", "1"}});
  ExplorationPolicy static_weights(static_options);
  static_weights.restart(0xa, 3, 0);
  EXPECT_FALSE(static_weights.propose_due(1));
  EXPECT_TRUE(static_weights.propose_due(2));
  EXPECT_EQ(stable_steps_needed(1, true), 2u);
  EXPECT_EQ(stable_steps_needed(3, true), 3u);
  EXPECT_EQ(stable_steps_needed(1, false), 1u);
}

// Default mode: back-off doubles from the first round that could not move, up to
// MAGI_REAGREE_STEPS: 1, 2, 4, … steps after each read.
TEST(Exploration, DefaultModeBacksOffFromTheFirstRoundThatCouldNotMove) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  policy.restart(0xa, 0, 0);
  EXPECT_EQ(proposes_when_unsettled(policy, 300),
            (std::vector<uint64_t>{1, 3, 6, 11, 20, 37, 70, 135, 200, 265}));
}

// Static weights wait for stable buffers, which settle as allocators warm up: every step for the
// first kStaticEagerSteps steps, then the same doubling.
TEST(Exploration, StaticWeightsRetryEveryOtherStepWhileTheStepIsYoung) {
  const Options options = options_with({{"MAGI_STATIC_WEIGHTS", "1"}});
  ExplorationPolicy policy(options);
  policy.restart(0xa, 0, 0);
  const std::vector<uint64_t> at = proposes_when_unsettled(policy, 60);
  std::vector<uint64_t> expected;
  for (uint64_t s = 1; s <= ExplorationPolicy::kStaticEagerSteps + 1; s += 2) expected.push_back(s);
  expected.push_back(36);  // read at 34: + 2
  expected.push_back(41);  // read at 37: + 4
  expected.push_back(50);  // read at 42: + 8
  EXPECT_EQ(at, expected);
}

TEST(Exploration, AfterARoundThatMovedAllTheNextComesReagreeStepsLaterOrNever) {
  {
    const Options options = options_with({});
    ExplorationPolicy policy(options);
    policy.restart(0xa, 0, 0);
    for (int i = 0; i < 5; ++i) policy.pass_anchor();
    policy.reagree_later();
    for (int i = 0; i < 63; ++i) policy.pass_anchor();
    EXPECT_FALSE(policy.propose_due(100));
    policy.pass_anchor();
    EXPECT_TRUE(policy.propose_due(100));
  }
  const Options never = options_with({{"MAGI_REAGREE_STEPS", "0"}});
  ExplorationPolicy policy(never);
  policy.restart(0xa, 0, 0);
  policy.reagree_later();
  for (int i = 0; i < 100000; ++i) policy.pass_anchor();
  EXPECT_FALSE(policy.propose_due(100));
}

// A phase that comes back (its step digest seen before) keeps the back-off it had reached; a new
// step starts afresh.
TEST(Exploration, AStepThatComesBackKeepsItsBackOff) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  policy.restart(0xa, 0, 0);
  proposes_when_unsettled(policy, 40);  // proposes at 1, 3, 6, 11, 20, 37: back-off now 64
  policy.restart(0xb, 0, 0);
  EXPECT_EQ(proposes_when_unsettled(policy, 8), (std::vector<uint64_t>{1, 3, 6}));
  policy.restart(0xa, 0, 0);
  // Due at once (the warmup is complete), then 64 steps after the read.
  EXPECT_EQ(proposes_when_unsettled(policy, 70), (std::vector<uint64_t>{1, 66}));
}

TEST(Exploration, APlanNcclWonIsRememberedForItsStep) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  policy.restart(0xa, 0, 0);
  EXPECT_FALSE(policy.nccl_won(0x1234));
  policy.nccl_won_plan(0x1234);
  EXPECT_TRUE(policy.nccl_won(0x1234));
  EXPECT_FALSE(policy.nccl_won(0x1235));
  EXPECT_FALSE(policy.nccl_won(0));
  policy.restart(0xb, 0, 0);
  EXPECT_FALSE(policy.nccl_won(0x1234));
  policy.restart(0xa, 0, 0);
  EXPECT_TRUE(policy.nccl_won(0x1234));
}

// Only so many steps are remembered: the oldest is forgotten first.
TEST(Exploration, TheOldestStepIsForgottenFirst) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  for (uint64_t d = 1; d <= 64; ++d) {
    policy.restart(d, 0, 0);
    policy.nccl_won_plan(d + 100);
  }
  policy.restart(65, 0, 0);  // replaces step 1
  policy.restart(2, 0, 0);
  EXPECT_TRUE(policy.nccl_won(102));
  policy.restart(1, 0, 0);
  EXPECT_FALSE(policy.nccl_won(101));
}

TEST(Exploration, SizeVerdictsFollowWhereTheWinnerChanges) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  EXPECT_EQ(policy.size_verdict(4096), Verdict::Unknown);
  policy.learn_size(16 << 10, /*copy_engine_won=*/false);
  policy.learn_size(1 << 20, /*copy_engine_won=*/true);
  EXPECT_EQ(policy.size_verdict(4 << 10), Verdict::Stays);
  EXPECT_EQ(policy.size_verdict(16 << 10), Verdict::Stays);
  EXPECT_EQ(policy.size_verdict(64 << 10), Verdict::Unknown);  // between: the trial decides
  EXPECT_EQ(policy.size_verdict(1 << 20), Verdict::Moves);
  EXPECT_EQ(policy.size_verdict(256 << 20), Verdict::Moves);
  // A newer verdict for a size replaces the older one.
  policy.learn_size(1 << 20, /*copy_engine_won=*/false);
  EXPECT_EQ(policy.size_verdict(1 << 20), Verdict::Stays);
  EXPECT_EQ(policy.size_verdict(256 << 20), Verdict::Unknown);
}

// Measurements that do not fit one change of winner (NCCL won a size above one the copy engine
// won) give no verdict anywhere: every bucket is timed again.
TEST(Exploration, SizeVerdictsThatContradictEachOtherSayNothing) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  policy.learn_size(4 << 10, /*copy_engine_won=*/true);
  policy.learn_size(1 << 20, /*copy_engine_won=*/false);
  for (const uint64_t bytes : {uint64_t{1} << 10, uint64_t{4} << 10, uint64_t{64} << 10,
                               uint64_t{1} << 20, uint64_t{1} << 30})
    EXPECT_EQ(policy.size_verdict(bytes), Verdict::Unknown) << bytes;
}

TEST(Exploration, StoppingForGoodEndsEveryPropose) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  policy.restart(0xa, 0, 0);
  EXPECT_TRUE(policy.propose_due(100));
  policy.stop(Reason::PeerOffNode);
  EXPECT_TRUE(policy.stopped());
  EXPECT_EQ(policy.stopped_by(), Reason::PeerOffNode);
  EXPECT_FALSE(policy.propose_due(100));
  policy.restart(0xb, 0, 0);  // a new step changes nothing: where ranks run never does
  EXPECT_FALSE(policy.propose_due(100));
  policy.stop(Reason::PeerNotAccessible);
  EXPECT_EQ(policy.stopped_by(), Reason::PeerOffNode);  // the first reason stays
}

TEST(Exploration, TheCostSummarySaysRoundsWaitsAndTimedCalls) {
  const Options options = options_with({});
  ExplorationPolicy policy(options);
  policy.count_round_issued();
  policy.count_round_issued();
  policy.count_round_wait(1500);
  policy.count_round_wait(1000);
  policy.count_timed_calls(6);
  policy.count_slower_calls(3);
  EXPECT_EQ(policy.cost_summary(),
            "2 rounds (2.5 us waiting on them), 6 calls timed, 3 of them the slower way");
  ExplorationPolicy once(options);
  once.count_round_issued();
  once.count_timed_calls(1);
  EXPECT_EQ(once.cost_summary(),
            "1 round (0.0 us waiting on them), 1 call timed, 0 of them the slower way");
}

}  // namespace
}  // namespace magi::rewrite
