// The cost trial (unless MAGI_CE_FORCE=1, or the sizes of every moving bucket already have a
// verdict: ExplorationPolicy): each moving bucket is timed both ways, then a cost round keeps,
// per bucket, the route that was faster on the slowest rank.
// Its NCCL side is timed first, on calls that go to NCCL anyway: those of the plan's gathers
// between the propose read and the activation. The publish and confirm are read inside the step
// (ExplorationPolicy::read_distance), so the confirm of a timed plan waits until every moving
// bucket has gone to NCCL once since the propose read (nccl_side_routed), at most a step; with
// MAGI_WARMUP_STEPS=1 it does not wait (the plan moves inside the step the propose is read in).
// Its copy-engine side is the first MAGI_WARMUP_STEPS steps after activation. So no call runs the
// slower way on purpose, but for the copy-engine calls of a bucket NCCL then wins. Where a bucket
// was not routed to NCCL by the activation (a confirm that did not wait), the trial alternates,
// step by step, for 2 × MAGI_WARMUP_STEPS steps, starting with the copy engine. Which steps go
// where is a function of the anchor count and of what every rank read: shared by every rank.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "rewrite/contribution.h"
#include "rewrite/observation.h"
#include "rewrite/world.h"

namespace magi::rewrite {

class CostTrial {
 public:
  // A plan of `buckets` buckets was read and is being committed; `timed`: the trial runs, and
  // times its gathers sent to NCCL from here (the NCCL side).
  void begin(bool timed, size_t buckets);
  // The buckets of `layout` (a timed plan's) the NCCL side waits for, each until all its calls
  // of one step, first to last, were routed there (routed_to_nccl): a group the propose was
  // read in, or the plan activated in, is a bucket partly on NCCL, and untimed.
  void await_nccl_routes(const SlotLayout& layout);
  // The call at step `position`, of `bucket`, was routed to NCCL as a trial call. Routes alone,
  // never timings, so the same calls on every rank, whether or not this rank's timer started.
  void routed_to_nccl(uint16_t bucket, uint32_t position);
  // Every awaited bucket went to NCCL (or the trial does not run): its confirm may be read, and
  // the plan activated with no call sent to NCCL on purpose.
  bool nccl_side_routed() const { return !running_ || unrouted_ == 0; }
  // Whether a timed plan's confirm may be read now, before a step has passed: once the NCCL side
  // is routed, or at once with one warmup step, where alternating (2 steps) costs no more NCCL
  // calls than waiting would, and the first gather moves a step sooner.
  bool confirm_may_come(uint64_t warmup_steps) const {
    return nccl_side_routed() || warmup_steps <= 1;
  }
  // The plan was activated at anchor count `steps`: the copy-engine side is timed from here.
  void start(uint64_t steps, uint64_t warmup_steps);
  // The plan ended: nothing more is timed, measurements waiting to be read are dropped.
  void stop();
  // The cost round is issued: from here every agreed bucket moves again.
  void finish() { running_ = false; }

  bool running() const { return running_; }
  // Timings wait to be collected.
  bool timing() const { return !timings_.empty(); }
  // The trial is over at anchor count `steps`: time for the cost round.
  bool due(uint64_t steps) const { return running_ && started_ && steps >= end_; }
  // Alternating (no NCCL timing by the activation): every other step's moved buckets go to NCCL
  // (TrialNccl), timed.
  // The step of the activation moves (it is timed the copy-engine way), the next goes to NCCL,
  // and so on.
  bool sends_to_nccl(uint64_t steps) const {
    return running_ && started_ && alternating_ && (steps - start_) % 2 == 1;
  }
  size_t buckets() const { return moved_ns_.size(); }

  // Around one served bucket: a started timer while the trial runs (null when it does not, or
  // when no timer could be made: unmeasured, the cost round then keeps the bucket moving) ...
  std::unique_ptr<ce::CompletionTimer> begin_timing(const TransportFactory& make,
                                                    void* stream) const;
  // ... stopped after the bucket and read at a later anchor or at the activation (collect),
  // complete by then (the confirm read there waited for a round queued after it). Never
  // throws (it runs as the bucket's serving unwinds): a timing it cannot keep is left unmeasured.
  void end_timing(std::unique_ptr<ce::CompletionTimer> timer, void* stream, uint16_t bucket,
                  bool via_nccl) noexcept;
  void collect();

  // This rank's median per bucket, each way (0: not measured), for the cost round.
  std::vector<BucketCost> medians();
  // Bucket launches timed so far, and those of them that ran the way `costs` found slower
  // (moved ones of a bucket NCCL won; ones sent to NCCL on purpose of a bucket that kept moving).
  uint64_t launches_timed() const;
  uint64_t launches_slower(const std::vector<CostVerdict>& costs) const;

 private:
  struct Timing {
    uint16_t bucket;
    bool via_nccl;
    bool on_purpose;  // sent to NCCL by the alternation, not on its way there anyway
    std::unique_ptr<ce::CompletionTimer> timer;
  };
  bool running_ = false;
  bool started_ = false;      // the plan is active
  bool alternating_ = false;  // some bucket had no NCCL timing at the activation
  uint64_t start_ = 0;        // anchor count at activation
  uint64_t end_ = 0;
  std::vector<Timing> timings_;                  // waiting to be read
  std::vector<std::vector<uint64_t>> moved_ns_;  // by bucket
  std::vector<std::vector<uint64_t>> nccl_ns_;
  std::vector<uint64_t> nccl_on_purpose_;  // by bucket: launches the alternation sent to NCCL
  std::vector<uint32_t> awaited_;          // by bucket: the position awaited + 1; 0: routed
  std::vector<uint32_t> last_;             // by bucket: its last position
  size_t unrouted_ = 0;
};

// The cost round read: the gathers of every bucket NCCL served faster stay from now on (their
// slots are freed in `layout`). Returns how many gathers keep moving.
uint32_t keep_faster(const std::vector<CostVerdict>& costs, Decision& decision, SlotLayout& layout);
// What the choice rested on, bucket by bucket (the first few), at INFO.
void log_costs(uint64_t comm_id, uint32_t round, const std::vector<CostVerdict>& costs);

}  // namespace magi::rewrite
