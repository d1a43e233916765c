// The cost trial (unless MAGI_CE_FORCE=1): for 2 × MAGI_WARMUP_STEPS steps after activation, the
// moved buckets alternate, step by step, between the transport and NCCL, each timed to
// completion; then a cost round keeps, per bucket, the route that was faster on the slowest rank.
// Which steps go where is a function of the anchor count: shared by every rank.
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
  // A plan of `buckets` buckets was activated at anchor count `steps`; `timed`: the trial runs.
  void start(bool timed, uint64_t steps, uint64_t warmup_steps, size_t buckets);
  // The plan ended: nothing more is timed, measurements waiting to be read are dropped.
  void stop();
  // The cost round is issued: from here every agreed bucket moves again.
  void finish() { running_ = false; }

  bool running() const { return running_; }
  // Timings wait to be collected.
  bool timing() const { return !timings_.empty(); }
  // The trial is over at anchor count `steps`: time for the cost round.
  bool due(uint64_t steps) const { return running_ && steps >= end_; }
  // During the trial, every other step's moved buckets go to NCCL (TrialNccl), timed.
  bool sends_to_nccl(uint64_t steps) const { return running_ && (steps - start_) % 2 == 0; }
  size_t buckets() const { return moved_ns_.size(); }

  // Around one served bucket: a started timer while the trial runs (null when it does not, or
  // when no timer could be made: unmeasured, the cost round then keeps the bucket moving) ...
  std::unique_ptr<ce::CompletionTimer> begin_timing(const TransportFactory& make,
                                                    void* stream) const;
  // ... stopped after the bucket and read a step later (collect), long complete by then. Never
  // throws (it runs as the bucket's serving unwinds): a timing it cannot keep is left unmeasured.
  void end_timing(std::unique_ptr<ce::CompletionTimer> timer, void* stream, uint16_t bucket,
                  bool via_nccl) noexcept;
  void collect();

  // This rank's median per bucket, each way (0: not measured), for the cost round.
  std::vector<BucketCost> medians();

 private:
  struct Timing {
    uint16_t bucket;
    bool via_nccl;
    std::unique_ptr<ce::CompletionTimer> timer;
  };
  bool running_ = false;
  uint64_t start_ = 0;  // anchor count at activation
  uint64_t end_ = 0;
  std::vector<Timing> timings_;                  // waiting to be read
  std::vector<std::vector<uint64_t>> moved_ns_;  // by bucket
  std::vector<std::vector<uint64_t>> nccl_ns_;
};

// The cost round read: the gathers of every bucket NCCL served faster stay from now on (their
// slots are freed in `layout`). Returns how many gathers keep moving.
uint32_t keep_faster(const std::vector<CostVerdict>& costs, Decision& decision, SlotLayout& layout);
// What the choice rested on, bucket by bucket (the first few), at INFO.
void log_costs(uint64_t comm_id, uint32_t round, const std::vector<CostVerdict>& costs);

}  // namespace magi::rewrite
