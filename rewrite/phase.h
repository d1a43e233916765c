// The phase of a communicator's agreement: what it is doing, in one value, changed only where a
// round is issued or read, the step is found, changed or lost, or a hello says no (never per call).
//
//   Watching     a propose issued: Proposing
//   Proposing    read: a plan moves: Publishing (a dry run: Active); nothing moves: Watching
//   Publishing   read: every rank can serve: Confirming; one still setting up: SettingUp;
//                otherwise: Watching
//   Confirming   read: every rank confirmed: Active; one still setting up: SettingUp;
//                otherwise: Watching
//   SettingUp    due (1, 2, 4 ... 64 steps later): Publishing or Confirming again
//   Active       the cost trial over: Costing; a propose issued: Reproposing
//   Costing      read: Active (or Watching, where NCCL won every bucket)
//   Reproposing  read: Active (the same plan), Publishing (another), Watching (none)
//   any          the hello said no, or a round could not be issued: Off, for good; the step
//                found, changed or lost: Watching (the round in flight abandoned)
// A plan is in force (its gathers routed by it) in Active, Costing and Reproposing only; a round
// of this communicator is in flight in the phases named after one. A dry run activates straight
// from the propose. A step found, changed or lost ends whatever was agreed: back to Watching.
//
//   Watching     a gather captured with no plan covering it, every rank on this host:
//                AgreeingAtCapture (so is Active, where the plan in force has no graph slots
//                for a default-mode capture: that plan ends at the captured call)
//   AgreeingAtCapture  its rounds run within that call, through the board (rewrite/
//                capture_rounds.cc): every rank confirmed: Active; otherwise: Watching
// The rounds at a capture are issued and read within the one captured call, so no round is in
// flight in that phase once the call returns; it is a phase of its own so the trace shows where
// a plan came from.
#pragma once

#include <cstdint>

#include "rewrite/contribution.h"

namespace magi::rewrite {

enum class Phase : uint8_t {
  Off,                // takes no part: no round on this communicator, ever again
  Watching,           // no plan in force, no round in flight: the step is watched for a propose
  Proposing,          // a propose in flight, no plan in force
  Publishing,         // a plan read, being committed: its publish in flight (none in force)
  Confirming,         // its confirm in flight
  SettingUp,          // a publish or confirm read "still setting up": issued again at a later step
  Active,             // a plan routes the step's gathers; no round in flight
  Costing,            // the plan in force's cost round in flight
  Reproposing,        // a plan in force, the next propose in flight
  AgreeingAtCapture,  // rounds at a CUDA graph capture, within the captured call
};

const char* phase_name(Phase phase);

// The plan agreed last routes the step's gathers.
constexpr bool plan_in_force(Phase p) {
  return p == Phase::Active || p == Phase::Costing || p == Phase::Reproposing;
}
// A round of the communicator (not the hello) waits to be read at the anchor.
constexpr bool round_in_flight(Phase p) {
  return p == Phase::Proposing || p == Phase::Publishing || p == Phase::Confirming ||
         p == Phase::Costing || p == Phase::Reproposing;
}
// A plan read is being committed (publish, confirm, or waiting to issue one again).
constexpr bool committing(Phase p) {
  return p == Phase::Publishing || p == Phase::Confirming || p == Phase::SettingUp;
}
// With no round in flight: Active where a plan is in force, else Watching.
constexpr Phase at_rest(bool in_force) { return in_force ? Phase::Active : Phase::Watching; }
// The phase once a round of `kind` was issued from phase `from` (the hello changes none).
constexpr Phase issued(RoundKind kind, Phase from) {
  switch (kind) {
    case RoundKind::Propose: return plan_in_force(from) ? Phase::Reproposing : Phase::Proposing;
    case RoundKind::Publish: return Phase::Publishing;
    case RoundKind::Confirm: return Phase::Confirming;
    case RoundKind::Cost: return Phase::Costing;
    case RoundKind::Hello: break;
  }
  return from;
}
// The round in flight in phase `p` (round_in_flight(p) only).
constexpr RoundKind round_of(Phase p) {
  switch (p) {
    case Phase::Publishing: return RoundKind::Publish;
    case Phase::Confirming: return RoundKind::Confirm;
    case Phase::Costing: return RoundKind::Cost;
    default: return RoundKind::Propose;
  }
}
// The plan in force ended (deactivated) in phase `p`: the round in flight, if any, stays.
constexpr Phase plan_ended(Phase p) {
  switch (p) {
    case Phase::Active: return Phase::Watching;
    case Phase::Reproposing: return Phase::Proposing;
    case Phase::Costing: return Phase::Watching;  // its cost round means nothing any more
    default: return p;
  }
}

}  // namespace magi::rewrite
