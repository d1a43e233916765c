#include "rewrite/agreement.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace magi::rewrite {

CommAgreement::CommAgreement(ncclComm_t comm, const capture::CommInfo& info, AgreementWorld world)
    : info_(info),
      world_(std::move(world)),
      log_(info_.identity),
      policy_(world_.options),
      channel_(comm, info_, world_, policy_, log_),
      hello_(info_, world_.options, world_.nccl.all_gather != nullptr, log_),
      serving_(world_, info_, comm),
      commit_(world_, info_, serving_, log_) {
  const Options& options = world_.options;
  if (!hello_.takes_part()) phase_ = Phase::Off;
  step_.seen.key_on_buffers(options.static_weights);
  log_.why_no_agreement(hello_.never(), hello_.owed(), info_.nonblocking,
                        options.transport == Options::Transport::Nccl, hello_.takes_part());
  // Made here, not at the call that finds the step: the call path allocates nothing.
  if (phase_ != Phase::Off)
    step_.refined.watch_own_facts_up_to(static_cast<uint32_t>(options.max_step_calls));
}

CommAgreement::~CommAgreement() {
  coverage_.say(info_.identity, policy_.cost_summary());
  serving_.drop();
  if (phase_ == Phase::Off) hello_.look(channel_, stamp(trace::RoundEvent::Read));
  // Rounds still in flight belong to NCCL until they complete: the pool frees only those that
  // did, and leaves the others (RoundBuffers).
  if (const std::unique_ptr<Round> pending = channel_.take_pending()) channel_.retire(*pending);
  hello_.end(channel_);
}

Route CommAgreement::on_collective(const capture::CallArgs& args, capture::CallRecord& record,
                                   const capture::StepView& detected) {
  if (!detected.collective) return {};
  const uint64_t seq = detected.collective_index;
  // No NCCL round at a call captured into a CUDA graph (it would run at each replay, not now): a
  // captured gather no plan covers is agreed through the board (capture_rounds.cc). Capture is
  // the one input here that is not a shape: programs capture the same calls on every rank.
  if (hello_.owed() && !capture::stream_capturing(args, record) &&
      !hello_.issue(channel_, stamp(trace::RoundEvent::Issued), seq,
                    world_.make.locality(info_).host))
    set_phase(Phase::Off, seq);
  if (const Reason quiet = hello_.at_collective(seq); quiet != Reason::None)
    trace_round(RoundKind::Hello, trace::RoundEvent::Read, seq, AgreementMode::None, quiet, 0);
  const bool gather = args.op == trace::Op::AllGather;
  // Counted where nothing explores too: the end line says what the program got.
  if (gather) coverage_.count_gather(args.count * datatype_bytes(static_cast<uint8_t>(args.dtype)));
  if (phase_ == Phase::Off) {
    if (hello_.in_flight()) hello_.look(channel_, stamp(trace::RoundEvent::Read));
    // Not at a captured call: the buffers' event queries would be refused there, and could end
    // the program's capture.
    if (channel_.any_retired() && !capture::stream_capturing(args, record)) channel_.free_ready();
    return {};
  }
  // MAGI_GRAPH_SLOTS=auto asks for graph slots in the proposes from here.
  if (gather && capture::stream_capturing(args, record)) channel_.saw_capture();
  const CallFacts facts = CallFacts::of(args, record);
  step_.recent.add(seq, facts);
  if (detected.event == capture::StepDetector::Event::Lost) on_lost(seq);
  const capture::StepView view =
      step_view(detected, record, gather && (record.flags & trace::kCallCapturing) != 0);
  if (!view.found) return {};
  // A step found that the agreement already follows (a step of one call the detector now finds:
  // nothing else is found with the digest it follows, which a loss clears) goes on, plan and all.
  if (view.digest != step_.digest) restart(view);
  // A step of one call is whole once its call is seen: a round at this capture may come at once.
  const bool one_call_starts = one_call_.holds && one_call_.origin == seq;
  if (step_.seen.has_gathers()) step_.refined.watch(record, view, step_.seen.keyed_on_buffers());
  uint32_t position = step_.refined.position_of(view);
  if (position == 0) step_.seen.begin_step();
  if (position == policy_.anchor()) {
    policy_.pass_anchor();
    if (anchor_has_work() && !capture::stream_capturing(args, record)) {
      at_anchor(view);
      position = step_.refined.position_of(view);  // a refinement read here renumbers this call
    }
  } else if (round_due(seq) && !capture::stream_capturing(args, record)) {
    read_round(seq);  // read inside the step (ExplorationPolicy::read_distance)
    position = step_.refined.position_of(view);
  }
  step_.seen.observe(position, facts, channel_.backend());
  if (one_call_starts) step_.seen.begin_step();

  const bool capturing = (record.flags & trace::kCallCapturing) != 0;  // asked for gathers
  if (gather && capturing && capture_round_due()) {
    agree_at_capture(seq);
    position = step_.refined.position_of(view);  // a refinement read there renumbers this call
  }
  // A graph captured with no plan in force keeps its gathers on NCCL at every replay (said once).
  if (gather && capturing && !plan_in_force(phase_)) log_.early_capture(seq);
  const Routed routed =
      route_by_plan(plan_.routes(plan_in_force(phase_), committing(phase_) && trial_.running(),
                                 trial_.sends_to_nccl(policy_.steps()), step_.digest),
                    {position, gather, capturing, view.digest});
  if (routed.captured != Routed::Captured::No)
    log_.captured(routed.captured == Routed::Captured::Moves, plan_.bound(), plan_.dry(),
                  world_.options.graph_slots == Options::GraphSlots::Never);
  Route route = routed.route;
  if (route.kind == Route::Kind::TrialNccl) trial_.routed_to_nccl(route.bucket, position);
  // Static weights: where each bound shard lives follows every call of its position from the
  // binding on, whatever route the call takes: find() for a moved call, observe() for any other
  // (NCCL before the activation, the trial's NCCL side, a bucket the cost round kept on NCCL, a
  // captured call left to NCCL). A call missed here leaves its shard's old block named as its
  // home, and a layer the program then moves into that block would read this one's binding.
  const size_t home_slot =
      gather && view.digest == step_.digest ? plan_.sources.slot_of(position) : SIZE_MAX;
  if (home_slot == SIZE_MAX) return route;
  const uint64_t send_bytes = args.count * datatype_bytes(static_cast<uint8_t>(args.dtype));
  if (route.kind != Route::Kind::Move) {
    plan_.sources.observe(position, record.sendbuf, send_bytes, home_slot);
    return route;
  }
  const BoundSources::Found found =
      plan_.sources.find(position, record.sendbuf, send_bytes, home_slot);
  route.slot_offset = found.slot_offset;
  route.verify_now = found.verify_now;
  if (found.other_source) {
    route.own_offset = home_slot;
    log_.other_source(position);
  }
  return route;
}

void CommAgreement::set_phase(Phase to, uint64_t seq) {
  log_.phase(phase_, to, seq);
  phase_ = to;
}

ncclResult_t CommAgreement::serve(std::span<const ce::GatherOp> bucket,
                                  std::span<const NcclGather> calls, cudaStream_t stream,
                                  uint16_t bucket_id, bool via_nccl, uint32_t plan,
                                  uint64_t first_collective, bool* moved) {
  bool by_transport = false;
  // Routed as captured into a CUDA graph (Route::captured): every gather of a bucket alike.
  const bool captured =
      std::any_of(bucket.begin(), bucket.end(), [](const ce::GatherOp& op) { return op.captured; });
  const ncclResult_t r = !plan_.serves(plan) && !via_nccl
                             ? serving_.forward_to_nccl(calls, stream)
                             : serving_.serve(bucket, calls, stream, bucket_id, via_nccl, captured,
                                              trial_, plan_.layout, by_transport);
  if (moved != nullptr) *moved = by_transport;
  coverage_.count_served(calls, by_transport, via_nccl, first_collective, captured);
  return r;
}

// The step was found, or changed: whatever was agreed for the old one ends here.
void CommAgreement::restart(const capture::StepView& view) {
  deactivate(view.collective_index, Reason::Deviated);
  abandon_pending(view.collective_index);
  step_.seen.reset(view.period, info_.rank);
  step_.recent.seed(step_.seen, view.origin, view.period, view.collective_index,
                    channel_.backend());
  serving_.forget_stale();
  step_.digest = view.digest;
  policy_.restart(view.digest, view.position, step_.seen.complete_steps());
  // Steps are counted afresh: a round at a capture may come at once, and may move what one
  // before this restart could not.
  capture_.attempted_at_step = UINT64_MAX;
  capture_.nothing_moved_digest = 0;
  // A new shape step: rounds follow it, and this rank's own facts are watched afresh from here.
  step_.refined.follow_shape_step(view);
}

// Every rank read the same refinement at this call: rounds start over on the longer step.
void CommAgreement::refine(const Decision& d, uint64_t seq, bool then_propose) {
  deactivate(seq, Reason::StepRefined);
  serving_.drop();
  step_.refined.agree(d.refine_period, d.refine_phase);
  const uint32_t period = step_.refined.period();
  step_.seen.reset(period, info_.rank);
  // Seeded, as at a shape step's start, with the calls since the shape step's run began, each at
  // its refined position: the warmup may be complete here already.
  step_.recent.seed(step_.seen, step_.refined.refined_run_origin(), period, seq,
                    channel_.backend());
  serving_.forget_stale();
  policy_.restart(step_.digest ^ period, step_.refined.refined_position(seq),
                  step_.seen.complete_steps());
  log_.refined(plan_.round, period, period / std::max<uint32_t>(step_.refined.shape_period(), 1));
  // Every rank read the refinement at this call, so a propose issued here too is issued alike;
  // the seeded warmup may already be complete, and the next anchor is a whole refined step away.
  if (then_propose && propose_due()) propose(seq);
}

void CommAgreement::on_lost(uint64_t seq) {
  deactivate(seq, Reason::Deviated);
  abandon_pending(seq);
  // The window stays until the next plan replaces it or the communicator ends. Gathers routed
  // before this call inside the still-open group go to NCCL when the group ends (serve()).
  step_.digest = 0;
}

// The round in flight and the plan being committed go with the step.
void CommAgreement::abandon_pending(uint64_t seq) {
  if (committing(phase_)) trial_.stop();
  commit_.stop_waiting();
  if (!plan_in_force(phase_)) plan_.sources.clear();  // a plan being committed ends with its round
  set_phase(at_rest(plan_in_force(phase_)), seq);
  const std::unique_ptr<Round> round = channel_.take_pending();
  if (!round) return;
  trace_round(round->kind, trace::RoundEvent::Abandoned, seq, AgreementMode::None, Reason::Deviated,
              0);
  channel_.retire(*round);
}

bool CommAgreement::anchor_has_work() const {
  return round_in_flight(phase_) || phase_ == Phase::SettingUp || channel_.any_retired() ||
         trial_.running() || trial_.timing() || propose_due();
}

// A round is read at its call (RoundChannel::due). A timed plan's confirm also waits until each
// of its buckets went to NCCL once since the propose read (the trial's NCCL side, by routes: the
// same call on every rank), a step on at the latest.
bool CommAgreement::round_due(uint64_t seq) const {
  if (!channel_.due(seq)) return false;
  const uint64_t step = std::min<uint64_t>(seq, step_.seen.period());
  return phase_ != Phase::Confirming ||
         trial_.confirm_may_come(static_cast<uint64_t>(world_.options.warmup_steps)) ||
         channel_.due(seq - step);
}

bool CommAgreement::propose_due() const {
  return step_.seen.has_gathers() && policy_.propose_due(step_.seen.complete_steps());
}

void CommAgreement::at_anchor(const capture::StepView& view) {
  const uint64_t seq = view.collective_index;
  channel_.free_ready();
  trial_.collect();
  if (round_in_flight(phase_)) {
    if (round_due(seq)) read_round(seq);
  } else if (phase_ == Phase::SettingUp) {
    if (commit_.due(policy_.steps()))
      commit_round(commit_.waiting_for(), commit_.waiting_hash(), seq);
  } else if (trial_.due(policy_.steps()) && plan_in_force(phase_)) {
    issue_cost(seq);
  } else if (propose_due()) {
    // The hello first: read where the first other round comes due, before issuing it.
    if (hello_.read(channel_, stamp(trace::RoundEvent::Read), seq))
      propose(seq);
    else
      set_phase(Phase::Off, seq);
  }
}

void CommAgreement::issue(RoundKind kind, Contribution& c, uint64_t seq, size_t bytes_each) {
  std::unique_ptr<Round> round =
      channel_.issue(kind, c, seq, stamp(trace::RoundEvent::Issued), bytes_each);
  if (!round) {
    set_phase(Phase::Off, seq);
    return;
  }
  set_phase(issued(kind, phase_), seq);
  channel_.pend(std::move(round));
}

void CommAgreement::read_round(uint64_t seq) {
  const std::unique_ptr<Round> round = channel_.take_pending();
  set_phase(at_rest(plan_in_force(phase_)), seq);
  if (round->voted_no) {
    read_voted_no(*round, seq);
    return;
  }
  const std::span<const uint8_t> all = channel_.read(*round);
  const RoundBuffers::KeepWhenRead keep(channel_.buffers(), round->exchange, round->bytes);
  switch (round->kind) {
    case RoundKind::Propose:
      take_decision(judged(decide(all, info_.nranks, info_.rank), policy_, step_.seen,
                           world_.options.ce_force, step_.digest),
                    round->number, seq);
      break;
    case RoundKind::Publish:
    case RoundKind::Confirm: read_commit(all, *round, seq); break;
    case RoundKind::Cost: after_cost(all, seq); break;
    case RoundKind::Hello: break;  // never pending: the hello gate's
  }
}

// This rank said no, so the answer is no whatever the others said: no need to wait for a round
// that may not have launched yet.
void CommAgreement::read_voted_no(Round& round, uint64_t seq) {
  channel_.retire(round);
  switch (round.kind) {
    case RoundKind::Propose:
      take_decision(void_propose(step_.seen.entries(world_.options, channel_.backend())),
                    round.number, seq);
      break;
    case RoundKind::Cost:
      // Unread, so unmeasured for every rank alike: the agreed plan stands as it is.
      trace_round(RoundKind::Cost, trace::RoundEvent::Read, seq, plan_.decision.mode,
                  Reason::AnchorInGroup, plan_.decision.moved);
      break;
    case RoundKind::Hello: break;  // never pending: the hello gate's
    case RoundKind::Publish:
    case RoundKind::Confirm:
      trace_round(round.kind, trace::RoundEvent::Read, seq, AgreementMode::None,
                  Reason::AnchorInGroup, 0);
      end_commit(seq);
      break;
  }
}

void CommAgreement::propose(uint64_t seq) {
  policy_.next_round();
  Contribution c = propose_contribution(false);
  issue(RoundKind::Propose, c, seq);
}

Contribution CommAgreement::propose_contribution(bool at_capture) {
  Contribution c = channel_.header(RoundKind::Propose, stamp(trace::RoundEvent::Issued));
  const StepObservation& seen = step_.seen;
  c.entries = seen.entries(world_.options, channel_.backend(), serving_.stale_positions(),
                           at_capture, one_call_.holds);
  if (serving_.failed()) {
    for (GatherEntry& e : c.entries) e.reason = static_cast<uint8_t>(Reason::TransportFailed);
  }
  ContributionHeader& h = c.header;
  h.gathers = static_cast<uint32_t>(c.entries.size());
  h.callsite_digest = seen.callsite_digest();
  h.group_digest = seen.group_digest();
  if (!seen.groups_stable()) h.flags |= kGroupsUnstable;
  step_.refined.propose(seen, h);
  const ce::Locality here = world_.make.locality(info_);
  h.host = here.host;
  h.device = here.device;
  h.peer_access_mask = here.peer_access_mask;
  h.hold_max_bytes = world_.options.bind_max_bytes;
  return c;
}

void CommAgreement::take_decision(const Decision& d, uint32_t round, uint64_t seq) {
  capture_.nothing_moved_digest = 0;  // eager rounds may have judged sizes since
  plan_.decision = d;
  plan_.round = round;
  trace_round(RoundKind::Propose, trace::RoundEvent::Read, seq, d.mode, d.reason, d.moved);
  record_decision(world_.trace, info_, step_.seen, d, round);
  if (d.refine_period != 0)
    refine(d, seq);
  else
    after_propose(d, seq);
}

// After a round, the next propose: soon while the agreement could still move more, else after
// MAGI_REAGREE_STEPS.
void CommAgreement::schedule_after(bool short_of_what_could_move) {
  if (short_of_what_could_move)
    policy_.retry_soon();
  else
    policy_.reagree_later();
}

void CommAgreement::after_propose(const Decision& d, uint64_t seq) {
  const StepObservation& seen = step_.seen;
  // Where a publish follows, its read or its confirm's sets when the next propose comes.
  const bool stands = plan_in_force(phase_) && plan_.stands(d);
  if (!d.moves_anything() || d.dry_run || stands) schedule_after(d.retry_soon);
  if (d.reason == Reason::AnchorInGroup && seen.period() > 1) policy_.move_anchor(seen.period());
  if (d.reason == Reason::PeerOffNode || d.reason == Reason::PeerNotAccessible ||
      d.reason == Reason::MachinesUneven || d.reason == Reason::OneRankPerMachine) {
    // Where the ranks run never changes for a communicator: no round will ever move anything.
    policy_.stop(d.reason);
    log_.stopped(plan_.round, d.reason);
  }
  if (!d.moves_anything()) {
    deactivate(seq, d.reason != Reason::None ? d.reason : Reason::OtherRankRefused);
    serving_.drop();
    return;
  }

  if (stands) return;
  deactivate(seq, Reason::None);
  plan_.layout = lay_out_slots(seen, d.gathers, d.bound);
  if (d.transient_rank >= 0) log_.transient(plan_.round, d);
  if (d.machines.spans()) log_.two_levels(plan_.round, d, info_.rank);
  const size_t buckets = plan_.buckets();
  if (d.dry_run) {
    trial_.begin(false, buckets);
    activate(seq, true);
    return;
  }
  // Timed unless forced, or unless every moving bucket's size already has a verdict.
  const bool forced = world_.options.ce_force;
  bool timed = !forced;
  for (uint16_t b = 0; timed && b < buckets; ++b)
    timed = policy_.size_verdict(bucket_bytes(seen, b, d.gathers)) !=
            ExplorationPolicy::SizeVerdict::Moves;
  if (!timed && !forced) log_.not_timed_again(plan_.round);
  // Timed: the plan's gathers sent to NCCL from here until its activation are the trial's NCCL
  // side (committing(), route_by_plan).
  trial_.begin(timed, buckets);
  trial_.await_nccl_routes(plan_.layout);
  publish(seq);
}

void CommAgreement::publish(uint64_t seq) {
  Contribution c = channel_.header(RoundKind::Publish, stamp(trace::RoundEvent::Issued));
  c.header.decision_hash = plan_.decision.hash;
  commit_.prepare(c, plan_, step_.seen);
  issue(RoundKind::Publish, c, seq, plan_.publish_bytes());
}

void CommAgreement::commit_round(RoundKind kind, uint64_t decision_hash, uint64_t seq) {
  Contribution c = channel_.header(kind, stamp(trace::RoundEvent::Issued));
  c.header.decision_hash = decision_hash;
  if (kind == RoundKind::Publish) {
    commit_.prepare_again(c, plan_);
    issue(RoundKind::Publish, c, seq, plan_.publish_bytes());
  } else {
    commit_.confirm(c, plan_, seq);
    issue(RoundKind::Confirm, c, seq);
  }
}

void CommAgreement::read_commit(std::span<const uint8_t> all, const Round& round, uint64_t seq) {
  const CommitOutcome c = decide_commit(all, info_.nranks, round.kind, round.decision_hash);
  trace_round(round.kind, trace::RoundEvent::Read, seq, plan_.decision.mode, c.reason,
              c.agreed ? plan_.decision.moved : 0);
  if (c.pending) {
    // Some rank is still setting up: every rank read the same, so every rank issues the round
    // again at the same later step (Commit::wait), the gathers on NCCL meanwhile.
    if (commit_.wait(round.kind, round.decision_hash, policy_.waits_from()))
      commit_round(round.kind, round.decision_hash, seq);
    else
      set_phase(Phase::SettingUp, seq);
    return;
  }
  commit_.stop_waiting();  // the next round's wait, if any, backs off from one step again
  if (!c.agreed) {
    if (round.kind == RoundKind::Publish)
      log_.cannot_serve(round.number, c.reason);
    else
      log_.not_confirmed(round.number, c.reason);
    end_commit(seq);
  } else if (round.kind == RoundKind::Publish) {
    commit_.attach(c);
    commit_round(RoundKind::Confirm, round.decision_hash, seq);
  } else {
    activate(seq, false);
    schedule_after(plan_.decision.retry_soon);
  }
}

void CommAgreement::end_commit(uint64_t seq) {
  trial_.stop();
  serving_.drop();
  plan_.sources.clear();
  policy_.retry_soon();
  policy_.read_at_anchor();
  set_phase(Phase::Watching, seq);
}

void CommAgreement::activate(uint64_t seq, bool dry) {
  plan_.activate(step_.digest, dry);
  trial_.start(policy_.steps(), static_cast<uint64_t>(world_.options.warmup_steps));
  set_phase(Phase::Active, seq);
  trace_round(dry ? RoundKind::Propose : RoundKind::Confirm, trace::RoundEvent::Activated, seq,
              plan_.decision.mode, Reason::None, plan_.decision.moved);
  log_.activated(plan_.round, dry, plan_.decision, seq, plan_.graph_slots());
}

// The plan in force, if any, ends: routes go back to NCCL from this call.
void CommAgreement::deactivate(uint64_t seq, Reason why) {
  if (!plan_in_force(phase_)) return;
  plan_.end();
  trial_.stop();
  set_phase(plan_ended(phase_), seq);
  trace_round(RoundKind::Propose, trace::RoundEvent::Deactivated, seq, plan_.decision.mode, why, 0);
  log_.deactivated(seq, why);
}

RoundStamp CommAgreement::stamp(trace::RoundEvent event) const {
  RoundStamp s;
  s.comm_id = info_.identity;
  s.rank = info_.rank;
  s.step_digest = step_.digest;
  s.round = event == trace::RoundEvent::Issued || event == trace::RoundEvent::Abandoned
                ? policy_.rounds()
                : plan_.round;
  s.period = step_.seen.period();
  s.gathers = static_cast<uint32_t>(plan_.decision.gathers.size());
  return s;
}

void CommAgreement::trace_round(RoundKind kind, trace::RoundEvent event, uint64_t seq,
                                AgreementMode mode, Reason reason, uint32_t moved) const {
  channel_.record(stamp(event), kind, event, seq, mode, reason, moved);
}

}  // namespace magi::rewrite
