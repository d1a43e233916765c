// Refined steps: the step a communicator's rounds and routes follow, when the shape step hides a
// longer one.
//
// A step of identical shapes (L layers of one shard size, nothing else on the communicator) is,
// by shapes, a step of one call whose one position sees L call sites or (static weights, which
// key on buffers) L send buffers in turn: never stable. So each rank also watches its own facts
// (shape position, call site, and with static weights the send buffer) with a second detector,
// fed only while the shape step is found and started afresh with it. When their period is a
// longer multiple of the step rounds follow, the propose carries it, with a phase taken from
// shared facts (a shape position 0). Only when every rank proposed the same (period, phase) does
// decide() say "refine"; then every rank, at that same read, restarts its rounds on the refined
// step, whose positions are (collective index - phase) mod period. Routes stay a function of
// shared facts: the shape digest, the collective index and the agreed period, phase and plan.
//  - Disagreement (a rank proposes nothing, or another period or phase) refines nothing: the
//    round decides on the current step as before, alike on every rank.
//  - A later rank-local change of the buffer sequence does not drop the refinement (no rank
//    could tell the others at that call): like any rank-local change, it shows in the next
//    propose, where the position is not stable and the AND refuses it. Bytes stay exact: the
//    staging transport copies whatever buffer a call names; static weights verify bindings.
//  - The refinement ends where the shape step is lost or changes: the same call on every rank.
// CommAgreement feeds it the calls and what every rank read; it holds no rounds of its own.
#pragma once

#include <cstdint>
#include <memory>

#include "capture/capture.h"
#include "rewrite/contribution.h"
#include "rewrite/observation.h"

namespace magi::rewrite {

class RefinedStep {
 public:
  // Where the communicator may agree: this rank's own facts are watched for steps of up to
  // `max_step_calls` collectives. Made here, not at the call that finds the step: the call path
  // allocates nothing. Without it, nothing is ever proposed.
  void watch_own_facts_up_to(uint32_t max_step_calls);

  // The shape step was found or changed at `view`'s call: rounds follow it, and this rank's own
  // facts are watched afresh from here.
  void follow_shape_step(const capture::StepView& view);
  // Each collective while the shape step is found and holds a gather. O(1), allocation-free: one
  // hash and one push of the detector. `keyed_on_buffers`: the observation's (static weights).
  void watch(const capture::CallRecord& record, const capture::StepView& view,
             bool keyed_on_buffers);
  // Into a propose: the period of this rank's own facts, when it is a longer multiple of the
  // shape step than the step rounds follow now (`seen`'s), and the refined step holds no more
  // gathers than a round carries. Its phase comes from shared facts only (a shape position 0,
  // fixed when the shape step was found): any phase of a periodic sequence is one, and so ranks
  // that see the same period propose the same phase.
  void propose(const StepObservation& seen, ContributionHeader& header) const;
  // Every rank read the refinement (`period`, `phase`) at the same call: from here, rounds and
  // routes follow the refined step.
  void agree(uint32_t period, uint32_t phase);

  // The call's position in the step rounds and routes follow: the shape step's, or the agreed
  // refined step's (both shared facts).
  uint32_t position_of(const capture::StepView& view) const {
    return period_ == 0 ? view.position : refined_position(view.collective_index);
  }
  // Agreed only: the refined position of the collective `collective_index`.
  uint32_t refined_position(uint64_t collective_index) const {
    return static_cast<uint32_t>((collective_index % period_ + period_ - phase_) % period_);
  }
  // Agreed only: the collective index of the first refined position 0 in the shape step's run,
  // where the refined step's observation is seeded from (as a shape step's is from its run's).
  uint64_t refined_run_origin() const {
    return shape_run_origin_ + (phase_ + period_ - shape_run_origin_ % period_) % period_;
  }
  uint32_t period() const { return period_; }  // agreed; 0: rounds follow the shape step
  uint32_t shape_period() const { return shape_period_; }

 private:
  std::unique_ptr<capture::StepDetector> own_steps_;
  uint32_t shape_period_ = 0;
  uint64_t shape_origin_ = 0;      // collective index of a position 0 of the shape step
  uint64_t shape_run_origin_ = 0;  // collective index where the shape step's run began
  uint32_t period_ = 0;            // agreed; 0: rounds follow the shape step
  uint32_t phase_ = 0;             // collective index of refined position 0, mod period_
};

}  // namespace magi::rewrite
