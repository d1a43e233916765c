#include "rewrite/exploration.h"

#include <algorithm>
#include <cstdio>

#include "rewrite/observation.h"

namespace magi::rewrite {
namespace {
constexpr uint64_t kNever = UINT64_MAX;
}  // namespace

Reason ExplorationPolicy::never_explores(const Options& options, int nranks) {
  if (nranks == 1 && !options.ce_force) return Reason::SingleRank;
  return Reason::None;
}

void ExplorationPolicy::restart(uint64_t digest, uint32_t position, uint64_t complete_steps) {
  steps_ = 0;
  anchor_ = complete_steps >= warmup_needed() ? position : 0;
  next_propose_ = 0;
  last_issued_ = 0;
  in_step_ = true;
  const auto found = std::find_if(memory_.begin(), memory_.end(),
                                  [&](const StepMemory& m) { return m.digest == digest; });
  if (found != memory_.end()) {
    current_ = static_cast<size_t>(found - memory_.begin());
    return;
  }
  if (memory_.size() < kStepsRemembered) {
    memory_.push_back({});
    current_ = memory_.size() - 1;
  } else {
    current_ = oldest_;
    oldest_ = (oldest_ + 1) % kStepsRemembered;
    memory_[current_] = {};
  }
  current().digest = digest;
}

bool ExplorationPolicy::propose_due(uint64_t complete_steps) const {
  // As many whole steps as a position needs to be stable: a propose sooner (static weights with
  // MAGI_WARMUP_STEPS=1) finds the positions past the anchor one step short, moves the rest, and
  // then replaces its own plan a round later.
  return !stopped() && steps_ >= next_propose_ && complete_steps >= warmup_needed();
}

uint64_t ExplorationPolicy::warmup_needed() const {
  return stable_steps_needed(static_cast<uint64_t>(options_.warmup_steps), options_.static_weights);
}

uint64_t ExplorationPolicy::read_distance(RoundKind kind, uint32_t period) const {
  const uint64_t step = std::max<uint32_t>(period, 1);
  if (kind == RoundKind::Cost || !in_step_) return step;
  return std::max<uint64_t>(step / 4, 1);
}

void ExplorationPolicy::reagree_later() {
  current().backoff = 1;
  next_propose_ = options_.reagree_steps > 0
                      ? waits_from() + static_cast<uint64_t>(options_.reagree_steps)
                      : kNever;
}

void ExplorationPolicy::retry_soon() {
  uint64_t& backoff = current().backoff;
  next_propose_ = waits_from() + backoff;
  if (options_.static_weights && waits_from() < kStaticEagerSteps) return;
  const uint64_t cap =
      options_.reagree_steps > 0 ? static_cast<uint64_t>(options_.reagree_steps) : kNever / 2;
  backoff = std::min(2 * backoff, cap);
}

void ExplorationPolicy::move_anchor(uint32_t period) {
  anchor_ = (anchor_ + 1) % period;
  // The step after the void round's issue, as when it was read at the next anchor: the moved
  // anchor comes round within that step.
  next_propose_ = waits_from();
}

void ExplorationPolicy::stop(Reason why) {
  if (!stopped()) stopped_ = why;
}

void ExplorationPolicy::nccl_won_plan(uint64_t hash) { current().nccl_faster_hash = hash; }

void ExplorationPolicy::learn_size(uint64_t bytes, bool copy_engine_won) {
  std::vector<uint64_t>& won = copy_engine_won ? copy_engine_won_ : nccl_won_;
  const auto at = std::lower_bound(won.begin(), won.end(), bytes);
  if (at == won.end() || *at != bytes) won.insert(at, bytes);
  // A size both routes won (timings that moved between trials) has no verdict of its own: the
  // newer one stands, and the older is forgotten.
  std::vector<uint64_t>& other = copy_engine_won ? nccl_won_ : copy_engine_won_;
  std::erase(other, bytes);
}

ExplorationPolicy::SizeVerdict ExplorationPolicy::size_verdict(uint64_t bytes) const {
  // The copy engine pays a fixed cost per gather and wins by bandwidth, so where the route that
  // wins changes as sizes grow, it changes once, from NCCL to the copy engine. Verdicts are read
  // only while the measurements fit that picture (every size NCCL won below every size the copy
  // engine won); otherwise, and between the two, the trial decides.
  const bool fits =
      copy_engine_won_.empty() || nccl_won_.empty() || nccl_won_.back() < copy_engine_won_.front();
  if (!fits) return SizeVerdict::Unknown;
  if (!copy_engine_won_.empty() && bytes >= copy_engine_won_.front()) return SizeVerdict::Moves;
  if (!nccl_won_.empty() && bytes <= nccl_won_.back()) return SizeVerdict::Stays;
  return SizeVerdict::Unknown;
}

std::string ExplorationPolicy::cost_summary() const {
  char text[192];
  std::snprintf(
      text, sizeof text,
      "%llu round%s (%.1f us waiting on them), %llu call%s timed, %llu of them the "
      "slower way",
      static_cast<unsigned long long>(cost_.rounds_issued), cost_.rounds_issued == 1 ? "" : "s",
      static_cast<double>(cost_.wait_ns) / 1e3, static_cast<unsigned long long>(cost_.timed_calls),
      cost_.timed_calls == 1 ? "" : "s", static_cast<unsigned long long>(cost_.slower_calls));
  return text;
}

}  // namespace magi::rewrite
