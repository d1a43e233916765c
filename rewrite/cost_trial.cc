#include "rewrite/cost_trial.h"

#include <algorithm>
#include <cstdio>
#include <string>

namespace magi::rewrite {

void CostTrial::begin(bool timed, size_t buckets) {
  running_ = timed;
  started_ = false;
  alternating_ = false;
  timings_.clear();
  moved_ns_.assign(buckets, {});
  nccl_ns_.assign(buckets, {});
  nccl_on_purpose_.assign(buckets, 0);
  awaited_.assign(buckets, 0);
  last_.assign(buckets, 0);
  unrouted_ = 0;
}

void CostTrial::await_nccl_routes(const SlotLayout& layout) {
  if (!running_) return;
  // Positions in step order: a bucket's first and last calls.
  for (size_t p = 0; p < layout.offset_by_position.size(); ++p) {
    const uint16_t b = layout.bucket_by_position[p];
    if (layout.offset_by_position[p] == SIZE_MAX || b >= awaited_.size()) continue;
    if (awaited_[b] == 0) {
      awaited_[b] = static_cast<uint32_t>(p) + 1;
      ++unrouted_;
    }
    last_[b] = static_cast<uint32_t>(p);
  }
}

void CostTrial::routed_to_nccl(uint16_t bucket, uint32_t position) {
  if (bucket >= awaited_.size() || awaited_[bucket] != position + 1) return;
  if (position != last_[bucket]) {
    awaited_[bucket] = last_[bucket] + 1;  // the rest of this call's bucket, in this step
    return;
  }
  awaited_[bucket] = 0;
  --unrouted_;
}

void CostTrial::start(uint64_t steps, uint64_t warmup_steps) {
  if (!running_) return;
  collect();
  started_ = true;
  start_ = steps;
  // By routes, which every rank shares, not by timings: a rank whose timer could not start has
  // no NCCL timing where its peers have one, and alternating on it alone would send its calls to
  // NCCL while theirs move. Its bucket is unmeasured there, which the cost round reads alike.
  alternating_ = unrouted_ != 0;
  end_ = steps + (alternating_ ? 2 : 1) * warmup_steps;
}

void CostTrial::stop() {
  running_ = false;
  timings_.clear();
}

std::unique_ptr<ce::CompletionTimer> CostTrial::begin_timing(const TransportFactory& make,
                                                             void* stream) const {
  if (!running_) return nullptr;
  try {
    std::unique_ptr<ce::CompletionTimer> timer = make.timer();
    timer->start(stream);
    return timer;
  } catch (const Error&) {
    return nullptr;
  }
}

void CostTrial::end_timing(std::unique_ptr<ce::CompletionTimer> timer, void* stream,
                           uint16_t bucket, bool via_nccl) noexcept {
  if (!timer) return;
  try {
    timer->stop(stream);
    const bool on_purpose = via_nccl && started_;
    timings_.push_back({bucket, via_nccl, on_purpose, std::move(timer)});
  } catch (...) {
    // Unmeasured: the cost round keeps the bucket moving.
  }
}

void CostTrial::collect() {
  for (Timing& t : timings_) {
    const uint64_t ns = t.timer->elapsed_ns();  // a step later: long complete
    if (ns == 0 || t.bucket >= moved_ns_.size()) continue;
    (t.via_nccl ? nccl_ns_ : moved_ns_)[t.bucket].push_back(ns);
    if (t.on_purpose) ++nccl_on_purpose_[t.bucket];
  }
  timings_.clear();
}

std::vector<BucketCost> CostTrial::medians() {
  collect();
  auto median = [](std::vector<uint64_t> v) -> uint64_t {
    if (v.empty()) return 0;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  std::vector<BucketCost> costs;
  for (size_t b = 0; b < moved_ns_.size(); ++b)
    costs.push_back({median(moved_ns_[b]), median(nccl_ns_[b])});
  return costs;
}

uint64_t CostTrial::launches_timed() const {
  uint64_t n = 0;
  for (size_t b = 0; b < moved_ns_.size(); ++b) n += moved_ns_[b].size() + nccl_ns_[b].size();
  return n;
}

uint64_t CostTrial::launches_slower(const std::vector<CostVerdict>& costs) const {
  uint64_t n = 0;
  for (size_t b = 0; b < moved_ns_.size() && b < costs.size(); ++b)
    n += costs[b].keep ? nccl_on_purpose_[b] : moved_ns_[b].size();
  return n;
}

uint32_t keep_faster(const std::vector<CostVerdict>& costs, Decision& decision,
                     SlotLayout& layout) {
  uint32_t moved = 0;
  for (GatherDecision& g : decision.gathers) {
    if (!g.moves) continue;
    if (g.bucket < costs.size() && !costs[g.bucket].keep) {
      g.moves = false;
      g.reason = Reason::NcclFaster;
      layout.offset_by_position[g.position] = SIZE_MAX;
    } else {
      ++moved;
    }
  }
  return moved;
}

void log_costs(uint64_t comm_id, uint32_t round, const std::vector<CostVerdict>& costs) {
  if (!log_detail::enabled(1, Subsystem::Rewrite)) return;
  std::string text;
  constexpr size_t kShown = 6;
  for (size_t b = 0; b < costs.size() && b < kShown; ++b) {
    const CostVerdict& k = costs[b];
    char line[112];
    if (k.measured)
      std::snprintf(line, sizeof line, "%sbucket %zu: copy engine %.1f us, NCCL %.1f us -> %s",
                    b ? "; " : "", b, k.moved_ns / 1e3, k.nccl_ns / 1e3,
                    k.keep ? "copy engine" : "NCCL");
    else
      std::snprintf(line, sizeof line, "%sbucket %zu: not measured on every rank -> copy engine",
                    b ? "; " : "", b);
    text += line;
  }
  if (costs.size() > kShown) text += "; ...";
  MAGI_INFO(Rewrite, "comm %012llx round %u: cost on the slowest rank (median per call): %s",
            short_id(comm_id), round, text.c_str());
}

}  // namespace magi::rewrite
