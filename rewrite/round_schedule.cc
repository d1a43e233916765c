#include "rewrite/round_schedule.h"

#include <algorithm>

namespace magi::rewrite {
namespace {
constexpr uint64_t kNever = UINT64_MAX;
}  // namespace

void RoundSchedule::restart(uint32_t position) {
  steps_ = 0;
  anchor_ = position;
  next_propose_ = 0;
  backoff_ = 1;
}

bool RoundSchedule::propose_due(uint64_t complete_steps) const {
  return steps_ >= next_propose_ && complete_steps >= static_cast<uint64_t>(options_.warmup_steps);
}

void RoundSchedule::reagree_later() {
  backoff_ = 1;
  next_propose_ =
      options_.reagree_steps > 0 ? steps_ + static_cast<uint64_t>(options_.reagree_steps) : kNever;
}

void RoundSchedule::retry_soon() {
  next_propose_ = steps_ + backoff_;
  if (steps_ < kEagerSteps) return;
  const uint64_t cap =
      options_.reagree_steps > 0 ? static_cast<uint64_t>(options_.reagree_steps) : kNever / 2;
  backoff_ = std::min(2 * backoff_, cap);
}

void RoundSchedule::move_anchor(uint32_t period) {
  anchor_ = (anchor_ + 1) % period;
  next_propose_ = steps_ + 1;
}

Decision read_propose(std::span<const uint8_t> all, int nranks, int my_rank,
                      uint64_t nccl_faster_hash) {
  Decision d = decide(all, nranks, my_rank);
  if (d.moves_anything() && d.hash == nccl_faster_hash) {
    // This very plan was timed and NCCL won every bucket: trying it again would only disturb
    // the program every MAGI_REAGREE_STEPS. Every rank read the same cost round, so every rank
    // skips it alike; a plan that differs in any way is tried afresh.
    for (GatherDecision& g : d.gathers) {
      if (!g.moves) continue;
      g.moves = false;
      g.reason = Reason::NcclFaster;
    }
    d.moved = 0;
    d.hash = 0;
    d.retry_soon = false;  // measured, not unsettled: the next propose keeps its usual distance
  }
  return d;
}

Decision void_propose(const std::vector<GatherEntry>& entries) {
  Decision d;
  d.reason = Reason::AnchorInGroup;
  for (const GatherEntry& e : entries)
    d.gathers.push_back({e.position, e.bucket, false, Reason::AnchorInGroup, -1});
  return d;
}

}  // namespace magi::rewrite
