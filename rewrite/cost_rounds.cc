// The cost round of a plan in force (rewrite/agreement.h): issued once the trial timed both
// routes (its medians per bucket), and read: each bucket keeps the route that was faster on the
// slowest rank, the sizes' verdicts are remembered (ExplorationPolicy), and the plan goes on with
// what keeps moving, or ends where NCCL won every bucket.
#include "rewrite/agreement.h"

namespace magi::rewrite {

void CommAgreement::issue_cost(uint64_t seq) {
  trial_.finish();  // from here every agreed bucket moves again, until the cost round is read
  Contribution c = channel_.header(RoundKind::Cost, stamp(trace::RoundEvent::Issued));
  c.header.decision_hash = plan_.decision.hash;
  c.costs = trial_.medians();
  c.header.gathers = static_cast<uint32_t>(c.costs.size());
  issue(RoundKind::Cost, c, seq);
}

void CommAgreement::after_cost(std::span<const uint8_t> all, uint64_t seq) {
  Decision& d = plan_.decision;
  const std::vector<CostVerdict> costs = decide_cost(all, info_.nranks, trial_.buckets());
  log_costs(info_.identity, plan_.round, costs);
  for (uint16_t b = 0; b < costs.size(); ++b)
    if (costs[b].measured)
      policy_.learn_size(bucket_bytes(step_.seen, b, d.gathers), costs[b].keep);
  policy_.count_timed_calls(trial_.launches_timed());
  policy_.count_slower_calls(trial_.launches_slower(costs));
  const uint32_t moved = keep_faster(costs, d, plan_.layout);
  const bool changed = moved != d.moved;
  d.moved = moved;
  trace_round(RoundKind::Cost, trace::RoundEvent::Read, seq, d.mode,
              changed ? Reason::NcclFaster : Reason::None, moved);
  if (!changed) {
    log_.costs_kept(plan_.round, moved);
    return;
  }
  record_decision(world_.trace, info_, step_.seen, d, plan_.round);
  if (moved == 0) {
    policy_.nccl_won_plan(plan_.hash());
    deactivate(seq, Reason::NcclFaster);
    serving_.drop();
    return;
  }
  trace_round(RoundKind::Cost, trace::RoundEvent::Activated, seq, d.mode, Reason::NcclFaster,
              moved);
  log_.costs_changed(plan_.round, moved, d.gathers.size());
}

}  // namespace magi::rewrite
