// Rounds at a CUDA graph capture: a gather captured while no plan covers it is agreed at that
// very call, so that the graph records the copy-engine path on every rank, or NCCL on every rank.
//
// Why it is safe to agree there. NCCL requires every rank to capture the same collectives in the
// same order, and the step and its positions are functions of shapes, so every rank reaches the
// same captured call in the same phase and decides here to agree. The rounds do not go through
// NCCL: a rank that is not capturing would meet them with its own call. They go through the board
// (ce::RoundBoard), shared memory among the ranks, all on this host (the hello says so), whose
// every round ends the same way on every rank that took part: agreed, or abandoned (a rank did
// not come within MAGI_CAPTURE_WAIT_MS, or is gone). An abandoned round leaves that communicator's
// captured gathers on NCCL from then on, on every rank, since every rank reads it abandoned,
// a late one at once.
//
// Who comes to the board is decided by shared facts (the phase, the step, the capture) and two
// settings, MAGI_GRAPH_SLOTS and MAGI_STATIC_WEIGHTS, which the hello carries: every rank reads
// there whether they are alike before it goes to the board, so a rank set differently never
// leaves its peers waiting MAGI_CAPTURE_WAIT_MS for it (no rank takes a round at a capture then).
//
// What is agreed is an ordinary plan (propose, publish, confirm; rewrite/agreement.h), issued and
// read within the one call, at most once per step, and it stays in force after the capture like
// any plan. Where a rank's set-up runs off the calls (rewrite/set_up.h), its publish or confirm
// says "still setting up" and the round is exchanged again a moment later, at this call; a rank
// whose set-up outlasts MAGI_CAPTURE_WAIT_MS refuses, and every rank reads the refusal. Nothing
// here enters the graph: the board is host memory, and the transport's own CUDA calls run outside
// the capture (ce::OutsideCapture).
//
// Before any step is found. A program may capture its gathers before capture's detector found a
// step: one warm-up and then the capture (nccl-tests' one eager call per size; Inductor's graphs
// recorded at the second call), or a step shorter than 8 calls, found 8 calls into its second run
// (capture/skeleton.h). A captured all-gather that finds no step found is then taken as a step of
// its own, one call long, named as the detector would name it (its shape's digest), at once on
// every rank (shapes and capture are alike): the round at the capture agrees a plan on it, and it
// holds for every call of that shape that follows, captured or not, until a call of another shape
// (lost there, as any step) or until the detector finds a step: the same step goes on as it, any
// other replaces it (restart). It is staged on graph slots in either mode: its one position may
// name another send buffer at every call (nccl-tests moves them), so with static weights its
// entries are transient and the plan stages, binding nothing (decide()). At most OneCallStep::kMost
// a communicator, and never again for a shape whose round moved nothing, so a program of many
// shapes pays a bounded number of rounds.
//
// No timing, still a choice: a captured call cannot be timed both ways before it is recorded. A
// bucket whose size the communicator's eager cost rounds already judged keeps that verdict; any
// other moves only from kCaptureRuleBytes on (BENCHMARKS.md, "Gathers agreed at capture");
// MAGI_CE_FORCE=1 moves regardless. The log says which decided.
#include <algorithm>
#include <chrono>
#include <thread>

#include "base/clock.h"
#include "rewrite/agreement.h"

namespace magi::rewrite {
namespace {

// A bucket agreed at a capture with no verdict of its size moves from this many bytes a rank:
// below it a gather's fixed cost (the handshake, a copy per peer) weighs more than NCCL's ring.
constexpr uint64_t kCaptureRuleBytes = uint64_t{1} << 20;

// Between two exchanges of a publish or confirm some rank said "still setting up".
std::chrono::milliseconds pause_before(int attempt) {
  return std::chrono::milliseconds(1 << std::min(attempt, 4));
}

// Buckets a decision names (its largest bucket index + 1).
size_t plan_buckets_of(const Decision& d) {
  size_t n = 0;
  for (const GatherDecision& g : d.gathers) n = std::max<size_t>(n, g.bucket + 1u);
  return n;
}

// Why a propose moves nothing: the whole communicator's reason, else the first gather's.
const char* why_nothing_moves(const Decision& d) {
  Reason why = d.reason;
  for (const GatherDecision& g : d.gathers)
    if (why == Reason::None) why = g.reason;
  return trace::reason_name(why).data();
}

}  // namespace

capture::StepView CommAgreement::step_view(const capture::StepView& detected,
                                           const capture::CallRecord& record,
                                           bool captured_gather) {
  // The detector's own step from here: where it is the step of one call being followed (the same
  // digest), on_collective goes on with it, plan and all.
  if (detected.found) {
    one_call_.holds = false;
    return detected;
  }
  const uint64_t seq = detected.collective_index;
  if (one_call_.holds && record.shape != one_call_.key) {  // another shape: lost, as a step is
    one_call_.holds = false;
    on_lost(seq);
  }
  capture::StepView view = detected;
  if (!one_call_.holds) {
    if (!captured_gather || !one_call_step_may_start()) return detected;
    one_call_.holds = true;
    one_call_.key = record.shape;
    one_call_.origin = seq;
    ++one_call_.taken;
    view.event = capture::StepDetector::Event::Found;
    view.digest = capture::StepDetector::digest_of(std::span<const uint64_t>(&record.shape, 1));
  } else {
    view.digest = step_.digest;  // set from the view that started it (restart)
  }
  view.found = true;
  view.period = 1;
  view.position = 0;
  view.origin = one_call_.origin;
  view.repeats = seq - one_call_.origin;
  return view;
}

// Shared facts only (the settings are read in agree_at_capture, once the hello said they are
// alike), so every rank takes the step at the same call.
bool CommAgreement::one_call_step_may_start() const {
  if (phase_ == Phase::Off || policy_.stopped() || one_call_.taken >= OneCallStep::kMost)
    return false;
  if (world_.options.capture_wait_ms == 0 || !world_.make.board || !channel_.board_gone().empty())
    return false;
  const GroupView group = world_.group();
  return group.depth == 0 || (group.calls <= 1 && !group.holds_point_to_point);
}

bool CommAgreement::capture_round_due() const {
  if (phase_ == Phase::Off || policy_.stopped() || capture_.attempted_at_step == policy_.steps())
    return false;
  if (step_.digest == capture_.nothing_moved_digest) return false;
  if (world_.options.capture_wait_ms == 0 || !world_.make.board || !channel_.board_gone().empty())
    return false;
  if (!step_.seen.has_gathers() || step_.seen.complete_steps() < 1) return false;
  // A plan in force routes the call, unless a default-mode capture finds it without graph slots:
  // that plan ends here, and one with them is agreed (unless MAGI_GRAPH_SLOTS=never: the
  // settings are looked at in agree_at_capture, once the hello said they are alike).
  if (plan_in_force(phase_) && (plan_.bound() || plan_.dry() || plan_.graph_slots())) return false;
  // A plan starts at a bucket's first call: in a group, only at its first.
  const GroupView group = world_.group();
  return group.depth == 0 || (group.calls <= 1 && !group.holds_point_to_point);
}

void CommAgreement::agree_at_capture(uint64_t seq) {
  capture_.attempted_at_step = policy_.steps();
  const uint64_t began = clock_ns();
  const ce::OutsideCapture outside(channel_.backend());
  // The hello first, as before any round: issued at an eager call, read here if not yet.
  if (hello_.in_flight() && !hello_.read(channel_, stamp(trace::RoundEvent::Read), seq)) {
    set_phase(Phase::Off, seq);
    return;
  }
  if (!hello_.one_host()) {
    if (hello_.agreed()) one_call_.stop();  // where its ranks run never changes
    log_.no_capture_round(seq, hello_.agreed()
                                   ? "its ranks are not all on this host"
                                   : "the communicator made no eager collective before it");
    return;
  }
  // Whether this round may come depends on two settings besides shared facts; every rank reads
  // here whether they are alike, so every rank comes to the board, or none.
  if (!hello_.capture_alike()) {
    one_call_.stop();  // alike on every rank
    return log_.no_capture_round(seq, hello_.capture_why().c_str());
  }
  if (world_.options.graph_slots == Options::GraphSlots::Never &&
      (plan_in_force(phase_) || !world_.options.static_weights)) {
    one_call_.stop();  // alike on every rank
    return log_.no_capture_round(seq, plan_in_force(phase_)
                                          ? "MAGI_GRAPH_SLOTS=never: the plan in force has no "
                                            "graph slots, and keeps its captured gathers on NCCL"
                                          : "MAGI_GRAPH_SLOTS=never, without static weights: a "
                                            "captured gather has nothing to move on");
  }
  if (round_in_flight(phase_) || committing(phase_)) abandon_pending(seq);
  if (plan_in_force(phase_)) deactivate(seq, Reason::GraphCapture);
  set_phase(Phase::AgreeingAtCapture, seq);
  channel_.saw_capture();

  // Propose; where every rank proposes the same longer step (layers of one shape told apart by
  // their call sites or buffers), the step is refined here, as at an eager read, and proposed
  // again at once on it.
  Decision d;
  for (int proposes = 1;; ++proposes) {
    policy_.next_round();
    Contribution c = propose_contribution(true);
    std::vector<uint8_t> all;
    if (!channel_.exchange_at_capture(RoundKind::Propose, c, seq, stamp(trace::RoundEvent::Issued),
                                      kContributionBytes, all))
      return end_capture_round(seq, nullptr);
    d = judged(decide(all, info_.nranks, info_.rank), policy_, step_.seen, world_.options.ce_force,
               step_.digest);
    plan_.round = c.header.round;
    if (d.refine_period == 0 || proposes == 2) break;
    plan_.decision = d;
    trace_round(RoundKind::Propose, trace::RoundEvent::Read, seq, d.mode, d.reason, d.moved);
    record_decision(world_.trace, info_, step_.seen, d, plan_.round);
    refine(d, seq, false);
    set_phase(Phase::AgreeingAtCapture, seq);
    if (step_.seen.complete_steps() < 1)
      return end_capture_round(seq,
                               "the step was refined here, and no whole refined step was seen");
  }
  const bool could_move = d.moves_anything();
  const char* decided_by = choose_untimed(d);
  plan_.decision = d;
  trace_round(RoundKind::Propose, trace::RoundEvent::Read, seq, d.mode, d.reason, d.moved);
  record_decision(world_.trace, info_, step_.seen, d, plan_.round);
  if (d.refine_period != 0 || d.dry_run || !d.moves_anything()) {
    // The same decision would come at every step of this one: none is taken again for it.
    if (d.refine_period == 0) capture_.nothing_moved_digest = step_.digest;
    return end_capture_round(
        seq, d.refine_period != 0 ? "the step was refined twice in a row"
             : d.dry_run          ? "MAGI_DRY_RUN=1"
             : could_move ? "every bucket is below the size rule (1 MiB a rank) or of a size NCCL "
                            "won in eager cost rounds; untimed at a capture"
                          : why_nothing_moves(d));
  }
  plan_.layout = lay_out_slots(step_.seen, d.gathers, d.bound);
  trial_.begin(false, plan_.buckets());

  // Publish: this rank's window and sources.
  Contribution p = channel_.header(RoundKind::Publish, stamp(trace::RoundEvent::Issued));
  p.header.decision_hash = d.hash;
  commit_.prepare(p, plan_, step_.seen);
  CommitOutcome published;
  if (!commit_at_capture(RoundKind::Publish, p, seq, published))
    return end_capture_round(seq, "not every rank could serve the plan");
  commit_.attach(published);

  // Confirm: the peers' windows opened.
  CommitOutcome confirmed;
  Contribution f = channel_.header(RoundKind::Confirm, stamp(trace::RoundEvent::Issued));
  f.header.decision_hash = d.hash;
  commit_.confirm(f, plan_, seq);
  if (!commit_at_capture(RoundKind::Confirm, f, seq, confirmed))
    return end_capture_round(seq, "not every rank opened its peers' windows");
  activate(seq, false);
  log_.agreed_at_capture(plan_.round, seq, plan_.decision.moved, plan_.decision.gathers.size(),
                         decided_by, static_cast<double>(clock_ns() - began) / 1e6);
}

// A publish or confirm at the capture, exchanged again while some rank is still setting up (each
// rank's own deadline turns its "setting up" into a refusal, which every rank reads).
bool CommAgreement::commit_at_capture(RoundKind kind, Contribution& c, uint64_t seq,
                                      CommitOutcome& outcome) {
  const size_t bytes = kind == RoundKind::Publish ? plan_.publish_bytes() : kContributionBytes;
  const uint64_t deadline =
      clock_ns() + static_cast<uint64_t>(world_.options.capture_wait_ms) * 1'000'000;
  for (int attempt = 0;; ++attempt) {
    if ((c.header.flags & kSettingUp) && clock_ns() > deadline) {
      c.header.flags &= ~(kSettingUp | kCanServe);
      c.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
    }
    std::vector<uint8_t> all;
    if (!channel_.exchange_at_capture(kind, c, seq, stamp(trace::RoundEvent::Issued), bytes, all))
      return false;
    outcome = decide_commit(all, info_.nranks, kind, c.header.decision_hash);
    trace_round(kind, trace::RoundEvent::Read, seq, plan_.decision.mode, outcome.reason,
                outcome.agreed ? plan_.decision.moved : 0);
    if (!outcome.pending) return outcome.agreed;
    std::this_thread::sleep_for(pause_before(attempt));
    const uint64_t hash = c.header.decision_hash;
    c = channel_.header(kind, stamp(trace::RoundEvent::Issued));
    c.header.decision_hash = hash;
    if (kind == RoundKind::Publish)
      commit_.prepare_again(c, plan_);
    else
      commit_.confirm(c, plan_, seq);
  }
}

// Nothing moves from this capture's round: the captured gathers stay on NCCL on every rank (all
// read the same), said with `why` (null: the board's own reason, said by the channel).
void CommAgreement::end_capture_round(uint64_t seq, const char* why) {
  trial_.stop();
  serving_.drop();
  plan_.sources.clear();
  set_phase(Phase::Watching, seq);
  log_.no_capture_round(seq, why != nullptr ? why : channel_.board_gone().c_str(), why == nullptr);
}

// Which buckets of a plan read at a capture move, untimed; returns what decided, for the log.
const char* CommAgreement::choose_untimed(Decision& d) const {
  if (!d.moves_anything()) return "nothing to move";
  if (world_.options.ce_force) return "MAGI_CE_FORCE=1";
  // Judged by bucket, from the sizes the ladder agreed (alike on every rank, as the verdicts
  // are), before any gather is taken out of its bucket's size.
  std::vector<Reason> stays(plan_buckets_of(d), Reason::Count);  // Count: not judged yet
  bool by_verdict = false;
  bool by_rule = false;
  for (const GatherDecision& g : d.gathers) {
    if (!g.moves || stays[g.bucket] != Reason::Count) continue;
    const uint64_t bytes = bucket_bytes(step_.seen, g.bucket, d.gathers);
    switch (policy_.size_verdict(bytes)) {
      case ExplorationPolicy::SizeVerdict::Moves:
        by_verdict = true;
        stays[g.bucket] = Reason::None;
        break;
      case ExplorationPolicy::SizeVerdict::Stays:
        by_verdict = true;
        stays[g.bucket] = Reason::NcclFaster;
        break;
      case ExplorationPolicy::SizeVerdict::Unknown:
        by_rule = true;
        stays[g.bucket] = bytes >= kCaptureRuleBytes ? Reason::None : Reason::CaptureRule;
        break;
    }
  }
  uint32_t moved = 0;
  for (GatherDecision& g : d.gathers) {
    if (!g.moves) continue;
    if (stays[g.bucket] == Reason::None) {
      ++moved;
    } else {
      g.moves = false;
      g.reason = stays[g.bucket];
    }
  }
  d.moved = moved;
  return by_verdict && by_rule ? "the eager cost rounds' size verdicts, and the size rule"
         : by_verdict          ? "the eager cost rounds' size verdicts"
                               : "the size rule (a bucket of at least 1 MiB a rank moves)";
}

}  // namespace magi::rewrite
