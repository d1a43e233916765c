// The route of a collective: what the agreed plan makes of the call at a step position, as a pure
// function of the plan (equal on every rank, read from the same bytes) and the call's place in
// the step (position, digest: shapes) and whether it is captured into a CUDA graph (alike on
// every rank, as assumed of programs). rewrite/agreement.h says why routes therefore never split;
// rewrite/route.cc is the call path that takes them.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ce_transport/ce_transport.h"
#include "rewrite/observation.h"

namespace magi::rewrite {

struct Route {
  // TrialNccl: a moved gather sent to NCCL on purpose, and timed, during the cost trial.
  enum class Kind : uint8_t { Nccl, Move, WouldMove, TrialNccl };
  Kind kind = Kind::Nccl;
  size_t slot_offset = 0;
  // Bucket of the plan. Usually one per ncclGroupStart/End; a group that straddles the step's
  // boundary is two buckets (each packed from offset 0), served one after the other.
  uint16_t bucket = 0;
  // Static weights: this rank's send buffer is bound for no position; its check is owed now
  // (BoundSources, serving.h).
  bool verify_now = false;
  // Static weights: the position's own slot offset, where slot_offset is another position's (the
  // call sends that position's buffer: BoundSources).
  size_t own_offset = ce::GatherOp::kOwn;
  // The activation that routed it (CommAgreement::serve serves it by that plan's window only).
  uint32_t plan = 0;
  // The call's stream is capturing a CUDA graph (a Move of a static plan only): its copies are
  // recorded for every replay (ce::Transport::Timing::Captured).
  bool captured = false;
};

// What routes follow: the plan's slot layout, and the activation in force, if any.
struct PlanRoutes {
  const SlotLayout* layout = nullptr;
  // A plan is in force (routes by its activation below).
  bool in_force = false;
  uint32_t plan = 0;    // the activation's number (Route::plan); a plan committed gets plan + 1
  uint64_t digest = 0;  // the step the activation routes
  bool dry = false;     // MAGI_DRY_RUN: WouldMove, never Move
  bool bound = false;   // static weights: captured gathers move too
  bool graph_slots = false;  // default mode with graph slots: likewise
  // The cost trial sends this step's moved buckets to NCCL (it alternates).
  bool trial_to_nccl = false;
  // A plan read and being committed whose trial times its NCCL side now, on the step
  // `committed_digest`: its gathers go to NCCL anyway, timed there (Route::Kind::TrialNccl).
  bool committing = false;
  uint64_t committed_digest = 0;
};

// Where the call is in the step.
struct CallPlace {
  uint32_t position = 0;
  bool gather = false;     // an all-gather
  bool capturing = false;  // captured into a CUDA graph
  uint64_t digest = 0;     // of the step it was found in
};

struct Routed {
  Route route;
  // A captured gather at a position the plan in force moves: whether it moves with it (said
  // once per answer).
  enum class Captured : uint8_t { No, Moves, Stays } captured = Captured::No;
};

// The route of the call at `place` by the plan alone (a static plan's sources aside: BoundSources
// finds the binding a moved call reads). Hot: no allocation.
Routed route_by_plan(const PlanRoutes& plan, const CallPlace& place);

}  // namespace magi::rewrite
