// Agreement for one communicator: the rounds, the plan, and the route of each collective.
//
// When rounds happen. Only at the anchor, one position of the communicator's step (as capture's
// step detector reports it; the position of the call where the step was found), counted in steps
// since the step was found.
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
// Either half of the set-up (making and exporting this rank's window; opening the peers') runs
// off the program's calls where it would take long (rewrite/set_up.h): its round then says
// "still setting up" (kSettingUp), every rank reads that alike, and the same round is issued
// again 1, 2, 4, ... 64 steps later until every rank is ready.
// A round is read one step after it was issued: the host waits there only if the round is
// somehow still in flight. The observation is seeded, when the step is found, with the step's
// calls the detector already saw repeat (RecentCalls), so the W steps may be complete at once.
// When the next propose comes, what is remembered between rounds and when exploring stops is the
// exploration policy's (rewrite/exploration.h), fed only what every rank read alike: the
// decision says whether a round moved less than it could (Decision::retry_soon). A communicator
// of one rank never explores (MAGI_CE_FORCE=1 aside): no hello, no round.
//
// Before all of that, one hello round (rewrite/hello.h) at the communicator's first collective
// not captured into a graph, on every rank agreeable by program facts, MAGI_TRANSPORT=nccl
// included: it carries the settings that decide WHEN a rank issues rounds (MAGI_WARMUP_STEPS,
// MAGI_REAGREE_STEPS, MAGI_MAX_STEP_CALLS, MAGI_CE_FORCE, MAGI_TRANSPORT, MAGI_BACKEND and
// whether it runs here). A rank reads it where its first other round comes due, before issuing
// that round. The schedule above holds only where these are alike, and this is why it suffices:
// a rank issues a round only after reading every rank's settings; if they differ (or some rank
// cannot take part), nobody issues anything more on that communicator, so no round meets a
// program call. The hello itself is issued by every rank at the same call, the first one not
// captured (capture is alike on every rank, as assumed below), so it meets only itself. A rank
// that never issues rounds never waits for it.
//
// Why a round never hangs. A round's all-gather is issued before the anchor call, on every rank,
// and launched at once: outside a group, or alone out of the program's open group (GroupFlush
// launches the group so far, issues the round, and reopens the group; the ranks group alike, so
// the round runs between the same collectives everywhere). Only a group holding Send/Recv cannot
// be launched in two parts: the round then waits in it until the group ends, so this rank votes
// "no" (kIssuedInGroup) and, knowing the answer without reading, never waits on it; the others
// read its vote and reach the same answer (decide() puts that vote before everything else). So a
// rank only ever waits for an all-gather every rank has launched. After such a void round every
// rank moves the anchor one position on, and the next propose comes one step later, until a
// position where a round can launch is found.
//
// Why routes never split. The route of a call is a function of the agreed plan (equal on every
// rank, read from the same bytes) and the call's step position and step digest (shapes alone).
//  - A call that deviates in a shared fact (count, type, order) changes the shape sequence: the
//    detector loses the step at that very call on every rank, the plan is dropped there, and that
//    call and all after it go to NCCL until a new agreement.
//  - A rank-local change (another call site; with static weights a new send buffer) changes no
//    route. It cannot break bytes either: the default transport copies the send buffer on every
//    call, so it reads whatever buffer the call names (which is why the default mode's key holds
//    no buffer at all). The change shows in the next propose round, where it makes the gather
//    "not stable" on that rank, which the AND spreads to every rank.
//  - A transport failure on one rank returns an error for that call and makes that rank refuse
//    every gather in the next propose, so routes go back to NCCL everywhere at one call.
//
// Refined steps (rewrite/refined_step.h, which says why routes still never split). A step of
// identical shapes may hide a longer step of this rank's own facts (a call site or send buffer
// per layer): a propose carries it, and where every rank proposed the same, every rank restarts
// its rounds on the refined step at that read.
// Assumed, and checked at each propose: the ranks group their calls (ncclGroupStart/End) the
// same way; a difference aborts the agreement (buckets and window slots follow the groups).
// Assumed, not checkable: a call captured into a CUDA graph on one rank is captured on all (it
// stays on NCCL, since a replay would repeat the handshake's sequence numbers).
#pragma once

#include <nccl.h>

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "capture/capture.h"
#include "ce_transport/ce_transport.h"
#include "rewrite/contribution.h"
#include "rewrite/cost_trial.h"
#include "rewrite/coverage.h"
#include "rewrite/exploration.h"
#include "rewrite/group_flush.h"
#include "rewrite/hello.h"
#include "rewrite/observation.h"
#include "rewrite/recent_calls.h"
#include "rewrite/refined_step.h"
#include "rewrite/rewrite.h"
#include "rewrite/round_buffers.h"
#include "rewrite/round_log.h"
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
  // The activation that routed it (CommAgreement::serve serves it by that plan's window only).
  uint32_t plan = 0;
  // The call's stream is capturing a CUDA graph (a Move of a static plan only): its copies are
  // recorded for every replay (ce::Transport::Timing::Captured).
  bool captured = false;
};

// Coordinates the parts for one communicator: the exploration policy, the step rounds follow
// (RefinedStep), the rounds themselves (issued through a GroupFlush with RoundBuffers' buffers,
// recorded through round_log), the active plan, its Serving and CostTrial, and what the program
// got (Coverage).
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
  // `plan`: Route::plan of its gathers. A bucket queued in a group under a plan that ended
  // before the group did (a round read at an anchor inside the group dropped or replaced it) goes
  // to NCCL: every rank read the same round at the same call, so every rank does the same.
  // `first_collective`: the collective index of the bucket's first call (a group's bucket is
  // served at its ncclGroupEnd, after its last call). `moved` (if given): whether the transport
  // served it, rather than NCCL.
  ncclResult_t serve(std::span<const ce::GatherOp> bucket, std::span<const NcclGather> calls,
                     cudaStream_t stream, uint16_t bucket_id, bool via_nccl, uint32_t plan,
                     uint64_t first_collective, bool* moved = nullptr);

  uint64_t identity() const { return info_.identity; }
  ncclComm_t comm() const { return comm_; }
  const AgreementWorld& world() const { return world_; }
  const capture::CommInfo& info() const { return info_; }

  // The communicator is being aborted, maybe from another thread while a call of this one is
  // blocked: the transport stops waiting on peers now, and no window is made after this.
  void abandon() { serving_.abandon(); }
  // Ours, for ncclCommGetAsyncError (Serving::async_error). Any thread.
  ncclResult_t async_error() { return serving_.async_error(); }
  // A moved gather failed outside the transport (`why`, said once): the communicator refuses
  // every gather at its next propose, as after a transport error.
  void fail_transport(const char* why) noexcept { serving_.fail(why); }
  // Whether this communicator may still explore (issue rounds, watch its gathers' call sites):
  // false for good once it cannot take part or its ranks can never gain (ExplorationPolicy).
  bool watching() const { return agreeable_ && !policy_.stopped(); }

 private:
  struct Round {
    RoundKind kind;
    uint32_t number;
    std::unique_ptr<ce::Exchange> exchange;
    size_t bytes = kContributionBytes;  // per contribution (a static plan's publish: more)
    bool voted_no = false;              // issued inside an open group: this rank said no
    uint64_t decision_hash = 0;         // publish/confirm
  };

  void restart(const capture::StepView& view);
  void refine(const Decision& decision, uint64_t seq);
  void on_lost(uint64_t seq);
  void abandon_pending(uint64_t seq);
  // Whether the anchor has anything to do now (a round to read or issue, buffers or timings to
  // collect): only then is the call's capture state asked.
  bool anchor_has_work() const;
  bool propose_due() const;
  // Before the plan being committed is active, its gathers go to NCCL anyway: timed there, they
  // are the cost trial's NCCL side, so no call has to run the slower way on purpose.
  Route route_while_committing(uint32_t position, bool gather) const;
  Route route_at(uint32_t position, bool gather, bool capturing, uint64_t digest);
  void say_captured(bool moves);
  // What remembered verdicts say of a propose every rank read alike (ExplorationPolicy).
  Decision judged(Decision decision) const;
  uint64_t bucket_bytes_of(const Decision& decision, uint16_t bucket) const;
  size_t plan_buckets() const;
  void at_anchor(const capture::StepView& view);
  void read_round(uint64_t seq);
  void read_voted_no(Round& round, uint64_t seq);
  void read_publish(std::span<const uint8_t> all, const Round& round, uint64_t seq);
  void read_confirm(std::span<const uint8_t> all, const Round& round, uint64_t seq);
  // Issues a confirm of `decision_hash`: whether this rank's set-up is done, running or failed.
  void confirm(uint64_t decision_hash, uint64_t seq);
  // `bytes_each`: the contribution size, equal on every rank (publish_round_bytes for a publish).
  void issue(RoundKind kind, Contribution& contribution, uint64_t seq,
             size_t bytes_each = kContributionBytes);
  Contribution header_for(RoundKind kind) const;
  void propose(uint64_t seq);
  void take_decision(const Decision& decision, uint32_t round, uint64_t seq);
  void after_propose(const Decision& decision, uint64_t seq);
  void schedule_after(bool short_of_what_could_move);
  void stay_quiet(Reason why, uint64_t seq);
  void publish(uint64_t seq);
  // Issues the publish again after a pending read: this rank's window, if it is ready now.
  void publish_again(uint64_t decision_hash, uint64_t seq);
  // The prepared window's handle and table into the publish, and its INFO lines.
  void fill_publish(Contribution& c);
  // A publish or confirm read pending: issued again at the same later step on every rank.
  void wait_for_set_up(RoundKind kind, uint64_t decision_hash, uint64_t seq);
  size_t bound_shards() const;
  size_t publish_bytes() const;
  void activate(uint64_t seq);
  void issue_cost(uint64_t seq);
  void after_cost(std::span<const uint8_t> all, uint64_t seq);
  void deactivate(uint64_t seq, Reason why);
  void issue_hello(uint64_t seq);
  bool read_hello_round(uint64_t seq);
  void take_hello(const HelloOutcome& hello, uint64_t seq);
  void look_at_hello(uint64_t seq);
  void record(RoundKind kind, trace::RoundEvent event, uint64_t seq, AgreementMode mode,
              Reason reason, uint32_t moved) const;

  const ncclComm_t comm_;
  const capture::CommInfo info_;
  const AgreementWorld world_;
  const Options& options_;
  const ce::Backend backend_;
  const ScheduleSettings settings_;
  bool agreeable_ = true;  // this rank issues rounds (until the hello says otherwise)
  // Why this communicator never explores, said in the trace at its first collective (None: it
  // may, or it was said).
  Reason quiet_ = Reason::None;
  // The hello: owed at the first collective not captured (agreeable by program facts, even
  // when this rank takes no part), then in flight until read.
  bool hello_due_ = false;
  std::unique_ptr<Round> hello_;

  ExplorationPolicy policy_;
  GroupFlush flush_;
  StepObservation seen_;
  RecentCalls recent_;        // what seeds seen_ when the step is found
  uint64_t step_digest_ = 0;  // of the step being observed
  // The step rounds and routes follow (the shape step's or an agreed refined one's), and this
  // rank's own facts, watched for a refinement to propose.
  RefinedStep refined_;
  std::unique_ptr<Round> pending_;
  RoundBuffers buffers_;  // the rounds' buffers, reused
  // The plan's set-up (Serving::begin_attach or attach_now): whether its end is yet to be said
  // (INFO, the trace's window record), and why it failed ("" while it has not).
  bool set_up_unsaid_ = false;
  std::string set_up_failed_;
  bool set_up_in_background_ = false;
  // The owner's side of the set-up (exports, window) runs off the calls (Serving::begin_prepare):
  // whether its end is yet to be said.
  bool prepare_in_background_ = false;
  bool prepare_unsaid_ = false;
  // A publish or confirm read pending (some rank still setting up) is issued again at due_step.
  struct SetUpWait {
    RoundKind kind = RoundKind::Confirm;
    bool waiting = false;
    uint64_t decision_hash = 0;
    uint64_t due_step = 0;
    uint32_t reads = 0;  // pending reads of this round kind of the plan so far
  };
  SetUpWait wait_;
  static constexpr int kSlowSetUpMs = 100;  // MAGI_INJECT_FAULT=slow-attach, slow-prepare

  // The decision of the last propose, and what serving it needs.
  Decision decision_;
  uint32_t decision_round_ = 0;
  SlotLayout layout_;
  BoundSources sources_;             // static weights: the bindings' send buffers
  uint64_t other_source_calls_ = 0;  // moved calls that read another position's binding
  Coverage coverage_;                // what the program got, said at the communicator's end
  uint64_t last_seq_ = 0;            // the latest call's collective index
  Serving serving_;
  CostTrial trial_;
  // A plan read and being committed (publish, confirm) whose trial times its NCCL side now.
  bool committing_ = false;

  // The active plan: routes follow it while the step digest is this one.
  bool active_ = false;
  bool active_dry_ = false;
  bool active_bound_ = false;        // static weights: its captured gathers move too
  bool active_graph_slots_ = false;  // default mode with graph slots: likewise
  bool saw_capture_ = false;         // a gather of this communicator was captured into a graph
  bool captured_moves_said_ = false;
  bool captured_stays_said_ = false;
  bool early_capture_said_ = false;  // a gather captured before any plan was active
  uint32_t active_plan_ = 0;         // counts activations: Route::plan
  uint64_t active_digest_ = 0;
  uint64_t active_hash_ = 0;
};

// The agreement of a communicator that joined, in the process's world (production_world).
std::shared_ptr<CommAgreement> make_comm_agreement(ncclComm_t comm, const capture::CommInfo& info,
                                                   const RealNcclCalls& nccl);

}  // namespace magi::rewrite
