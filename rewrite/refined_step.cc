#include "rewrite/refined_step.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace magi::rewrite {

void RefinedStep::watch_own_facts_up_to(uint32_t max_step_calls) {
  own_steps_ = std::make_unique<capture::StepDetector>(max_step_calls);
}

void RefinedStep::follow_shape_step(const capture::StepView& view) {
  period_ = 0;
  phase_ = 0;
  shape_period_ = view.period;
  shape_origin_ = view.collective_index - view.position;
  shape_run_origin_ = view.origin;
  if (own_steps_) own_steps_->reset();
}

void RefinedStep::watch(const capture::CallRecord& record, const capture::StepView& view,
                        bool keyed_on_buffers) {
  if (!own_steps_) return;
  // Default mode keys gathers without their buffers: a period only the buffers show (layers
  // that share a call site) is no reason to refine there.
  const uint64_t facts[3] = {view.position, record.callsite, keyed_on_buffers ? record.sendbuf : 0};
  own_steps_->push(XXH3_64bits(facts, sizeof facts));
}

void RefinedStep::propose(const StepObservation& seen, ContributionHeader& h) const {
  if (!own_steps_ || !own_steps_->found() || shape_period_ == 0) return;
  const uint32_t period = own_steps_->period();
  const uint32_t current = seen.period();
  if (period % shape_period_ != 0 || period <= shape_period_ || period == current || current == 0 ||
      current % shape_period_ != 0)
    return;
  uint64_t gathers = 0;
  for (uint32_t pos = 0; pos < current; ++pos)
    gathers += seen.at(pos).op == static_cast<uint8_t>(trace::Op::AllGather);
  if (gathers == 0 || gathers * period / current > kMaxGathers) return;
  h.refine_period = period;
  h.refine_phase = static_cast<uint32_t>(shape_origin_ % period);
}

void RefinedStep::agree(uint32_t period, uint32_t phase) {
  period_ = period;
  phase_ = phase;
}

}  // namespace magi::rewrite
