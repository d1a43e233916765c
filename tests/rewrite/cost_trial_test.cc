// The cost trial of one plan (rewrite/cost_trial.h), on a fake clock: which side of a bucket each
// timing counts for, when the trial is due and when it alternates, the medians it contributes to
// the cost round, and what the round's verdicts do to the decision and its log line.
#include "rewrite/cost_trial.h"

#include <gtest/gtest.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tests/support/info_logged.h"

namespace magi::rewrite {
namespace {

// The time the fake timers read, advanced by the test as a bucket is served.
struct Clock {
  uint64_t now_ns = 1000;
  int timers_made = 0;
  bool start_throws = false;
  bool stop_throws = false;
};

class ClockTimer : public ce::CompletionTimer {
 public:
  explicit ClockTimer(Clock& clock) : clock_(clock) {}
  void start(void*) override {
    if (clock_.start_throws) throw Error(ErrorKind::Cuda, "cannot record the start event");
    start_ = clock_.now_ns;
  }
  void stop(void*) override {
    if (clock_.stop_throws) throw Error(ErrorKind::Cuda, "cannot record the stop event");
    stop_ = clock_.now_ns;
  }
  uint64_t elapsed_ns() override { return stop_ - start_; }

 private:
  Clock& clock_;
  uint64_t start_ = 0;
  uint64_t stop_ = 0;
};

TransportFactory timers_on(Clock& clock) {
  TransportFactory make;
  make.timer = [&clock] {
    ++clock.timers_made;
    return std::make_unique<ClockTimer>(clock);
  };
  return make;
}

// One bucket served, taking `ns` on the clock, timed as the serving does.
void serve(CostTrial& trial, const TransportFactory& make, Clock& clock, uint16_t bucket,
           bool via_nccl, uint64_t ns) {
  std::unique_ptr<ce::CompletionTimer> timer = trial.begin_timing(make, nullptr);
  clock.now_ns += ns;
  trial.end_timing(std::move(timer), nullptr, bucket, via_nccl);
}

std::vector<std::pair<uint64_t, uint64_t>> pairs(const std::vector<BucketCost>& costs) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const BucketCost& c : costs) out.emplace_back(c.moved_ns, c.nccl_ns);
  return out;
}

using Pairs = std::vector<std::pair<uint64_t, uint64_t>>;

TEST(CostTrial, AnUntimedPlanStartsNoTimerAndIsNeverDue) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  trial.begin(false, 2);
  EXPECT_FALSE(trial.running());
  EXPECT_EQ(trial.begin_timing(make, nullptr), nullptr);
  trial.start(10, 3);
  EXPECT_EQ(trial.begin_timing(make, nullptr), nullptr);
  EXPECT_EQ(clock.timers_made, 0);
  EXPECT_FALSE(trial.due(1000));
  EXPECT_FALSE(trial.sends_to_nccl(10));
}

TEST(CostTrial, TimesNcclBeforeTheActivationAndTheCopyEngineForTheWarmupAfterIt) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  trial.begin(true, 2);
  EXPECT_TRUE(trial.running());
  EXPECT_FALSE(trial.due(1000)) << "not due before the plan is active";
  serve(trial, make, clock, 0, true, 100);  // the plan's gathers on their way to NCCL anyway
  serve(trial, make, clock, 1, true, 200);
  EXPECT_TRUE(trial.timing());
  trial.start(10, 3);  // every bucket has its NCCL side: no alternation
  EXPECT_FALSE(trial.timing()) << "the NCCL side is collected at the activation";
  for (uint64_t step = 10; step < 20; ++step) EXPECT_FALSE(trial.sends_to_nccl(step));
  EXPECT_FALSE(trial.due(12));
  EXPECT_TRUE(trial.due(13));  // MAGI_WARMUP_STEPS steps after the activation
  serve(trial, make, clock, 0, false, 50);
  serve(trial, make, clock, 1, false, 300);
  EXPECT_EQ(pairs(trial.medians()), (Pairs{{50, 100}, {300, 200}}));
  EXPECT_EQ(trial.launches_timed(), 4u);
}

// A bucket not routed to NCCL by the activation (a confirm that did not wait, with one warmup
// step) makes the trial alternate for twice the warmup, by routes (shared by every rank), the
// activation's step moving first.
TEST(CostTrial, ABucketNotRoutedToNcclByTheActivationAlternatesForTwiceTheWarmup) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  SlotLayout layout;
  layout.offset_by_position = {0, 0};
  layout.bucket_by_position = {0, 1};
  CostTrial trial;
  trial.begin(true, 2);
  trial.await_nccl_routes(layout);
  trial.routed_to_nccl(0, 0);
  serve(trial, make, clock, 0, true, 100);  // bucket 1 never reached NCCL before the activation
  EXPECT_FALSE(trial.nccl_side_routed());
  EXPECT_FALSE(trial.confirm_may_come(3));  // the confirm waits for the NCCL side
  EXPECT_TRUE(trial.confirm_may_come(1));   // with one warmup step it does not
  trial.start(10, 3);
  EXPECT_FALSE(trial.sends_to_nccl(10));
  EXPECT_TRUE(trial.sends_to_nccl(11));
  EXPECT_FALSE(trial.sends_to_nccl(12));
  EXPECT_TRUE(trial.sends_to_nccl(13));
  EXPECT_FALSE(trial.due(15));
  EXPECT_TRUE(trial.due(16));
}

// Every bucket routed to NCCL, but this rank's timer measured nothing (it could not start): no
// alternation, as on its peers, whose timers worked; the bucket is unmeasured here.
TEST(CostTrial, AnUnmeasuredBucketThatWasRoutedDoesNotAlternate) {
  SlotLayout layout;
  layout.offset_by_position = {0};
  layout.bucket_by_position = {0};
  CostTrial trial;
  trial.begin(true, 1);
  trial.await_nccl_routes(layout);
  trial.routed_to_nccl(0, 0);
  ASSERT_TRUE(trial.nccl_side_routed());
  trial.start(10, 1);
  for (uint64_t step = 10; step < 14; ++step) EXPECT_FALSE(trial.sends_to_nccl(step));
  EXPECT_TRUE(trial.due(11));
  EXPECT_EQ(pairs(trial.medians()), (Pairs{{0, 0}}));
}

// The NCCL side of a timed plan is routed once every bucket had all its calls of one step, first
// to last, routed to NCCL: by routes alone (no timer is asked). A group's later call alone (the
// propose read inside it) does not count; a position that does not move is not awaited.
TEST(CostTrial, TheNcclSideIsRoutedOnceEveryBucketWentThereWhole) {
  SlotLayout layout;
  layout.offset_by_position = {0, 0, 64, SIZE_MAX, 0};
  layout.bucket_by_position = {0, 1, 1, 0, 2};
  CostTrial trial;
  trial.begin(true, 3);
  trial.await_nccl_routes(layout);
  EXPECT_FALSE(trial.nccl_side_routed());
  trial.routed_to_nccl(1, 2);  // the group's second call, its first routed before the read
  trial.routed_to_nccl(2, 4);
  trial.routed_to_nccl(0, 0);
  EXPECT_FALSE(trial.nccl_side_routed());
  trial.routed_to_nccl(1, 1);
  EXPECT_FALSE(trial.nccl_side_routed());
  trial.routed_to_nccl(1, 2);
  EXPECT_TRUE(trial.nccl_side_routed());

  CostTrial untimed;  // no trial: nothing to wait for
  untimed.begin(false, 3);
  untimed.await_nccl_routes(layout);
  EXPECT_TRUE(untimed.nccl_side_routed());
  CostTrial stopped;
  stopped.begin(true, 3);
  stopped.await_nccl_routes(layout);
  stopped.stop();
  EXPECT_TRUE(stopped.nccl_side_routed());
}

TEST(CostTrial, MediansTakeTheMiddleTimingAndZeroForARouteNeverTimed) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  trial.begin(true, 3);
  for (uint64_t ns : {30, 10, 20}) serve(trial, make, clock, 0, true, ns);
  for (uint64_t ns : {40, 10, 30, 20}) serve(trial, make, clock, 1, true, ns);
  trial.start(10, 3);
  for (uint64_t ns : {7, 5, 9, 1000, 6}) serve(trial, make, clock, 0, false, ns);
  // Bucket 1's median of four is the upper middle one; bucket 2 was never timed either way.
  EXPECT_EQ(pairs(trial.medians()), (Pairs{{7, 20}, {0, 30}, {0, 0}}));
}

TEST(CostTrial, ATimingThatReadsZeroOrNamesNoBucketOfThePlanIsLeftOut) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  trial.begin(true, 2);
  serve(trial, make, clock, 0, true, 0);    // a timer that read nothing
  serve(trial, make, clock, 5, true, 100);  // not a bucket of this plan
  serve(trial, make, clock, 1, true, 100);
  EXPECT_EQ(pairs(trial.medians()), (Pairs{{0, 0}, {0, 100}}));
  EXPECT_EQ(trial.launches_timed(), 1u);
}

TEST(CostTrial, ATimerThatCannotStartLeavesTheBucketUnmeasured) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  trial.begin(true, 1);
  clock.start_throws = true;
  EXPECT_EQ(trial.begin_timing(make, nullptr), nullptr);
  serve(trial, make, clock, 0, true, 100);
  EXPECT_FALSE(trial.timing());
  EXPECT_EQ(pairs(trial.medians()), (Pairs{{0, 0}}));
}

TEST(CostTrial, ATimerThatCannotStopLeavesTheBucketUnmeasuredAndThrowsNothing) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  trial.begin(true, 1);
  std::unique_ptr<ce::CompletionTimer> timer = trial.begin_timing(make, nullptr);
  ASSERT_NE(timer, nullptr);
  clock.now_ns += 100;
  clock.stop_throws = true;
  trial.end_timing(std::move(timer), nullptr, 0, true);
  EXPECT_FALSE(trial.timing());
  EXPECT_EQ(pairs(trial.medians()), (Pairs{{0, 0}}));
}

TEST(CostTrial, StopDropsTheTimingsWaitingToBeReadAndTimesNothingMore) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  trial.begin(true, 1);
  serve(trial, make, clock, 0, true, 100);
  trial.stop();
  EXPECT_FALSE(trial.running());
  EXPECT_FALSE(trial.timing());
  EXPECT_EQ(trial.begin_timing(make, nullptr), nullptr);
  EXPECT_EQ(pairs(trial.medians()), (Pairs{{0, 0}}));
}

TEST(CostTrial, FinishEndsTheTrialOnceTheCostRoundIsIssued) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  SlotLayout layout;
  layout.offset_by_position = {0};
  layout.bucket_by_position = {0};
  trial.begin(true, 1);
  trial.await_nccl_routes(layout);  // never routed to NCCL: alternating
  trial.start(10, 1);
  ASSERT_TRUE(trial.due(12));
  ASSERT_TRUE(trial.sends_to_nccl(11));
  trial.finish();
  EXPECT_FALSE(trial.running());
  EXPECT_FALSE(trial.due(12));
  EXPECT_FALSE(trial.sends_to_nccl(11));
}

TEST(CostTrial, ANewPlanStartsAFreshTrial) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  trial.begin(true, 1);
  serve(trial, make, clock, 0, true, 100);
  trial.start(10, 1);
  serve(trial, make, clock, 0, false, 50);
  ASSERT_TRUE(trial.due(11));
  trial.begin(true, 3);
  EXPECT_EQ(trial.buckets(), 3u);
  EXPECT_FALSE(trial.due(1000)) << "the new plan is not active yet";
  EXPECT_EQ(pairs(trial.medians()), (Pairs{{0, 0}, {0, 0}, {0, 0}}));
  EXPECT_EQ(trial.launches_timed(), 0u);
}

TEST(CostTrial, CountsTheLaunchesThatRanTheWayTheCostRoundFoundSlower) {
  Clock clock;
  const TransportFactory make = timers_on(clock);
  CostTrial trial;
  trial.begin(true, 2);
  serve(trial, make, clock, 0, true, 100);  // on its way to NCCL anyway: not on purpose
  trial.start(10, 1);                       // bucket 1 has no NCCL side: alternating
  for (uint64_t step = 10; step < 13; ++step) {
    const bool via_nccl = trial.sends_to_nccl(step);
    serve(trial, make, clock, 0, via_nccl, via_nccl ? 100 : 50);
    serve(trial, make, clock, 1, via_nccl, via_nccl ? 100 : 150);
  }
  trial.collect();
  // Bucket 0 kept moving: its two launches sent to NCCL on purpose ran the slower way. Bucket 1
  // went back to NCCL: its one moved launch did.
  std::vector<CostVerdict> costs(2);
  costs[0].keep = true;
  costs[1].keep = false;
  EXPECT_EQ(trial.launches_slower(costs), 3u);
  EXPECT_EQ(trial.launches_timed(), 7u);
}

// Rank `rank`'s contribution to a cost round of `nranks`: its medians.
Contribution cost_round(int rank, int nranks, const std::vector<BucketCost>& medians) {
  Contribution c;
  c.header.magic = kContributionMagic;
  c.header.version = kContributionVersion;
  c.header.kind = static_cast<uint8_t>(RoundKind::Cost);
  c.header.rank = rank;
  c.header.nranks = nranks;
  c.header.gathers = static_cast<uint32_t>(medians.size());
  c.costs = medians;
  return c;
}

TEST(CostTrial, KeepsABucketOnNcclWhereNcclsMedianIsFaster) {
  // Two ranks, two buckets of two gathers each (positions 1, 2 and 4, 5 of a step of 6); the
  // copy engine wins bucket 0 on both ranks, NCCL wins bucket 1 on rank 1, the slower.
  Clock clock;
  const TransportFactory make = timers_on(clock);
  std::vector<uint8_t> all(2 * kContributionBytes);
  for (int rank = 0; rank < 2; ++rank) {
    CostTrial trial;
    trial.begin(true, 2);
    serve(trial, make, clock, 0, true, 100);
    serve(trial, make, clock, 1, true, 100);
    trial.start(10, 1);
    serve(trial, make, clock, 0, false, 60);
    serve(trial, make, clock, 1, false, rank == 1 ? 150 : 90);
    cost_round(rank, 2, trial.medians())
        .serialize(std::span<uint8_t>(all).subspan(static_cast<size_t>(rank) * kContributionBytes,
                                                   kContributionBytes));
  }
  const std::vector<CostVerdict> costs = decide_cost(all, 2, 2);
  Decision decision;
  decision.gathers = {{1, 0, true, Reason::None, -1},
                      {2, 0, true, Reason::None, -1},
                      {4, 1, true, Reason::None, -1},
                      {5, 1, true, Reason::None, -1}};
  SlotLayout layout;
  layout.offset_by_position = {SIZE_MAX, 0, 256, SIZE_MAX, 0, 256};
  EXPECT_EQ(keep_faster(costs, decision, layout), 2u);
  EXPECT_TRUE(decision.gathers[0].moves);
  EXPECT_TRUE(decision.gathers[1].moves);
  EXPECT_FALSE(decision.gathers[2].moves);
  EXPECT_FALSE(decision.gathers[3].moves);
  EXPECT_EQ(decision.gathers[2].reason, Reason::NcclFaster);
  EXPECT_EQ(decision.gathers[3].reason, Reason::NcclFaster);
  // Their slots are freed; the moving gathers keep theirs.
  EXPECT_EQ(layout.offset_by_position,
            (std::vector<size_t>{SIZE_MAX, 0, 256, SIZE_MAX, SIZE_MAX, SIZE_MAX}));
}

TEST(CostTrial, AGatherThatAlreadyStaysOrWhoseBucketHasNoVerdictIsLeftAsItIs) {
  Decision decision;
  decision.gathers = {{0, 0, false, Reason::OtherRankRefused, 1},
                      {1, 0, true, Reason::None, -1},
                      {2, 3, true, Reason::None, -1}};  // bucket 3: past the verdicts
  SlotLayout layout;
  layout.offset_by_position = {SIZE_MAX, 0, 256};
  std::vector<CostVerdict> costs(1);
  costs[0].keep = false;
  EXPECT_EQ(keep_faster(costs, decision, layout), 1u);
  EXPECT_EQ(decision.gathers[0].reason, Reason::OtherRankRefused);
  EXPECT_FALSE(decision.gathers[1].moves);
  EXPECT_EQ(decision.gathers[1].reason, Reason::NcclFaster);
  EXPECT_TRUE(decision.gathers[2].moves);
  EXPECT_EQ(layout.offset_by_position, (std::vector<size_t>{SIZE_MAX, SIZE_MAX, 256}));
}

std::vector<CostVerdict> verdicts(size_t buckets) {
  std::vector<CostVerdict> costs(buckets);
  for (size_t b = 0; b < buckets; ++b) {
    costs[b].measured = b != 1;
    costs[b].keep = b != 2;
    costs[b].moved_ns = 1500 + 1000 * b;
    costs[b].nccl_ns = 2000;
  }
  return costs;
}

TEST(CostTrial, TheCostLineNamesEachBucketsTimesAndTheRouteItKeeps) {
  const test::InfoLogged info;
  testing::internal::CaptureStderr();
  log_costs(0xc0ffee, 5, verdicts(3));
  log_costs(0xc0ffee, 6, verdicts(7));
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(log.find("comm 000000c0ffee round 5: cost on the slowest rank (median per call): "
                     "bucket 0: copy engine 1.5 us, NCCL 2.0 us -> copy engine; bucket 1: not "
                     "measured on every rank -> copy engine; bucket 2: copy engine 3.5 us, NCCL "
                     "2.0 us -> NCCL\n"),
            std::string::npos)
      << log;
  // The first six buckets, then an ellipsis.
  EXPECT_NE(log.find("round 6: cost on the slowest rank (median per call): bucket 0: "),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("; bucket 5: copy engine 6.5 us, NCCL 2.0 us -> copy engine; ...\n"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find("bucket 6"), std::string::npos) << log;
}

TEST(CostTrial, TheCostLineIsSilentBelowInfo) {
  const int level = log_detail::g_level.exchange(0);
  testing::internal::CaptureStderr();
  log_costs(0xc0ffee, 5, verdicts(3));
  const std::string log = testing::internal::GetCapturedStderr();
  log_detail::g_level.store(level);
  EXPECT_EQ(log, "");
}

}  // namespace
}  // namespace magi::rewrite
