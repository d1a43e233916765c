// The phase of a communicator's agreement (rewrite/phase.h): which phases hold a plan in force or
// a round in flight, and where issuing a round, reading one or ending a plan leads.
#include "rewrite/phase.h"

#include <gtest/gtest.h>

#include <set>
#include <string>

namespace magi::rewrite {
namespace {

constexpr Phase kAll[] = {
    Phase::Off,         Phase::Watching,         Phase::Proposing, Phase::Publishing,
    Phase::Confirming,  Phase::SettingUp,        Phase::Active,    Phase::Costing,
    Phase::Reproposing, Phase::AgreeingAtCapture};

TEST(Phase, APlanIsInForceOnlyWhileActiveOrWhileItsCostOrNextProposeIsInFlight) {
  std::set<Phase> in_force;
  for (const Phase p : kAll)
    if (plan_in_force(p)) in_force.insert(p);
  EXPECT_EQ(in_force, (std::set<Phase>{Phase::Active, Phase::Costing, Phase::Reproposing}));
}

TEST(Phase, ARoundIsInFlightInThePhasesNamedAfterOneAndNowhereElse) {
  for (const Phase p : kAll) {
    const bool named_after_a_round = p == Phase::Proposing || p == Phase::Publishing ||
                                     p == Phase::Confirming || p == Phase::Costing ||
                                     p == Phase::Reproposing;
    EXPECT_EQ(round_in_flight(p), named_after_a_round) << phase_name(p);
  }
  // The rounds at a capture are issued and read within one call: none is in flight after it, and
  // no plan is in force while they run.
  EXPECT_FALSE(round_in_flight(Phase::AgreeingAtCapture));
  EXPECT_FALSE(plan_in_force(Phase::AgreeingAtCapture));
  EXPECT_STREQ(phase_name(Phase::AgreeingAtCapture), "agreeing-at-capture");
  // Waiting to issue a publish or confirm again holds no round: the anchor issues it when due.
  EXPECT_FALSE(round_in_flight(Phase::SettingUp));
  EXPECT_TRUE(committing(Phase::SettingUp));
  EXPECT_FALSE(committing(Phase::Active));
  EXPECT_FALSE(committing(Phase::Proposing));
}

TEST(Phase, IssuingARoundNamesTheRoundInFlightAndKeepsThePlanInForce) {
  EXPECT_EQ(issued(RoundKind::Propose, Phase::Watching), Phase::Proposing);
  EXPECT_EQ(issued(RoundKind::Propose, Phase::Active), Phase::Reproposing);
  EXPECT_EQ(issued(RoundKind::Publish, Phase::Watching), Phase::Publishing);
  EXPECT_EQ(issued(RoundKind::Publish, Phase::SettingUp), Phase::Publishing);
  EXPECT_EQ(issued(RoundKind::Confirm, Phase::Watching), Phase::Confirming);
  EXPECT_EQ(issued(RoundKind::Confirm, Phase::SettingUp), Phase::Confirming);
  EXPECT_EQ(issued(RoundKind::Cost, Phase::Active), Phase::Costing);
  // The hello is the hello gate's: it changes no phase.
  for (const Phase p : kAll) EXPECT_EQ(issued(RoundKind::Hello, p), p);
  // Whatever is issued, the round in flight is the one the phase names.
  for (const RoundKind k : {RoundKind::Propose, RoundKind::Publish, RoundKind::Confirm})
    EXPECT_EQ(round_of(issued(k, Phase::Watching)), k);
  EXPECT_EQ(round_of(issued(RoundKind::Cost, Phase::Active)), RoundKind::Cost);
  EXPECT_EQ(round_of(issued(RoundKind::Propose, Phase::Active)), RoundKind::Propose);
}

TEST(Phase, AReadRoundLeavesThePlanAsItWasAndAnEndedPlanKeepsTheProposeInFlight) {
  EXPECT_EQ(at_rest(true), Phase::Active);
  EXPECT_EQ(at_rest(false), Phase::Watching);
  for (const Phase p : kAll) EXPECT_FALSE(plan_in_force(plan_ended(p))) << phase_name(p);
  EXPECT_EQ(plan_ended(Phase::Active), Phase::Watching);
  EXPECT_EQ(plan_ended(Phase::Reproposing), Phase::Proposing);
  // Phases without a plan in force are left as they are.
  for (const Phase p : kAll) {
    if (!plan_in_force(p)) {
      EXPECT_EQ(plan_ended(p), p) << phase_name(p);
    }
  }
}

TEST(Phase, EveryPhaseHasANameOfItsOwn) {
  std::set<std::string> names;
  for (const Phase p : kAll) names.insert(phase_name(p));
  EXPECT_EQ(names.size(), std::size(kAll));
  EXPECT_EQ(std::string(phase_name(Phase::SettingUp)), "setting-up");
}

}  // namespace
}  // namespace magi::rewrite
