// The plan of one communicator: the decision its last propose read (and that round's number), the
// slot layout and static sources that serve it, and its activation once every rank confirmed it.
// Whether a plan is in force is the phase's (rewrite/phase.h). The activation record answers for
// the buckets it routed that are served later, at their group's end: by it only if it has not
// ended since (serves()), whatever phase the communicator is in by then.
#pragma once

#include <cstddef>
#include <cstdint>

#include "rewrite/contribution.h"
#include "rewrite/exploration.h"
#include "rewrite/observation.h"
#include "rewrite/route.h"
#include "rewrite/serving.h"

namespace magi::rewrite {

class ActivePlan {
 public:
  Decision decision;     // of the last propose read
  uint32_t round = 0;    // that propose's number
  SlotLayout layout;     // where each moving gather's shard lies
  BoundSources sources;  // static weights: the bindings' send buffers

  // Every rank confirmed the decision (or some rank runs dry) on the step `digest`: it routes
  // from here, as activation number() (Route::plan).
  void activate(uint64_t digest, bool dry);
  // It ends: the buckets it routed that are served later go to NCCL.
  void end();
  uint32_t number() const { return number_; }
  bool dry() const { return dry_; }
  bool bound() const { return bound_; }
  bool graph_slots() const { return graph_slots_; }
  uint64_t hash() const { return hash_; }
  // A bucket routed by activation `plan` is served by the transport: that activation is the
  // latest, has not ended, and moves for real.
  bool serves(uint32_t plan) const { return hash_ != 0 && !dry_ && plan == number_; }
  // `d` is the activation's own plan (a propose that changes nothing).
  bool stands(const Decision& d) const { return d.hash == hash_ && d.dry_run == dry_; }

  // What routes follow (route_by_plan): `in_force` and `committing` as the phase says,
  // `trial_to_nccl` as the cost trial does, `step_digest` the step being observed.
  PlanRoutes routes(bool in_force, bool committing, bool trial_to_nccl,
                    uint64_t step_digest) const {
    PlanRoutes r;
    r.layout = &layout;
    r.in_force = in_force;
    r.plan = number_;
    r.digest = digest_;
    r.dry = dry_;
    r.bound = bound_;
    r.graph_slots = graph_slots_;
    r.trial_to_nccl = trial_to_nccl;
    r.committing = committing;
    r.committed_digest = step_digest;
    return r;
  }

  // Buckets of the decision (the largest moving bucket index + 1).
  size_t buckets() const;
  // The shards a static plan binds (each exported, or copied): none in the default mode.
  size_t bound_shards() const;
  // A publish round's contribution size: sized by the agreed plan (its bound shards), not by this
  // rank's table, so the same on every rank, even one whose window fails.
  size_t publish_bytes() const { return publish_round_bytes(bound_shards()); }

 private:
  uint32_t number_ = 0;  // activations so far
  uint64_t digest_ = 0;  // the step it routes
  uint64_t hash_ = 0;    // its decision's (never 0 for a plan that moves); 0 once ended
  bool dry_ = false;
  bool bound_ = false;        // static weights: its captured gathers move too
  bool graph_slots_ = false;  // default mode with graph slots: likewise
};

// What remembered verdicts make of a propose every rank read alike (ExplorationPolicy): a plan
// NCCL won when timed moves nothing, and buckets of sizes NCCL already won stay untried (unless
// `ce_force`). Every input is shared by every rank, so is the judged decision.
Decision judged(Decision d, const ExplorationPolicy& policy, const StepObservation& seen,
                bool ce_force, uint64_t step_digest);

}  // namespace magi::rewrite
