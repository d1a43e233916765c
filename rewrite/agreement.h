// Agreement for one communicator: the rounds, the plan, and the route of each collective.
//
// When rounds happen. Only at the anchor, one position of the communicator's step (as capture's
// step detector reports it; 0 when the step is found), counted in steps since the step was found.
// The detector sees only shapes (op, type, count, root, reduction), which every rank of a correct
// NCCL program issues alike, so every rank finds, loses and positions the step at the same call,
// and so issues each round at the same place in the communicator's call sequence: our all-gather
// never meets a different call of another rank.
//
//   W = MAGI_WARMUP_STEPS complete steps observed:  issue propose at the anchor
//   next step:   read propose -> decision (the ladder, rewrite/contribution.h); issue publish
//                with this rank's window handle if something moves
//   next step:   read publish -> open peers' windows; issue confirm (opened, or not)
//   next step:   read confirm -> every rank opened every window: routes change here
// and a new propose every MAGI_REAGREE_STEPS steps after. A round is read one step after it was
// issued: the host waits there only if the round is somehow still in flight.
//
// Why a round never hangs. A round's all-gather is issued before the anchor call, on every rank,
// and is launched at once unless the program has a group open; in that case this rank votes "no"
// (kIssuedInGroup) and, knowing the answer without reading, never waits on it: the others read
// its vote and reach the same answer (decide() puts that vote before everything else). So a rank
// only ever waits for an all-gather every rank has launched. After such a void round every rank
// moves the anchor one position on, and the next propose comes one step later, until a position
// outside the program's groups is found.
//
// Why routes never split. The route of a call is a function of the agreed plan (equal on every
// rank, read from the same bytes) and the call's step position and step digest (shapes alone).
//  - A call that deviates in a shared fact (count, type, order) changes the shape sequence: the
//    detector loses the step at that very call on every rank, the plan is dropped there, and that
//    call and all after it go to NCCL until a new agreement.
//  - A rank-local change (a new send buffer, another call site) changes no route. It cannot break
//    bytes either: the default transport copies the send buffer on every call, so it reads
//    whatever buffer the call names. The change shows in the next propose round, where it makes
//    the gather "not stable" on that rank, which the AND spreads to every rank.
//  - A transport failure on one rank returns an error for that call and makes that rank refuse
//    every gather in the next propose, so routes go back to NCCL everywhere at one call.
//
// Refined steps. A step of identical shapes (L layers of one shard size, nothing else on the
// communicator) is, by shapes, a step of one call whose one position sees L send buffers in
// turn: never stable. So each rank also watches its own facts (shape position, call site, send
// buffer) with a second detector, fed only while the shape step is found and started afresh
// with it. When their period is a longer multiple of the step rounds follow, the propose carries
// it, with a phase taken from shared facts (a shape position 0). Only when every rank proposed
// the same (period, phase) does decide() say "refine"; then every rank, at that same read,
// restarts its rounds on the refined step, whose positions are (collective index - phase) mod
// period. Routes stay a function of shared facts: the shape digest, the collective index and the
// agreed period, phase and plan.
//  - Disagreement (a rank proposes nothing, or another period or phase) refines nothing: the
//    round decides on the current step as before, alike on every rank.
//  - A later rank-local change of the buffer sequence does not drop the refinement (no rank
//    could tell the others at that call): like any rank-local change, it shows in the next
//    propose, where the position is not stable and the AND refuses it. Bytes stay exact: the
//    staging transport copies whatever buffer a call names; static weights verify bindings.
//  - The refinement ends where the shape step is lost or changes: the same call on every rank.
// Assumed, and checked at each propose: the ranks group their calls (ncclGroupStart/End) the
// same way; a difference aborts the agreement (buckets and window slots follow the groups).
// Assumed, not checkable: a call captured into a CUDA graph on one rank is captured on all (it
// stays on NCCL, since a replay would repeat the handshake's sequence numbers).
#pragma once

#include <nccl.h>

#include <memory>
#include <span>
#include <vector>

#include "capture/capture.h"
#include "ce_transport/ce_transport.h"
#include "rewrite/contribution.h"
#include "rewrite/cost_trial.h"
#include "rewrite/group_flush.h"
#include "rewrite/observation.h"
#include "rewrite/rewrite.h"
#include "rewrite/round_log.h"
#include "rewrite/round_schedule.h"
#include "rewrite/serving.h"
#include "rewrite/world.h"

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
};

// Coordinates the parts for one communicator: the round schedule, the rounds themselves (issued
// through a GroupFlush, recorded through round_log), the active plan, its Serving and CostTrial.
class CommAgreement {
 public:
  CommAgreement(ncclComm_t comm, const capture::CommInfo& info, AgreementWorld world);
  ~CommAgreement();
  CommAgreement(const CommAgreement&) = delete;
  CommAgreement& operator=(const CommAgreement&) = delete;

  // For each collective of the communicator, before it is forwarded.
  Route on_collective(const capture::CallArgs& args, capture::CallRecord& record,
                      const capture::StepView& view);

  // Serves moved gathers (one bucket) on the caller's stream. Returns what the program gets.
  // `calls` are the same gathers as NCCL would take them, for a bucket every rank falls back on.
  // `via_nccl`: a trial bucket, served by NCCL and timed.
  // `moved` (if given): whether the transport served it, rather than NCCL.
  ncclResult_t serve(std::span<const ce::GatherOp> bucket, std::span<const NcclGather> calls,
                     cudaStream_t stream, uint16_t bucket_id, bool via_nccl, bool* moved = nullptr);

  uint64_t identity() const { return info_.identity; }
  ncclComm_t comm() const { return comm_; }
  const AgreementWorld& world() const { return world_; }

  // The communicator is being aborted, maybe from another thread while a call of this one is
  // blocked: the transport stops waiting on peers now, and no window is made after this.
  void abandon() { serving_.abandon(); }
  // Ours, for ncclCommGetAsyncError (Serving::async_error). Any thread.
  ncclResult_t async_error() { return serving_.async_error(); }
  // A moved gather failed outside the transport (`why`, said once): the communicator refuses
  // every gather at its next propose, as after a transport error.
  void fail_transport(const char* why) noexcept { serving_.fail(why); }

 private:
  struct Round {
    RoundKind kind;
    uint32_t number;
    std::unique_ptr<ce::Exchange> exchange;
    bool voted_no = false;       // issued inside an open group: this rank said no
    uint64_t decision_hash = 0;  // publish/confirm
  };

  void restart(const capture::StepView& view);
  // The call's position in the step rounds and routes follow: the shape step's, or the agreed
  // refined step's (both shared facts).
  uint32_t position_of(const capture::StepView& view) const {
    return refined_period_ == 0 ? view.position
                                : static_cast<uint32_t>((view.collective_index % refined_period_ +
                                                         refined_period_ - refined_phase_) %
                                                        refined_period_);
  }
  void forget_refinement(const capture::StepView& view);
  void watch_own_facts(const capture::CallRecord& record, const capture::StepView& view);
  void propose_refinement(ContributionHeader& header) const;
  void refine(const Decision& decision, uint64_t seq);
  void on_lost(uint64_t seq);
  void abandon_pending(uint64_t seq);
  void at_anchor(const capture::StepView& view);
  void read_round(uint64_t seq);
  void read_voted_no(Round& round, uint64_t seq);
  void read_publish(std::span<const uint8_t> all, const Round& round, uint64_t seq);
  void read_confirm(std::span<const uint8_t> all, const Round& round, uint64_t seq);
  void issue(RoundKind kind, Contribution& contribution, uint64_t seq);
  Contribution header_for(RoundKind kind) const;
  void propose(uint64_t seq);
  void take_decision(const Decision& decision, uint32_t round, uint64_t seq);
  void after_propose(const Decision& decision, uint64_t seq);
  void publish(uint64_t seq);
  void activate(uint64_t seq);
  void issue_cost(uint64_t seq);
  void after_cost(std::span<const uint8_t> all, uint64_t seq);
  void deactivate(uint64_t seq, Reason why);
  void retire(std::unique_ptr<ce::Exchange> exchange);
  void record(RoundKind kind, trace::RoundEvent event, uint64_t seq, AgreementMode mode,
              Reason reason, uint32_t moved) const;

  const ncclComm_t comm_;
  const capture::CommInfo info_;
  const AgreementWorld world_;
  const Options& options_;
  const ce::Backend backend_;
  bool agreeable_ = true;

  RoundSchedule schedule_;
  GroupFlush flush_;
  StepObservation seen_;
  uint64_t step_digest_ = 0;  // of the step being observed
  // This rank's own facts (shape position, call site, send buffer) per collective, fed while the
  // shape step is found: a longer period there is what a refinement proposes.
  std::unique_ptr<capture::StepDetector> own_steps_;
  uint32_t shape_period_ = 0;
  uint64_t shape_origin_ = 0;    // collective index of a position 0 of the shape step
  uint32_t refined_period_ = 0;  // agreed; 0: rounds follow the shape step
  uint32_t refined_phase_ = 0;   // collective index of refined position 0, mod refined_period_
  std::unique_ptr<Round> pending_;
  std::vector<std::unique_ptr<ce::Exchange>> retired_;  // rounds whose result nobody needs
  std::unique_ptr<ce::Exchange> spare_;                 // a read round's buffers, for the next

  // The decision of the last propose, and what serving it needs.
  Decision decision_;
  uint32_t decision_round_ = 0;
  SlotLayout layout_;
  BoundSources sources_;             // static weights: the bindings' send buffers
  uint64_t other_source_calls_ = 0;  // moved calls that read another position's binding
  // What the program got, said once at the communicator's end: its all-gathers, and those the
  // transport served or that fell back to NCCL.
  struct Coverage {
    uint64_t gathers = 0, bytes = 0;
    uint64_t moved = 0, moved_bytes = 0;
    uint64_t fell_back = 0;
    uint64_t first_moved = UINT64_MAX;  // collective index (the call that served it)
  } coverage_;
  uint64_t last_seq_ = 0;  // the latest call's collective index
  Serving serving_;
  CostTrial trial_;
  uint64_t nccl_faster_hash_ = 0;  // a plan whose cost round kept no bucket: not tried again

  // The active plan: routes follow it while the step digest is this one.
  bool active_ = false;
  bool active_dry_ = false;
  uint64_t active_digest_ = 0;
  uint64_t active_hash_ = 0;
};

// The agreement of a communicator that joined, in the process's world (production_world).
std::shared_ptr<CommAgreement> make_comm_agreement(ncclComm_t comm, const capture::CommInfo& info,
                                                   const RealNcclCalls& nccl);

}  // namespace magi::rewrite
