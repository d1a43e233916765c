#include "rewrite/active_plan.h"

#include <algorithm>
#include <vector>

namespace magi::rewrite {

void ActivePlan::activate(uint64_t digest, bool dry) {
  ++number_;
  digest_ = digest;
  hash_ = decision.hash;
  dry_ = dry;
  bound_ = decision.bound;
  graph_slots_ = decision.graph_slots && !decision.bound;
}

void ActivePlan::end() {
  hash_ = 0;
  dry_ = false;
  bound_ = false;
  graph_slots_ = false;
  sources.clear();
}

size_t ActivePlan::buckets() const {
  size_t n = 0;
  for (const GatherDecision& g : decision.gathers)
    if (g.moves) n = std::max<size_t>(n, g.bucket + 1u);
  return n;
}

size_t ActivePlan::bound_shards() const {
  size_t shards = 0;
  if (decision.bound)
    for (const GatherDecision& g : decision.gathers) shards += g.moves ? 1 : 0;
  return shards;
}

Decision judged(Decision d, const ExplorationPolicy& policy, const StepObservation& seen,
                bool ce_force, uint64_t step_digest) {
  if (!d.moves_anything()) return d;
  if (policy.nccl_won(d.hash)) {
    // This very plan was timed and NCCL won every bucket: trying it again would only disturb
    // the program every MAGI_REAGREE_STEPS. A plan that differs in any way is tried afresh.
    for (GatherDecision& g : d.gathers) {
      if (!g.moves) continue;
      g.moves = false;
      g.reason = Reason::NcclFaster;
    }
  } else if (!ce_force) {
    // Buckets of sizes NCCL already won stay without being tried.
    std::vector<uint16_t> stays;
    for (const GatherDecision& g : d.gathers)
      if (g.moves && std::find(stays.begin(), stays.end(), g.bucket) == stays.end() &&
          policy.size_verdict(bucket_bytes(seen, g.bucket, d.gathers)) ==
              ExplorationPolicy::SizeVerdict::Stays)
        stays.push_back(g.bucket);
    if (stays.empty()) return d;
    for (GatherDecision& g : d.gathers) {
      if (g.moves && std::find(stays.begin(), stays.end(), g.bucket) != stays.end()) {
        g.moves = false;
        g.reason = Reason::NcclFaster;
      }
    }
  } else {
    return d;
  }
  recount(d, step_digest);
  // Measured, not unsettled: the next propose keeps its usual distance.
  if (!d.moves_anything()) d.retry_soon = false;
  return d;
}

}  // namespace magi::rewrite
