// The plan of one communicator (rewrite/active_plan.h): its activations, which buckets they
// still serve, and what a plan needs (buckets, bound shards, a publish's size).
#include "rewrite/active_plan.h"

#include <gtest/gtest.h>

#include "tests/support/options_env.h"

namespace magi::rewrite {
namespace {

Decision plan_of(bool bound, uint64_t hash = 0xabc) {
  Decision d;
  d.bound = bound;
  d.hash = hash;
  // Positions 1 and 4 move, in buckets 0 and 2; position 2 stays.
  d.gathers = {{1, 0, true, Reason::None, -1},
               {2, 1, false, Reason::NotStable, 1},
               {4, 2, true, Reason::None, -1}};
  d.moved = 2;
  return d;
}

TEST(ActivePlan, EachActivationIsNumberedAndServesItsBucketsUntilItEnds) {
  ActivePlan plan;
  plan.decision = plan_of(false);
  EXPECT_FALSE(plan.serves(0));
  plan.activate(0xd1, false);
  EXPECT_EQ(plan.number(), 1u);
  EXPECT_EQ(plan.hash(), 0xabcu);
  EXPECT_TRUE(plan.serves(1));
  EXPECT_FALSE(plan.serves(0));  // a bucket routed by an earlier activation goes to NCCL
  plan.end();
  EXPECT_FALSE(plan.serves(1));
  EXPECT_EQ(plan.hash(), 0u);
  plan.activate(0xd1, false);
  EXPECT_EQ(plan.number(), 2u);
  EXPECT_TRUE(plan.serves(2));
  EXPECT_FALSE(plan.serves(1));
}

TEST(ActivePlan, ADryRunServesNothing) {
  ActivePlan plan;
  plan.decision = plan_of(false);
  plan.activate(0xd1, true);
  EXPECT_TRUE(plan.dry());
  EXPECT_FALSE(plan.serves(plan.number()));
  plan.end();
  EXPECT_FALSE(plan.dry());
}

TEST(ActivePlan, CapturedGathersMoveWithStaticWeightsOrWithGraphSlotsButNeverBoth) {
  ActivePlan plan;
  plan.decision = plan_of(true);
  plan.decision.graph_slots = true;
  plan.activate(0xd1, false);
  EXPECT_TRUE(plan.bound());
  EXPECT_FALSE(plan.graph_slots());  // a static plan needs none
  plan.end();
  EXPECT_FALSE(plan.bound());
  plan.decision = plan_of(false);
  plan.decision.graph_slots = true;
  plan.activate(0xd1, false);
  EXPECT_TRUE(plan.graph_slots());
}

TEST(ActivePlan, AProposeOfTheSamePlanStandsAndADryOrOtherOneDoesNot) {
  ActivePlan plan;
  plan.decision = plan_of(false);
  plan.activate(0xd1, false);
  EXPECT_TRUE(plan.stands(plan_of(false)));
  EXPECT_FALSE(plan.stands(plan_of(false, 0xdef)));
  Decision dry = plan_of(false);
  dry.dry_run = true;
  EXPECT_FALSE(plan.stands(dry));
}

TEST(ActivePlan, ItsRoutesAreTheActivationsAndTheLayouts) {
  ActivePlan plan;
  plan.decision = plan_of(false);
  plan.layout.offset_by_position = {SIZE_MAX, 0, SIZE_MAX, SIZE_MAX, 0};
  plan.layout.bucket_by_position = {0, 0, 0, 0, 2};
  plan.activate(0xd1, false);
  const PlanRoutes r = plan.routes(true, false, false, 0xd1);
  EXPECT_EQ(r.layout, &plan.layout);
  EXPECT_EQ(r.plan, 1u);
  EXPECT_EQ(r.digest, 0xd1u);
  const Routed routed = route_by_plan(r, {4, true, false, 0xd1});
  EXPECT_EQ(routed.route.kind, Route::Kind::Move);
  EXPECT_EQ(routed.route.bucket, 2);
  // Not in force (the phase says so): nothing moves.
  EXPECT_EQ(
      route_by_plan(plan.routes(false, false, false, 0xd1), {4, true, false, 0xd1}).route.kind,
      Route::Kind::Nccl);
}

TEST(ActivePlan, BucketsBoundShardsAndThePublishSizeFollowTheMovingGathers) {
  ActivePlan plan;
  plan.decision = plan_of(false);
  EXPECT_EQ(plan.buckets(), 3u);  // the largest moving bucket, 2, + 1
  EXPECT_EQ(plan.bound_shards(), 0u);
  EXPECT_EQ(plan.publish_bytes(), publish_round_bytes(0));
  plan.decision = plan_of(true);
  EXPECT_EQ(plan.bound_shards(), 2u);
  EXPECT_EQ(plan.publish_bytes(), publish_round_bytes(2));
  plan.decision.gathers.clear();
  EXPECT_EQ(plan.buckets(), 0u);
}

TEST(Judged, APlanNcclWonWhenTimedMovesNothingAndAnotherPlanIsLeftAsRead) {
  const Options options = test::options_from({{"MAGI_BACKEND", "host"}});
  ExplorationPolicy policy(options);
  policy.restart(0xd1, 0, 0);
  StepObservation seen;
  seen.reset(5);
  EXPECT_EQ(judged(plan_of(false), policy, seen, false, 0xd1).moved, 2u);
  policy.nccl_won_plan(0xabc);
  const Decision j = judged(plan_of(false), policy, seen, false, 0xd1);
  EXPECT_EQ(j.moved, 0u);
  EXPECT_FALSE(j.moves_anything());
  EXPECT_FALSE(j.retry_soon);  // measured: the next propose keeps its usual distance
  for (const GatherDecision& g : j.gathers) {
    EXPECT_FALSE(g.moves);
    if (g.position != 2) {
      EXPECT_EQ(g.reason, Reason::NcclFaster) << g.position;
    }
  }
  // Any other plan is tried afresh.
  EXPECT_EQ(judged(plan_of(false, 0xdef), policy, seen, false, 0xd1).moved, 2u);
}

}  // namespace
}  // namespace magi::rewrite
