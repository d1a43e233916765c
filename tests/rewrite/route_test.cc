// The route of a collective (rewrite/route.h): a pure function of the agreed plan and the call's
// place in the step, so every rank that agreed the same plan routes every call alike; and the
// call path's edges (rewrite/route.cc) that need no agreement at all.
#include "rewrite/route.h"

#include <gtest/gtest.h>

#include <cstdint>

#include "rewrite/group_flush.h"
#include "rewrite/rewrite.h"

namespace magi::rewrite {
namespace {

constexpr uint64_t kDigest = 0xd15e57;

// A step of 4 positions: 1 and 3 move (bucket 0 at offset 0, bucket 1 at offset 256), 0 and 2 stay.
SlotLayout layout() {
  SlotLayout l;
  l.offset_by_position = {SIZE_MAX, 0, SIZE_MAX, 256};
  l.bucket_by_position = {0, 0, 0, 1};
  l.slot_bytes = 512;
  return l;
}

PlanRoutes in_force(const SlotLayout& l) {
  PlanRoutes p;
  p.layout = &l;
  p.in_force = true;
  p.plan = 3;
  p.digest = kDigest;
  return p;
}

CallPlace gather_at(uint32_t position, bool capturing = false, uint64_t digest = kDigest) {
  return {position, true, capturing, digest};
}

using Kind = Route::Kind;

TEST(RouteByPlan, AGatherAtAMovingPositionMovesAtItsSlotAndBucketUnderThePlanInForce) {
  const SlotLayout l = layout();
  const Routed r = route_by_plan(in_force(l), gather_at(3));
  EXPECT_EQ(r.route.kind, Kind::Move);
  EXPECT_EQ(r.route.slot_offset, 256u);
  EXPECT_EQ(r.route.bucket, 1);
  EXPECT_EQ(r.route.plan, 3u);
  EXPECT_FALSE(r.route.captured);
  EXPECT_EQ(r.captured, Routed::Captured::No);
  EXPECT_EQ(route_by_plan(in_force(l), gather_at(1)).route.slot_offset, 0u);
}

TEST(RouteByPlan, EverythingElseStaysOnNccl) {
  const SlotLayout l = layout();
  // A position that does not move, one past the plan, another op, another step, no plan.
  EXPECT_EQ(route_by_plan(in_force(l), gather_at(2)).route.kind, Kind::Nccl);
  EXPECT_EQ(route_by_plan(in_force(l), gather_at(7)).route.kind, Kind::Nccl);
  EXPECT_EQ(route_by_plan(in_force(l), {3, false, false, kDigest}).route.kind, Kind::Nccl);
  EXPECT_EQ(route_by_plan(in_force(l), gather_at(3, false, kDigest + 1)).route.kind, Kind::Nccl);
  PlanRoutes none = in_force(l);
  none.in_force = false;
  EXPECT_EQ(route_by_plan(none, gather_at(3)).route.kind, Kind::Nccl);
}

TEST(RouteByPlan, ADryRunWouldMoveAndTheAlternatingTrialSendsTheStepToNccl) {
  const SlotLayout l = layout();
  PlanRoutes dry = in_force(l);
  dry.dry = true;
  EXPECT_EQ(route_by_plan(dry, gather_at(1)).route.kind, Kind::WouldMove);
  PlanRoutes trial = in_force(l);
  trial.trial_to_nccl = true;
  const Routed r = route_by_plan(trial, gather_at(3));
  EXPECT_EQ(r.route.kind, Kind::TrialNccl);
  EXPECT_EQ(r.route.bucket, 1);
  EXPECT_EQ(r.route.plan, 3u);
}

TEST(RouteByPlan, CapturedGathersMoveOnlyWithStaticWeightsOrGraphSlotsAndNeverInATimedStep) {
  const SlotLayout l = layout();
  const Routed staged = route_by_plan(in_force(l), gather_at(1, true));
  EXPECT_EQ(staged.route.kind, Kind::Nccl);
  EXPECT_EQ(staged.captured, Routed::Captured::Stays);
  for (const bool bound : {true, false}) {
    PlanRoutes p = in_force(l);
    (bound ? p.bound : p.graph_slots) = true;
    const Routed r = route_by_plan(p, gather_at(1, true));
    EXPECT_EQ(r.route.kind, Kind::Move) << bound;
    EXPECT_TRUE(r.route.captured);
    EXPECT_EQ(r.captured, Routed::Captured::Moves);
    // A step the trial times with events goes to NCCL when captured: a graph holds no timer.
    p.trial_to_nccl = true;
    EXPECT_EQ(route_by_plan(p, gather_at(1, true)).route.kind, Kind::Nccl);
    // A dry run moves nothing captured either.
    p.trial_to_nccl = false;
    p.dry = true;
    EXPECT_EQ(route_by_plan(p, gather_at(1, true)).captured, Routed::Captured::Stays);
  }
  // A captured call at a position the plan does not move says nothing.
  EXPECT_EQ(route_by_plan(in_force(l), gather_at(2, true)).captured, Routed::Captured::No);
}

TEST(RouteByPlan, APlanBeingCommittedSendsItsGathersToNccl_TimedForTheNextPlan) {
  const SlotLayout l = layout();
  PlanRoutes p;
  p.layout = &l;
  p.plan = 3;  // the activation before; the committed plan will be the 4th
  p.committing = true;
  p.committed_digest = kDigest;
  const Routed r = route_by_plan(p, gather_at(3));
  EXPECT_EQ(r.route.kind, Kind::TrialNccl);
  EXPECT_EQ(r.route.plan, 4u);
  EXPECT_EQ(r.route.slot_offset, 256u);
  EXPECT_EQ(route_by_plan(p, gather_at(2)).route.kind, Kind::Nccl);
  // Captured calls are not timed (no events in a graph), nor calls of another step.
  EXPECT_EQ(route_by_plan(p, gather_at(3, true)).route.kind, Kind::Nccl);
  EXPECT_EQ(route_by_plan(p, gather_at(3, false, kDigest + 1)).route.kind, Kind::Nccl);
}

TEST(RouteByPlan, RanksWithTheSamePlanRouteEveryCallAlike) {
  // Two ranks' copies of one plan (read from the same bytes): every place gets one route.
  const SlotLayout mine = layout(), theirs = layout();
  for (uint32_t position = 0; position < 6; ++position)
    for (const bool capturing : {false, true}) {
      const Route a = route_by_plan(in_force(mine), gather_at(position, capturing)).route;
      const Route b = route_by_plan(in_force(theirs), gather_at(position, capturing)).route;
      EXPECT_EQ(a.kind, b.kind);
      EXPECT_EQ(a.slot_offset, b.slot_offset);
      EXPECT_EQ(a.bucket, b.bucket);
    }
}

TEST(RouteCallPath, ACallOfACommunicatorOutOfSightIsLeftToNccl) {
  capture::CallArgs args{};
  capture::CallRecord record{};
  capture::StepView view;
  view.collective = true;
  const Outcome outcome = intercept(nullptr, args, record, view);
  EXPECT_FALSE(outcome.served);
  EXPECT_EQ(record.flags & (trace::kCallMoved | trace::kCallFellBack), 0u);
}

TEST(RouteCallPath, AGroupEndReturnsWhatTheRoundsEarlyLaunchesMetWhenNcclItselfSucceeded) {
  early_launches() = {ncclSystemError, 2};
  EXPECT_EQ(group_ended(ncclSuccess), ncclSystemError);
  // Taken once: the next group starts clean.
  EXPECT_EQ(early_launches().calls, 0u);
  EXPECT_EQ(group_ended(ncclSuccess), ncclSuccess);
  // NCCL's own error comes first.
  early_launches() = {ncclSystemError, 1};
  EXPECT_EQ(group_ended(ncclInvalidUsage), ncclInvalidUsage);
}

}  // namespace
}  // namespace magi::rewrite
