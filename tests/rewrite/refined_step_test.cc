// The refined-step protocol's own part, in one process: what a rank proposes from its own facts,
// and the positions, seeding origin and restart position once every rank agreed
// (rewrite/refined_step.h). The rounds around it are refine_rounds_test.cc's.
#include "rewrite/refined_step.h"

#include <gtest/gtest.h>

#include <vector>

namespace magi::rewrite {
namespace {

constexpr uint32_t kMaxStepCalls = 2048;

// Where capture puts the collective `index` of a run of identical shapes that began at
// `run_origin`, with a shape step of `shape_period` calls.
capture::StepView shape_view(uint64_t index, uint32_t shape_period, uint64_t run_origin) {
  capture::StepView view;
  view.collective = true;
  view.found = true;
  view.period = shape_period;
  view.position = static_cast<uint32_t>((index - run_origin) % shape_period);
  view.origin = run_origin;
  view.collective_index = index;
  return view;
}

// The program: `layers` all-gathers of one shape per step, each from its own call site, or
// (`own_buffers`) from one call site, each with its own send buffer.
struct Layers {
  uint32_t layers = 4;
  bool own_buffers = false;

  capture::CallRecord call(uint64_t index) const {
    capture::CallRecord record{};
    const uint64_t layer = index % layers;
    record.callsite = own_buffers ? 0x1000 : 0x1000 + layer;
    record.sendbuf = own_buffers ? 0x100000 + layer * 0x10000 : 0x100000;
    return record;
  }
};

// Feeds `calls` collectives from `first` on, as the agreement does while the shape step is found.
void watch(RefinedStep& refined, const Layers& program, uint64_t first, uint64_t calls,
           uint32_t shape_period, uint64_t run_origin, bool keyed_on_buffers) {
  for (uint64_t i = first; i < first + calls; ++i)
    refined.watch(program.call(i), shape_view(i, shape_period, run_origin), keyed_on_buffers);
}

// A rank that watched `calls` collectives of `program` since a shape step of one call was found
// at collective 0 (without watch_own_facts_up_to where `watching` is false).
RefinedStep after(const Layers& program, bool keyed_on_buffers, uint64_t calls = 40,
                  bool watching = true) {
  RefinedStep refined;
  if (watching) refined.watch_own_facts_up_to(kMaxStepCalls);
  refined.follow_shape_step(shape_view(0, 1, 0));
  watch(refined, program, 0, calls, 1, 0, keyed_on_buffers);
  return refined;
}

// What this rank has seen of the step rounds follow now: `period` positions, all gathers unless
// `op` says otherwise.
StepObservation seen_step(uint32_t period, trace::Op op = trace::Op::AllGather) {
  StepObservation seen;
  seen.reset(period);
  seen.begin_step();
  for (uint32_t pos = 0; pos < period; ++pos) {
    CallFacts facts;
    facts.op = op;
    facts.count = 1000;
    seen.observe(pos, facts, ce::Backend::Host);
  }
  return seen;
}

struct Proposal {
  uint32_t period = 0, phase = 0;
};
Proposal proposal(const RefinedStep& refined, const StepObservation& seen) {
  ContributionHeader header{};
  refined.propose(seen, header);
  return {header.refine_period, header.refine_phase};
}

TEST(RefinedStep, ProposesThePeriodOfTheCallSitesBehindIdenticalShapes) {
  const Layers program{4, false};
  RefinedStep refined;
  refined.watch_own_facts_up_to(kMaxStepCalls);
  refined.follow_shape_step(shape_view(13, 1, 5));
  watch(refined, program, 13, 40, 1, 5, false);
  const Proposal p = proposal(refined, seen_step(1));
  EXPECT_EQ(p.period, 4u);
  // The phase makes the call where the shape step was found (a shape position 0) refined
  // position 0.
  refined.agree(p.period, p.phase);
  EXPECT_EQ(refined.position_of(shape_view(13, 1, 5)), 0u);
}

TEST(RefinedStep, RanksThatFoundTheirOwnPeriodAtDifferentCallsProposeTheSamePhase) {
  const Layers program{3, false};
  const capture::StepView found = shape_view(20, 2, 10);  // at shape position 0
  RefinedStep quick, slow;
  quick.watch_own_facts_up_to(kMaxStepCalls);
  slow.watch_own_facts_up_to(kMaxStepCalls);
  quick.follow_shape_step(found);
  slow.follow_shape_step(found);
  watch(quick, program, 20, 60, 2, 10, false);
  // The slow rank's first calls came from call sites of their own (a first step that differs):
  // its detector finds the period later, from another origin.
  for (uint64_t i = 20; i < 31; ++i) {
    capture::CallRecord record = program.call(i);
    record.callsite = 0x9000 + i;
    slow.watch(record, shape_view(i, 2, 10), false);
  }
  watch(slow, program, 31, 60, 2, 10, false);
  const Proposal q = proposal(quick, seen_step(2));
  const Proposal s = proposal(slow, seen_step(2));
  EXPECT_EQ(q.period, 6u);
  EXPECT_EQ(s.period, q.period);
  EXPECT_EQ(s.phase, q.phase);
}

TEST(RefinedStep, TheDefaultModeDoesNotRefineOnBuffersAlone) {
  const RefinedStep refined = after({4, true}, false);
  EXPECT_EQ(proposal(refined, seen_step(1)).period, 0u);
}

TEST(RefinedStep, StaticWeightsRefineOnASendBufferPerLayer) {
  const RefinedStep refined = after({4, true}, true);
  EXPECT_EQ(proposal(refined, seen_step(1)).period, 4u);
}

TEST(RefinedStep, NothingIsProposedOnceRoundsFollowThatPeriod) {
  const RefinedStep refined = after({4, false}, false);
  EXPECT_EQ(proposal(refined, seen_step(4)).period, 0u);
}

TEST(RefinedStep, AStepWithoutAGatherProposesNothing) {
  const RefinedStep refined = after({4, false}, false);
  EXPECT_EQ(proposal(refined, seen_step(1, trace::Op::AllReduce)).period, 0u);
}

TEST(RefinedStep, ARefinedStepIsProposedOnlyWhileARoundCanCarryItsGathers) {
  for (const uint32_t layers : {kMaxGathers, kMaxGathers + 1}) {
    const RefinedStep refined = after({layers, false}, false, 6ull * layers);
    EXPECT_EQ(proposal(refined, seen_step(1)).period, layers <= kMaxGathers ? layers : 0u)
        << layers << " layers";
  }
}

TEST(RefinedStep, ARankThatDoesNotWatchItsOwnFactsProposesNothing) {
  const RefinedStep refined = after({4, false}, false, 40, false);
  EXPECT_EQ(proposal(refined, seen_step(1)).period, 0u);
  EXPECT_EQ(refined.position_of(shape_view(41, 1, 0)), 0u);
}

TEST(RefinedStep, RefinedPositionsCountFromTheAgreedPhase) {
  RefinedStep refined;
  refined.follow_shape_step(shape_view(0, 1, 0));
  EXPECT_EQ(refined.position_of(shape_view(6, 1, 0)), 0u);  // the shape step's
  refined.agree(4, 1);
  std::vector<uint32_t> positions;
  for (uint64_t i = 0; i < 8; ++i) positions.push_back(refined.position_of(shape_view(i, 1, 0)));
  EXPECT_EQ(positions, (std::vector<uint32_t>{3, 0, 1, 2, 3, 0, 1, 2}));
  for (uint64_t i = 0; i < 8; ++i) EXPECT_EQ(refined.refined_position(i), positions[i]);
}

TEST(RefinedStep, ANewShapeStepEndsTheRefinementAndWatchesAfresh) {
  const Layers program{4, false};
  RefinedStep refined = after(program, false);
  refined.agree(4, 0);
  refined.follow_shape_step(shape_view(41, 1, 41));
  EXPECT_EQ(refined.period(), 0u);
  EXPECT_EQ(refined.position_of(shape_view(42, 1, 41)), 0u);
  EXPECT_EQ(proposal(refined, seen_step(1)).period, 0u);  // seen again before it is proposed
  watch(refined, program, 41, 40, 1, 41, false);
  EXPECT_EQ(proposal(refined, seen_step(1)).period, 4u);
}

// The refined step's observation is seeded with the calls since the shape step's run began, from
// its first refined position 0 there.
TEST(RefinedStep, TheRefinedRunBeginsAtTheFirstRefinedPositionZeroOfTheShapeRun) {
  for (const uint64_t run_origin : {0ull, 5ull, 10ull, 1001ull}) {
    for (const uint32_t phase : {0u, 1u, 2u, 5u}) {
      RefinedStep refined;
      refined.follow_shape_step(shape_view(run_origin + 7, 1, run_origin));
      refined.agree(6, phase);
      const uint64_t origin = refined.refined_run_origin();
      EXPECT_GE(origin, run_origin);
      EXPECT_LT(origin, run_origin + 6);
      EXPECT_EQ(refined.refined_position(origin), 0u) << run_origin << " phase " << phase;
    }
  }
}

}  // namespace
}  // namespace magi::rewrite
