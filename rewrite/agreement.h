// Agreement for one communicator: the rounds, the plan, and the route of each collective.
//
// When rounds happen. Issued only at the anchor, one position of the communicator's step (as
// capture's step detector reports it: the position of the call where the step was found if the
// warmup is complete there, else position 0, where the step that completes it begins), counted
// in steps since the step was found; each read at a fixed number of calls after its issue.
// The detector sees only shapes (op, type, count, root, reduction), which every rank of a correct
// NCCL program issues alike, so every rank finds, loses and positions the step at the same call,
// and so issues each round at the same place in the communicator's call sequence: our all-gather
// never meets a different call of another rank.
//
//   W = MAGI_WARMUP_STEPS complete steps observed:  issue propose at the anchor
//   a quarter step on:  read propose -> decision (the ladder, rewrite/contribution.h); issue
//                       publish with this rank's window handle if something moves
//   a quarter step on:  read publish -> open peers' windows; issue confirm (opened, or not)
//   a quarter step on:  read confirm -> every rank opened every window: routes change here
//                       (a timed plan's: once each bucket went to NCCL since the propose read,
//                       its cost trial's NCCL side, rewrite/cost_trial.h; a step at most)
// (ExplorationPolicy::read_distance: a quarter of the step's calls, at least one), so a plan is
// agreed inside the step that completes the warmup: with the default W = 3 its gathers move
// from the 5th step at the latest (the 4th untimed), W = 1 from the 3rd (timed or not: with
// W = 1 a timed confirm does not wait for the trial's NCCL side, rewrite/cost_trial.h),
// where the detector found the step by its 3rd.
// A cost round is read a step after its issue, at the next anchor, and so is every round of a
// step whose in-step publish or confirm failed (one issued inside a group holding Send/Recv, where
// only the anchor moves on). The next propose's wait counts from the step after the last round's
// issue, as when each round was read a step later: no step holds more rounds than it did then.
// Either half of the set-up (making and exporting this rank's window; opening the peers') runs
// off the program's calls where it would take long (rewrite/set_up.h): its round then says
// "still setting up" (kSettingUp), every rank reads that alike, and the same round is issued
// again 1, 2, 4, ... 64 steps later until every rank is ready (rewrite/commit.h).
// Where a communicator is in all this is one value, its phase (rewrite/phase.h).
// A round is read at the call `read_distance` collectives after its issue, the same call on
// every rank (positions are shapes), so the host waits there only for an all-gather every rank
// has issued before that call; it waits only if the round is still in flight (on a GPU, the
// rounds queue behind the communicator's work issued before them). The observation is seeded,
// when the step is found, with the step's calls the detector already saw repeat (RecentCalls),
// so the W steps may be complete at once.
// When the next propose comes, what is remembered between rounds and when exploring stops is the
// exploration policy's (rewrite/exploration.h), fed only what every rank read alike: the
// decision says whether a round moved less than it could (Decision::retry_soon). A communicator
// of one rank never explores (MAGI_CE_FORCE=1 aside): no hello, no round.
//
// Before all of that, one hello round (rewrite/hello.h; rewrite/hello_gate.h holds it) at the
// communicator's first collective not captured into a graph, on every rank agreeable by program
// facts, MAGI_TRANSPORT=nccl included: it carries the settings that decide WHEN a rank issues
// rounds (MAGI_WARMUP_STEPS, MAGI_REAGREE_STEPS, MAGI_MAX_STEP_CALLS, MAGI_CE_FORCE,
// MAGI_TRANSPORT, MAGI_BACKEND and whether it runs here). A rank reads it where its first other
// round comes due, before issuing that round. The schedule above holds only where these are alike,
// and this is why it suffices: a rank issues a round only after reading every rank's settings; if
// they differ (or some rank cannot take part), nobody issues anything more on that communicator, so
// no round meets a program call. The hello itself is issued by every rank at the same call, the
// first one not captured (capture is alike on every rank, as assumed below), so it meets only
// itself. A rank that never issues rounds never waits for it.
//
// Why a round never hangs. A round's all-gather is issued before the anchor call, on every rank
// (RoundChannel::issue), and launched at once: outside a group, or alone out of the program's open
// group (GroupFlush launches the group so far, issues the round, and reopens the group; the ranks
// group alike, so the round runs between the same collectives everywhere). Only a group holding
// Send/Recv cannot be launched in two parts: the round then waits in it until the group ends, so
// this rank votes "no" (kIssuedInGroup) and, knowing the answer without reading, never waits on it;
// the others read its vote and reach the same answer (decide() puts that vote before everything
// else). So a rank only ever waits for an all-gather every rank has launched. After such a void
// round every rank moves the anchor one position on, and the next propose comes one step later,
// until a position where a round can launch is found.
//
// Why routes never split. The route of a call is a function of the agreed plan (equal on every
// rank, read from the same bytes) and the call's step position and step digest (shapes alone):
// route_by_plan (rewrite/route.h).
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
// Assumed, not checkable: a call captured into a CUDA graph on one rank is captured on all, as
// NCCL requires of its own captured collectives. A captured gather that no plan covers is agreed
// at that call (rewrite/capture_rounds.cc), through rounds of shared memory that end alike on
// every rank that takes part; a rank that does not capture it never meets them with a call of
// its own, and the others give up at MAGI_CAPTURE_WAIT_MS, keeping NCCL.
#pragma once

#include <nccl.h>

#include <memory>
#include <span>

#include "capture/capture.h"
#include "ce_transport/ce_transport.h"
#include "rewrite/active_plan.h"
#include "rewrite/agreement_log.h"
#include "rewrite/commit.h"
#include "rewrite/contribution.h"
#include "rewrite/cost_trial.h"
#include "rewrite/coverage.h"
#include "rewrite/exploration.h"
#include "rewrite/hello_gate.h"
#include "rewrite/observation.h"
#include "rewrite/phase.h"
#include "rewrite/recent_calls.h"
#include "rewrite/refined_step.h"
#include "rewrite/rewrite.h"
#include "rewrite/round_channel.h"
#include "rewrite/round_log.h"
#include "rewrite/route.h"
#include "rewrite/serving.h"
#include "rewrite/world.h"

namespace magi::rewrite {

// The step rounds and routes follow: what this rank saw of it, the calls before it was found
// (what seeds the observation when it is), its digest, and the step positions are counted in (the
// shape step's or an agreed refined one's, with this rank's own facts watched for a refinement).
struct WatchedStep {
  StepObservation seen;
  RecentCalls recent;
  uint64_t digest = 0;  // of the step being observed
  RefinedStep refined;
};

// Coordinates the parts for one communicator, in one phase at a time (rewrite/phase.h): the
// hello gate, the exploration policy, the step rounds follow, the rounds (RoundChannel), the
// commit of a plan read and its set-up (Commit), the plan and its routes (ActivePlan,
// route_by_plan), its Serving and CostTrial, what it says (AgreementLog) and what the program got
// (Coverage).
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
  ncclComm_t comm() const { return channel_.comm(); }
  const AgreementWorld& world() const { return world_; }
  const capture::CommInfo& info() const { return info_; }
  Phase phase() const { return phase_; }

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
  bool watching() const { return phase_ != Phase::Off && !policy_.stopped(); }

 private:
  void set_phase(Phase to, uint64_t seq);
  void restart(const capture::StepView& view);
  // `then_propose`: issue the next propose here if due (never at a capture: capture_rounds.cc
  // proposes again through the board).
  void refine(const Decision& decision, uint64_t seq, bool then_propose = true);
  void on_lost(uint64_t seq);
  void abandon_pending(uint64_t seq);
  // Whether the anchor has anything to do now (a round to read or issue, buffers or timings to
  // collect): only then is the call's capture state asked.
  bool anchor_has_work() const;
  bool propose_due() const;
  bool round_due(uint64_t seq) const;
  void at_anchor(const capture::StepView& view);
  // `bytes_each`: the contribution size, equal on every rank (a publish's: ActivePlan).
  void issue(RoundKind kind, Contribution& contribution, uint64_t seq,
             size_t bytes_each = kContributionBytes);
  void read_round(uint64_t seq);
  void read_voted_no(Round& round, uint64_t seq);
  void propose(uint64_t seq);
  void take_decision(const Decision& decision, uint32_t round, uint64_t seq);
  void after_propose(const Decision& decision, uint64_t seq);
  void schedule_after(bool short_of_what_could_move);
  void publish(uint64_t seq);
  // A publish (again, after a pending read) or a confirm of `decision_hash`.
  void commit_round(RoundKind kind, uint64_t decision_hash, uint64_t seq);
  void read_commit(std::span<const uint8_t> all, const Round& round, uint64_t seq);
  // The plan being committed is dropped (not every rank could serve or confirm it, or its
  // round sat in a group): everything stays on NCCL, and the next propose comes soon.
  void end_commit(uint64_t seq);
  void activate(uint64_t seq, bool dry);
  void issue_cost(uint64_t seq);
  void after_cost(std::span<const uint8_t> all, uint64_t seq);
  void deactivate(uint64_t seq, Reason why);
  // Rounds at a CUDA graph capture (rewrite/capture_rounds.cc).
  // The step the call is placed in: capture's, or a step of one call taken at a capture where
  // capture found none yet (capture_rounds.cc says when and why). `captured_gather`: the call
  // is an all-gather on a capturing stream.
  capture::StepView step_view(const capture::StepView& detected, const capture::CallRecord& record,
                              bool captured_gather);
  bool one_call_step_may_start() const;
  bool capture_round_due() const;
  void agree_at_capture(uint64_t seq);
  bool commit_at_capture(RoundKind kind, Contribution& c, uint64_t seq, CommitOutcome& outcome);
  void end_capture_round(uint64_t seq, const char* why);
  const char* choose_untimed(Decision& d) const;
  // This rank's propose (`at_capture`: made at a graph capture, StepObservation::entries).
  Contribution propose_contribution(bool at_capture);
  RoundStamp stamp(trace::RoundEvent event) const;
  void trace_round(RoundKind kind, trace::RoundEvent event, uint64_t seq, AgreementMode mode,
                   Reason reason, uint32_t moved) const;

  const capture::CommInfo info_;
  const AgreementWorld world_;
  AgreementLog log_;
  ExplorationPolicy policy_;
  Phase phase_ = Phase::Watching;
  WatchedStep step_;
  RoundChannel channel_;
  HelloGate hello_;
  Serving serving_;
  CostTrial trial_;
  ActivePlan plan_;
  Commit commit_;
  Coverage coverage_;
  struct CaptureRounds {
    uint64_t attempted_at_step = UINT64_MAX;  // at most one attempt a step (policy_.steps())
    // The step whose last round at a capture moved nothing: none again for it until the step
    // restarts or an eager propose is read (what decided may have changed).
    uint64_t nothing_moved_digest = 0;
  } capture_;
  // A step of one call taken at a capture (capture_rounds.cc): the call's shape while it holds
  // (its digest is step_.digest then), the collective it began at, and how many were taken (at
  // most kMost a communicator: each costs a round and a window).
  struct OneCallStep {
    static constexpr uint32_t kMost = 64;
    bool holds = false;
    uint64_t key = 0;
    uint64_t origin = 0;
    uint32_t taken = 0;
    void stop() { taken = kMost; }  // none again on this communicator
  } one_call_;
};

// The agreement of a communicator that joined, in the process's world (production_world).
std::shared_ptr<CommAgreement> make_comm_agreement(ncclComm_t comm, const capture::CommInfo& info,
                                                   const RealNcclCalls& nccl);

}  // namespace magi::rewrite
