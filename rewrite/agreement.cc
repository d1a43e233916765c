#include "rewrite/agreement.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include "base/clock.h"

namespace magi::rewrite {
namespace {

// Why a communicator can never take part in agreement, by facts of the program that every rank
// shares (so every rank stays out alike, hello included); Reason::None if it can.
Reason unagreeable(const capture::CommInfo& info) {
  // ncclCommInitAll puts every rank in this process, driven from one thread in groups: a round
  // would need every rank's contribution from that thread at once. Unknown communicators were
  // created before the shim saw them and have no identity shared with their peers.
  if (info.origin == capture::CommOrigin::InitAll || info.origin == capture::CommOrigin::Unknown)
    return Reason::CommNotAgreeable;
  if (info.rank < 0 || info.nranks < 1 || info.rank >= info.nranks) return Reason::CommNotAgreeable;
  // A non-blocking communicator may not even have enqueued a round's all-gather when the call
  // returns (ncclInProgress): a round could not be waited for safely. Every rank created it
  // with the same config, so every rank stays out alike.
  if (info.nonblocking) return Reason::CommNotAgreeable;
  return Reason::None;
}

}  // namespace

CommAgreement::CommAgreement(ncclComm_t comm, const capture::CommInfo& info, AgreementWorld world)
    : comm_(comm),
      info_(info),
      world_(std::move(world)),
      options_(world_.options),
      backend_(backend_of(options_)),
      settings_(schedule_settings(options_, ce::backend_available(backend_))),
      policy_(options_),
      flush_(world_.nccl, info_.identity),
      buffers_(info_.identity),
      serving_(world_, info_, comm) {
  const Reason never = unagreeable(info_) == Reason::None
                           ? ExplorationPolicy::never_explores(options_, info_.nranks)
                           : Reason::CommNotAgreeable;
  hello_due_ = never == Reason::None && world_.nccl.all_gather != nullptr;
  agreeable_ = hello_due_ && takes_part(settings_);
  seen_.key_on_buffers(options_.static_weights);
  if (never == Reason::SingleRank) {
    quiet_ = never;
    MAGI_INFO(Rewrite,
              "comm %012llx: one rank: NCCL's all-gather is one local copy there, which the copy "
              "engine cannot beat; no agreement on this communicator (MAGI_CE_FORCE=1 moves its "
              "gathers anyway)",
              short_id(info_.identity));
  } else if (!hello_due_) {
    MAGI_INFO(Rewrite, "comm %012llx: no agreement on this communicator (%s)",
              short_id(info_.identity),
              info_.nonblocking ? "non-blocking communicator" : "ncclCommInitAll or unknown");
  } else if (options_.transport == Options::Transport::Nccl) {
    MAGI_INFO(Rewrite,
              "comm %012llx: no agreement on this communicator (MAGI_TRANSPORT=nccl); its first "
              "collective still tells the peers so, with one small all-gather",
              short_id(info_.identity));
  } else if (!agreeable_) {
    // The hello tells the peers, which then stay on NCCL too.
    MAGI_INFO(Rewrite,
              "comm %012llx: no agreement: MAGI_BACKEND=cuda and the program has not "
              "loaded the CUDA driver (MAGI_BACKEND=host serves host buffers)",
              short_id(info_.identity));
  }
  // Made here, not at the call that finds the step: the call path allocates nothing.
  if (agreeable_) refined_.watch_own_facts_up_to(static_cast<uint32_t>(options_.max_step_calls));
}

CommAgreement::~CommAgreement() {
  coverage_.say(info_.identity, policy_.cost_summary());
  serving_.drop();
  if (hello_ && !agreeable_) look_at_hello(last_seq_);
  // Rounds still in flight belong to NCCL until they complete: the pool frees only those that
  // did, and leaves the others (RoundBuffers).
  if (pending_) buffers_.retire(std::move(pending_->exchange), pending_->bytes);
  if (hello_) buffers_.retire(std::move(hello_->exchange), hello_->bytes);
}

Route CommAgreement::on_collective(const capture::CallArgs& args, capture::CallRecord& record,
                                   const capture::StepView& view) {
  if (!view.collective) return {};
  // No round happens at a call captured into a CUDA graph: a capture forbids the waits and
  // allocations a round may need, and the round's all-gather must run now, not at each replay.
  // Whether a captured gather moves is decided below, by the agreed plan (static weights only).
  // Capture is the one input here that is not a shape: programs capture the same calls on every
  // rank (one graph, replayed by all).
  if (hello_due_ && !capture::stream_capturing(args, record)) issue_hello(view.collective_index);
  last_seq_ = view.collective_index;
  if (quiet_ != Reason::None) stay_quiet(quiet_, view.collective_index);
  const bool gather = args.op == trace::Op::AllGather;
  // Counted where nothing explores too: the end line says what the program got.
  if (gather) coverage_.count_gather(args.count * datatype_bytes(static_cast<uint8_t>(args.dtype)));
  if (!agreeable_) {
    if (hello_) look_at_hello(view.collective_index);
    // Not at a captured call: the buffers' event queries would be refused there, and could end
    // the program's capture.
    if (buffers_.any_retired() && !capture::stream_capturing(args, record)) buffers_.free_ready();
    return {};
  }
  if (gather) capture::stream_capturing(args, record);  // a fact of the observation
  // MAGI_GRAPH_SLOTS=auto asks for graph slots in the proposes from here.
  if (gather && (record.flags & trace::kCallCapturing) != 0) saw_capture_ = true;
  // A graph captured before any plan was active keeps its gathers on NCCL at every replay:
  // plans are agreed on eager calls only.
  if (gather && !active_ && (record.flags & trace::kCallCapturing) != 0 &&
      !std::exchange(early_capture_said_, true))
    MAGI_INFO(Rewrite,
              "comm %012llx: a gather captured into a CUDA graph at collective #%llu, before any "
              "plan was active: that graph keeps its gathers on NCCL at every replay. Plans are "
              "agreed on eager steps: capture once the log says \"moving\" (MAGI_WARMUP_STEPS=1 "
              "shortens the wait)",
              short_id(info_.identity), static_cast<unsigned long long>(view.collective_index));
  const CallFacts facts = CallFacts::of(args, record);
  recent_.add(view.collective_index, facts);
  if (view.event == capture::StepDetector::Event::Lost) on_lost(view.collective_index);
  if (!view.found) return {};
  if (view.event == capture::StepDetector::Event::Found || view.digest != step_digest_)
    restart(view);
  if (seen_.has_gathers()) refined_.watch(record, view, seen_.keyed_on_buffers());
  uint32_t position = refined_.position_of(view);
  if (position == 0) seen_.begin_step();
  if (position == policy_.anchor()) {
    policy_.pass_anchor();
    if (anchor_has_work() && !capture::stream_capturing(args, record)) {
      at_anchor(view);
      position = refined_.position_of(view);  // a refinement read here renumbers this very call
    }
  }
  seen_.observe(position, facts, backend_);

  const bool capturing = (record.flags & trace::kCallCapturing) != 0;  // asked for gathers
  Route route = route_at(position, gather, capturing, view.digest);
  // Static weights: where each bound shard lives follows every call of its position from the
  // binding on, whatever route the call takes: find() for a moved call, observe() for any other
  // (NCCL before the activation, the trial's NCCL side, a bucket the cost round kept on NCCL, a
  // captured call left to NCCL). A call missed here leaves its shard's old block named as its
  // home, and a layer the program then moves into that block would read this one's binding.
  const size_t home_slot =
      gather && view.digest == step_digest_ ? sources_.slot_of(position) : SIZE_MAX;
  if (home_slot == SIZE_MAX) return route;
  const uint64_t send_bytes = args.count * datatype_bytes(static_cast<uint8_t>(args.dtype));
  if (route.kind != Route::Kind::Move) {
    sources_.observe(position, record.sendbuf, send_bytes, home_slot);
    return route;
  }
  const BoundSources::Found found = sources_.find(position, record.sendbuf, send_bytes, home_slot);
  route.slot_offset = found.slot_offset;
  route.verify_now = found.verify_now;
  if (found.other_source) route.own_offset = home_slot;
  if (found.other_source && other_source_calls_++ == 0)
    MAGI_INFO(Transport,
              "comm %012llx: static weights: the gather at position %u sends a buffer bound for "
              "another position; it reads that binding on every peer (exact when every rank made "
              "the same change; counted)",
              short_id(info_.identity), position);
  return route;
}

// The route of the call at `position` by the plan alone (its static sources aside).
Route CommAgreement::route_at(uint32_t position, bool gather, bool capturing, uint64_t digest) {
  if (committing_ && !capturing && digest == step_digest_)
    return route_while_committing(position, gather);
  // A captured gather moves with static weights (its copies read memory that never changes,
  // so a replay repeats nothing that orders the ranks), or in the default mode on the graph
  // slots of a plan that has them (a handshake of latches, which every replay leaves as it
  // found it). The eager handshake counts buckets, which a replay cannot: without graph slots
  // captured gathers stay on NCCL. The route follows the agreed plan by position alone, as an
  // eager call's does, so every rank that captures the same calls captures the same route. A
  // static read waits on no peer, so a rank that runs the call eagerly instead is served alike;
  // graph slots need every rank to capture it (as assumed of programs: rewrite/agreement.h).
  const bool captured_moves = capturing && (active_bound_ || active_graph_slots_) && !active_dry_;
  if (!active_ || !gather || digest != active_digest_ ||
      position >= layout_.offset_by_position.size())
    return {};
  const size_t offset = layout_.offset_by_position[position];
  if (offset == SIZE_MAX) return {};
  if (capturing) say_captured(captured_moves);
  if (capturing && !captured_moves) return {};
  Route::Kind kind = active_dry_ ? Route::Kind::WouldMove : Route::Kind::Move;
  if (trial_.sends_to_nccl(policy_.steps())) {
    // The trial's NCCL side is timed with events, which a graph cannot hold: a captured call of
    // that step is plain NCCL, on every rank (the step count is shared).
    if (capturing) return {};
    kind = Route::Kind::TrialNccl;
  }
  Route route{kind, offset, layout_.bucket_by_position[position]};
  route.plan = active_plan_;
  route.captured = capturing;
  return route;
}

// Once for each answer, per communicator: what a graph captured at an agreed position gets.
void CommAgreement::say_captured(bool moves) {
  bool& said = moves ? captured_moves_said_ : captured_stays_said_;
  if (std::exchange(said, true)) return;
  if (moves && active_bound_)
    MAGI_INFO(Rewrite,
              "comm %012llx: gathers captured into a CUDA graph move with the plan (static "
              "weights): each replay reads the peers' shards where they lie, with no handshake; "
              "the mappings live as long as the graph",
              short_id(info_.identity));
  else if (moves)
    MAGI_INFO(Rewrite,
              "comm %012llx: gathers captured into a CUDA graph move with the plan, on its graph "
              "slots: each replay stages this rank's shards and reads the peers', ordered by "
              "latches that the replay leaves as it found them; the window lives as long as the "
              "graph",
              short_id(info_.identity));
  else
    MAGI_INFO(Rewrite,
              "comm %012llx: gathers captured into a CUDA graph stay on NCCL on every rank: %s",
              short_id(info_.identity),
              active_dry_ ? "MAGI_DRY_RUN=1"
              : options_.graph_slots == Options::GraphSlots::Never
                  ? "MAGI_GRAPH_SLOTS=never (the default mode's eager handshake counts buckets, "
                    "which a replay would repeat)"
                  : "the plan has no graph slots; the next plan agreed has them, unless a rank "
                    "sets MAGI_GRAPH_SLOTS=never (a graph captured before keeps NCCL: "
                    "MAGI_GRAPH_SLOTS=always gives them from the first plan, "
                    "MAGI_STATIC_WEIGHTS=1 needs none)");
}

Route CommAgreement::route_while_committing(uint32_t position, bool gather) const {
  if (!gather || position >= layout_.offset_by_position.size()) return {};
  const size_t offset = layout_.offset_by_position[position];
  if (offset == SIZE_MAX) return {};
  Route route{Route::Kind::TrialNccl, offset, layout_.bucket_by_position[position]};
  route.plan = active_plan_ + 1;  // the plan it would be served by once active
  return route;
}

void CommAgreement::stay_quiet(Reason why, uint64_t seq) {
  quiet_ = Reason::None;
  record(RoundKind::Hello, trace::RoundEvent::Read, seq, AgreementMode::None, why, 0);
}

ncclResult_t CommAgreement::serve(std::span<const ce::GatherOp> bucket,
                                  std::span<const NcclGather> calls, cudaStream_t stream,
                                  uint16_t bucket_id, bool via_nccl, uint32_t plan,
                                  uint64_t first_collective, bool* moved) {
  bool by_transport = false;
  const bool plan_ended = !active_ || active_dry_ || plan != active_plan_;
  // Routed as captured into a CUDA graph (Route::captured): every gather of a bucket alike.
  const bool captured =
      std::any_of(bucket.begin(), bucket.end(), [](const ce::GatherOp& op) { return op.captured; });
  const ncclResult_t r = plan_ended && !via_nccl
                             ? serving_.forward_to_nccl(calls, stream)
                             : serving_.serve(bucket, calls, stream, bucket_id, via_nccl, captured,
                                              trial_, layout_, by_transport);
  if (moved != nullptr) *moved = by_transport;
  coverage_.count_served(calls, by_transport, via_nccl, first_collective, captured);
  return r;
}

// The step was found, or changed: whatever was agreed for the old one ends here.
void CommAgreement::restart(const capture::StepView& view) {
  if (active_) deactivate(view.collective_index, Reason::Deviated);
  abandon_pending(view.collective_index);
  seen_.reset(view.period, info_.rank);
  recent_.seed(seen_, view.origin, view.period, view.collective_index, backend_);
  serving_.forget_stale();
  step_digest_ = view.digest;
  policy_.restart(view.digest, view.position);
  // A new shape step: rounds follow it, and this rank's own facts are watched afresh from here.
  refined_.follow_shape_step(view);
}

// Every rank read the same refinement at this call: rounds start over on the longer step.
void CommAgreement::refine(const Decision& d, uint64_t seq) {
  if (active_) deactivate(seq, Reason::StepRefined);
  serving_.drop();
  refined_.agree(d.refine_period, d.refine_phase);
  const uint32_t period = refined_.period();
  seen_.reset(period, info_.rank);
  // Seeded, as at a shape step's start, with the calls since the shape step's run began, each at
  // its refined position: the warmup may be complete here already.
  recent_.seed(seen_, refined_.refined_run_origin(), period, seq, backend_);
  serving_.forget_stale();
  policy_.restart(step_digest_ ^ period, refined_.refined_position(seq));
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: the step is %u collectives (%u shape steps): each gather "
            "keeps its own position",
            short_id(info_.identity), decision_round_, period,
            period / std::max<uint32_t>(refined_.shape_period(), 1));
  // Every rank read the refinement at this call, so a propose issued here too is issued alike;
  // the seeded warmup may already be complete, and the next anchor is a whole refined step away.
  if (propose_due()) propose(seq);
}

void CommAgreement::on_lost(uint64_t seq) {
  if (active_) deactivate(seq, Reason::Deviated);
  abandon_pending(seq);
  // The window stays until the next plan replaces it or the communicator ends. Gathers routed
  // before this call inside the still-open group go to NCCL when the group ends (serve()).
  step_digest_ = 0;
}

void CommAgreement::abandon_pending(uint64_t seq) {
  if (committing_) {
    committing_ = false;
    trial_.stop();
  }
  wait_ = SetUpWait{};             // its plan goes with the step
  if (!active_) sources_.clear();  // a plan being committed ends with its round
  if (!pending_) return;
  record(pending_->kind, trace::RoundEvent::Abandoned, seq, AgreementMode::None, Reason::Deviated,
         0);
  buffers_.retire(std::move(pending_->exchange), pending_->bytes);
  pending_.reset();
}

bool CommAgreement::anchor_has_work() const {
  return pending_ || wait_.waiting || buffers_.any_retired() || trial_.running() ||
         trial_.timing() || propose_due();
}

bool CommAgreement::propose_due() const {
  return seen_.has_gathers() && policy_.propose_due(seen_.complete_steps());
}

void CommAgreement::at_anchor(const capture::StepView& view) {
  buffers_.free_ready();
  trial_.collect();
  if (pending_) {
    read_round(view.collective_index);
  } else if (wait_.waiting) {
    if (policy_.steps() >= wait_.due_step) {
      wait_.waiting = false;
      if (wait_.kind == RoundKind::Publish)
        publish_again(wait_.decision_hash, view.collective_index);
      else
        confirm(wait_.decision_hash, view.collective_index);
    }
  } else if (trial_.due(policy_.steps()) && active_) {
    issue_cost(view.collective_index);
  } else if (propose_due() && read_hello_round(view.collective_index)) {
    propose(view.collective_index);
  }
}

Contribution CommAgreement::header_for(RoundKind kind) const {
  Contribution c;
  ContributionHeader& h = c.header;
  h.magic = kContributionMagic;
  h.version = kContributionVersion;
  h.kind = static_cast<uint8_t>(kind);
  h.backend = static_cast<uint8_t>(backend_);
  h.rank = info_.rank;
  h.nranks = info_.nranks;
  h.step_digest = step_digest_;
  h.period = seen_.period();
  if (options_.dry_run) h.flags |= kDryRun;
  if (options_.static_weights) h.flags |= kStaticWeights;
  switch (options_.graph_slots) {
    case Options::GraphSlots::Always: h.flags |= kWantsGraphSlots; break;
    case Options::GraphSlots::Never: h.flags |= kRefusesGraphSlots; break;
    case Options::GraphSlots::Auto:
      if (saw_capture_) h.flags |= kWantsGraphSlots;
      break;
  }
  return c;
}

void CommAgreement::propose(uint64_t seq) {
  policy_.next_round();
  Contribution c = header_for(RoundKind::Propose);
  c.entries = seen_.entries(options_, backend_, serving_.stale_positions());
  if (serving_.failed()) {
    for (GatherEntry& e : c.entries) e.reason = static_cast<uint8_t>(Reason::TransportFailed);
  }
  ContributionHeader& h = c.header;
  h.gathers = static_cast<uint32_t>(c.entries.size());
  h.callsite_digest = seen_.callsite_digest();
  h.group_digest = seen_.group_digest();
  if (!seen_.groups_stable()) h.flags |= kGroupsUnstable;
  refined_.propose(seen_, h);
  const ce::Locality here = world_.make.locality(info_);
  h.host = here.host;
  h.device = here.device;
  h.peer_access_mask = here.peer_access_mask;
  issue(RoundKind::Propose, c, seq);
}

void CommAgreement::issue(RoundKind kind, Contribution& c, uint64_t seq, size_t bytes_each) {
  // A round that cannot launch now (it sits in a group holding Send/Recv until that group ends)
  // is never waited for: this rank votes no, and knows the answer without reading it.
  const GroupView group = world_.group();
  const bool in_group = !GroupFlush::launches_now(group);
  if (in_group) {
    c.header.flags |= kIssuedInGroup;
    c.header.flags &= ~kCanServe;
  }
  c.header.round = policy_.rounds();
  auto round = std::make_unique<Round>();
  round->kind = kind;
  round->number = policy_.rounds();
  round->voted_no = in_group;
  round->decision_hash = c.header.decision_hash;
  round->bytes = bytes_each;
  try {
    // Reused (RoundBuffers): made anew at every round, they would stall the program's streams.
    round->exchange =
        buffers_.take([&] { return world_.make.exchange(info_, bytes_each); }, bytes_each);
    std::vector<uint8_t> bytes(bytes_each);
    c.serialize(bytes);
    round->exchange->stage(bytes);
  } catch (const Error& e) {
    // Rare and serious (no memory for a few kilobytes): without a round of our own the peers'
    // round would meet the program's next call, so say so loudly.
    MAGI_WARN(Rewrite,
              "comm %012llx: cannot prepare an agreement round (%s); peers may wait for "
              "it",
              short_id(info_.identity), e.what());
    agreeable_ = false;
    return;
  }
  ce::Exchange& exchange = *round->exchange;
  const ncclResult_t result = flush_.issue_alone(group, [&] {
    return world_.nccl.all_gather(exchange.send_buffer(), exchange.recv_buffer(), bytes_each,
                                  ncclUint8, comm_, static_cast<cudaStream_t>(exchange.stream()));
  });
  if (result != ncclSuccess && result != ncclInProgress) {
    MAGI_WARN(Rewrite,
              "comm %012llx: NCCL refused an agreement round (%d); no agreement on this "
              "communicator from now on",
              short_id(info_.identity), static_cast<int>(result));
    agreeable_ = false;
    return;
  }
  exchange.issued();
  policy_.count_round_issued();
  pending_ = std::move(round);
  record(kind, trace::RoundEvent::Issued, seq, AgreementMode::None, Reason::None, 0);
}

void CommAgreement::read_round(uint64_t seq) {
  std::unique_ptr<Round> round = std::move(pending_);
  if (round->voted_no) {
    read_voted_no(*round, seq);
    return;
  }
  const uint64_t asked = clock_ns();
  const std::span<const uint8_t> all = round->exchange->result();
  policy_.count_round_wait(clock_ns() - asked);
  const RoundBuffers::KeepWhenRead keep(buffers_, round->exchange, round->bytes);
  switch (round->kind) {
    case RoundKind::Propose:
      take_decision(judged(decide(all, info_.nranks, info_.rank)), round->number, seq);
      break;
    case RoundKind::Publish: read_publish(all, *round, seq); break;
    case RoundKind::Confirm: read_confirm(all, *round, seq); break;
    case RoundKind::Cost: after_cost(all, seq); break;
    case RoundKind::Hello: break;  // never pending: hello_
  }
}

// This rank said no, so the answer is no whatever the others said: no need to wait for a round
// that may not have launched yet.
void CommAgreement::read_voted_no(Round& round, uint64_t seq) {
  buffers_.retire(std::move(round.exchange), round.bytes);
  switch (round.kind) {
    case RoundKind::Propose:
      take_decision(void_propose(seen_.entries(options_, backend_)), round.number, seq);
      break;
    case RoundKind::Cost:
      // Unread, so unmeasured for every rank alike: the agreed plan stands as it is.
      record(RoundKind::Cost, trace::RoundEvent::Read, seq, decision_.mode, Reason::AnchorInGroup,
             decision_.moved);
      break;
    case RoundKind::Hello: break;  // never pending: hello_
    case RoundKind::Publish:
    case RoundKind::Confirm:
      record(round.kind, trace::RoundEvent::Read, seq, AgreementMode::None, Reason::AnchorInGroup,
             0);
      committing_ = false;
      trial_.stop();
      serving_.drop();
      sources_.clear();
      policy_.retry_soon();
      break;
  }
}

void CommAgreement::issue_hello(uint64_t seq) {
  hello_due_ = false;
  Contribution c = header_for(RoundKind::Hello);
  c.table = hello_payload(settings_);
  c.header.table_bytes = static_cast<uint32_t>(c.table.size());
  issue(RoundKind::Hello, c, seq);
  hello_ = std::move(pending_);
  if (hello_ && hello_->voted_no) {
    buffers_.retire(std::move(hello_->exchange));
    hello_.reset();
    take_hello({false, Reason::AnchorInGroup,
                "this rank made the settings check inside a group holding Send/Recv: this "
                "communicator stays on NCCL on every rank"},
               seq);
  }
}

// Before this rank's first other round: waits for the hello if it must (every rank launched
// it at the first collective, so it completes). False: no round on this communicator, ever.
bool CommAgreement::read_hello_round(uint64_t seq) {
  if (!hello_) return agreeable_;
  const std::unique_ptr<Round> round = std::move(hello_);
  const uint64_t asked = clock_ns();
  const std::span<const uint8_t> all = round->exchange->result();
  policy_.count_round_wait(clock_ns() - asked);
  take_hello(read_hello(all, info_.nranks), seq);
  buffers_.keep_spare(round->exchange);
  return agreeable_;
}

// A rank that issues no rounds never waits for the hello: it reads it once complete, only to
// say why its peers stay on NCCL too.
void CommAgreement::look_at_hello(uint64_t seq) {
  if (!hello_->exchange->ready()) return;
  const std::unique_ptr<Round> round = std::move(hello_);
  const HelloOutcome hello = read_hello(round->exchange->result(), info_.nranks);
  buffers_.keep_spare(round->exchange);
  if (hello.reason == Reason::SettingsDiffer) take_hello(hello, seq);
}

void CommAgreement::take_hello(const HelloOutcome& hello, uint64_t seq) {
  record(RoundKind::Hello, trace::RoundEvent::Read, seq, AgreementMode::None, hello.reason, 0);
  if (hello.agreed) return;
  agreeable_ = false;
  if (hello.reason == Reason::SettingsDiffer && first_settings_warning())
    MAGI_WARN(Rewrite, "comm %012llx: %s", short_id(info_.identity), hello.why.c_str());
  else
    MAGI_INFO(Rewrite, "comm %012llx: %s", short_id(info_.identity), hello.why.c_str());
}

// Buckets of the decision being committed (the largest moving bucket index + 1).
size_t CommAgreement::plan_buckets() const {
  size_t buckets = 0;
  for (const GatherDecision& g : decision_.gathers)
    if (g.moves) buckets = std::max<size_t>(buckets, g.bucket + 1u);
  return buckets;
}

// A bucket's bytes as served: its moving gathers' shards, each aligned as in a slot. Shapes
// only, so equal on every rank.
uint64_t CommAgreement::bucket_bytes_of(const Decision& d, uint16_t bucket) const {
  uint64_t bytes = 0;
  for (const GatherDecision& g : d.gathers) {
    if (!g.moves || g.bucket != bucket || g.position >= seen_.period()) continue;
    const PositionSeen& p = seen_.at(g.position);
    bytes += round_up(p.count * datatype_bytes(p.dtype), kSlotAlignment);
  }
  return bytes;
}

Decision CommAgreement::judged(Decision d) const {
  if (!d.moves_anything()) return d;
  if (policy_.nccl_won(d.hash)) {
    // This very plan was timed and NCCL won every bucket: trying it again would only disturb
    // the program every MAGI_REAGREE_STEPS. A plan that differs in any way is tried afresh.
    for (GatherDecision& g : d.gathers) {
      if (!g.moves) continue;
      g.moves = false;
      g.reason = Reason::NcclFaster;
    }
  } else if (!options_.ce_force) {
    // Buckets of sizes NCCL already won stay without being tried.
    std::vector<uint16_t> stays;
    for (const GatherDecision& g : d.gathers)
      if (g.moves && std::find(stays.begin(), stays.end(), g.bucket) == stays.end() &&
          policy_.size_verdict(bucket_bytes_of(d, g.bucket)) ==
              ExplorationPolicy::SizeVerdict::Stays)
        stays.push_back(g.bucket);
    if (stays.empty()) return d;
    for (GatherDecision& g : d.gathers) {
      if (g.moves && std::find(stays.begin(), stays.end(), g.bucket) != stays.end()) {
        g.moves = false;
        g.reason = Reason::NcclFaster;
      }
    }
  } else {
    return d;
  }
  recount(d, step_digest_);
  // Measured, not unsettled: the next propose keeps its usual distance.
  if (!d.moves_anything()) d.retry_soon = false;
  return d;
}

void CommAgreement::take_decision(const Decision& d, uint32_t round, uint64_t seq) {
  decision_ = d;
  decision_round_ = round;
  record(RoundKind::Propose, trace::RoundEvent::Read, seq, d.mode, d.reason, d.moved);
  record_decision(world_.trace, info_, seen_, d, decision_round_);
  if (d.refine_period != 0)
    refine(d, seq);
  else
    after_propose(d, seq);
}

void CommAgreement::read_publish(std::span<const uint8_t> all, const Round& round, uint64_t seq) {
  const CommitOutcome c = decide_commit(all, info_.nranks, RoundKind::Publish, round.decision_hash);
  record(RoundKind::Publish, trace::RoundEvent::Read, seq, decision_.mode, c.reason,
         c.agreed ? decision_.moved : 0);
  if (c.pending) {
    wait_for_set_up(RoundKind::Publish, round.decision_hash, seq);
    return;
  }
  wait_ = SetUpWait{};  // the confirm's wait, if any, backs off from one step again
  if (!c.agreed) {
    MAGI_INFO(Rewrite,
              "comm %012llx round %u: not every rank can serve the plan (%s); "
              "everything stays on NCCL",
              short_id(info_.identity), round.number,
              std::string(trace::reason_name(c.reason)).c_str());
    committing_ = false;
    trial_.stop();
    serving_.drop();
    sources_.clear();
    policy_.retry_soon();
    return;
  }
  // Opening the peers' memory (a mapping per peer window and exported allocation) runs off the
  // program's calls when it would take long (set_up.h): the confirm says whether it is done, and
  // is asked again at each step until every rank is. Each rank chooses for itself: the confirm
  // says the same either way.
  const bool slow = options_.inject_fault.where == Options::Fault::Where::SlowAttach &&
                    options_.inject_fault.rank == info_.rank;
  const std::chrono::milliseconds delay(slow ? kSlowSetUpMs : 0);
  // An export by descriptor is fetched from its owner's channel, which may wait for the owner's
  // own attach (ce_transport/fd_channel.h): never at a program call.
  size_t mappings = 0;
  bool by_descriptor = false;
  for (size_t r = 0; r < c.handles.size(); ++r) {
    if (static_cast<int>(r) == info_.rank) continue;
    mappings += 1 + (r < c.tables.size() ? c.tables[r].exports.size() : 0);
    if (r < c.tables.size())
      for (const ce::ExportRecord& e : c.tables[r].exports)
        by_descriptor |= e.kind == ce::ExportRecord::Kind::ByDescriptor;
  }
  const uint64_t expected_ns = mappings * world_.make.mapping_ns +
                               static_cast<uint64_t>(std::chrono::nanoseconds(delay).count());
  set_up_failed_.clear();
  set_up_unsaid_ = true;
  try {
    set_up_in_background_ = by_descriptor || expected_ns > kSetUpAtTheCallNs;
    if (set_up_in_background_)
      serving_.begin_attach(c.handles, c.tables, delay);
    else
      serving_.attach_now(c.handles, c.tables);
  } catch (const Error& e) {
    set_up_failed_ = e.what();
  }
  confirm(round.decision_hash, seq);
}

void CommAgreement::confirm(uint64_t decision_hash, uint64_t seq) {
  Contribution confirm = header_for(RoundKind::Confirm);
  confirm.header.decision_hash = decision_hash;
  if (sources_.changed()) {
    // A shard moved since the publish copied or exported it: what the peers would read may be
    // another tensor's. Every rank reads this refusal at the same call.
    MAGI_INFO(Transport,
              "comm %012llx round %u: static weights: a gather's send buffer changed while the "
              "plan was committed; this rank does not confirm it",
              short_id(info_.identity), decision_round_);
    confirm.header.reason = static_cast<uint8_t>(Reason::BindingChanged);
    issue(RoundKind::Confirm, confirm, seq);
    return;
  }
  std::string error = set_up_failed_;
  const Serving::SetUp set_up =
      error.empty() ? serving_.poll_set_up(error) : Serving::SetUp::Failed;
  switch (set_up) {
    case Serving::SetUp::Running: confirm.header.flags |= kCanServe | kSettingUp; break;
    case Serving::SetUp::Done: {
      confirm.header.flags |= kCanServe;
      if (!set_up_unsaid_) break;  // said at an earlier confirm
      const ce::WindowMemory m = serving_.memory();
      const double set_up_ms = static_cast<double>(serving_.set_up_ns()) / 1e6;
      const char* where = set_up_in_background_ ? "off the program's calls" : "at the call";
      if (m.peer_mappings != 0)
        MAGI_INFO(Transport,
                  "comm %012llx: static weights: mapped %zu allocations of the peers (set-up "
                  "%.1f ms, %s)",
                  short_id(info_.identity), m.peer_mappings, set_up_ms, where);
      else if (set_up_in_background_)
        MAGI_INFO(Transport, "comm %012llx: opened the peers' windows (set-up %.1f ms, %s)",
                  short_id(info_.identity), set_up_ms, where);
      set_up_unsaid_ = false;
      RoundStamp stamp;
      stamp.comm_id = info_.identity;
      stamp.rank = info_.rank;
      stamp.round = decision_round_;
      record_window(world_.trace, stamp, seq, decision_.mode, m);
      break;
    }
    case Serving::SetUp::Failed:
      MAGI_WARN(Transport,
                "comm %012llx: cannot open the peers' windows: %s; everything stays on "
                "NCCL",
                short_id(info_.identity), error.empty() ? "no window" : error.c_str());
      confirm.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
      set_up_failed_ = error.empty() ? "no window" : error;
      break;
  }
  issue(RoundKind::Confirm, confirm, seq);
}

void CommAgreement::read_confirm(std::span<const uint8_t> all, const Round& round, uint64_t seq) {
  const CommitOutcome c = decide_commit(all, info_.nranks, RoundKind::Confirm, round.decision_hash);
  record(RoundKind::Confirm, trace::RoundEvent::Read, seq, decision_.mode, c.reason,
         c.agreed ? decision_.moved : 0);
  if (c.pending) {
    wait_for_set_up(RoundKind::Confirm, round.decision_hash, seq);
    return;
  }
  wait_ = SetUpWait{};
  committing_ = false;
  if (c.agreed) {
    activate(seq);
  } else {
    trial_.stop();
    MAGI_INFO(Rewrite,
              "comm %012llx round %u: the commit was not confirmed by every rank (%s); "
              "everything stays on NCCL",
              short_id(info_.identity), round.number,
              std::string(trace::reason_name(c.reason)).c_str());
    serving_.drop();
    sources_.clear();
  }
  schedule_after(!c.agreed || decision_.retry_soon);
}

// Some rank is still setting up: every rank read the same, so every rank issues the round again at
// the same later step, and the gathers stay on NCCL meanwhile (the trial's NCCL side still
// timed). One step later, then 2, 4, ... 64: a set-up of seconds costs a few rounds, not one per
// step.
void CommAgreement::wait_for_set_up(RoundKind kind, uint64_t decision_hash, uint64_t seq) {
  const uint32_t gap = 1u << std::min<uint32_t>(wait_.reads++, 6);
  wait_.kind = kind;
  wait_.decision_hash = decision_hash;
  if (gap == 1) {
    if (kind == RoundKind::Publish)
      publish_again(decision_hash, seq);
    else
      confirm(decision_hash, seq);
    return;
  }
  wait_.waiting = true;
  wait_.due_step = policy_.steps() + gap - 1;
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
  // Where a publish follows, its read or its confirm's sets when the next propose comes.
  const bool stands = active_ && d.hash == active_hash_ && d.dry_run == active_dry_;
  if (!d.moves_anything() || d.dry_run || stands) schedule_after(d.retry_soon);
  if (d.reason == Reason::AnchorInGroup && seen_.period() > 1) policy_.move_anchor(seen_.period());
  if (d.reason == Reason::PeerOffNode || d.reason == Reason::PeerNotAccessible) {
    // Where the ranks run never changes for a communicator: no round will ever move anything.
    policy_.stop(d.reason);
    MAGI_INFO(Rewrite, "comm %012llx round %u: %s: no more agreement rounds on this communicator",
              short_id(info_.identity), decision_round_,
              std::string(trace::reason_name(d.reason)).c_str());
  }
  if (!d.moves_anything()) {
    if (active_) deactivate(seq, d.reason != Reason::None ? d.reason : Reason::OtherRankRefused);
    serving_.drop();
    return;
  }

  if (stands) return;
  if (active_) deactivate(seq, Reason::None);
  layout_ = lay_out_slots(seen_, d.gathers, d.bound);
  if (d.transient_rank >= 0)
    MAGI_INFO(Rewrite,
              "comm %012llx round %u: static weights: gather at position %lld is transient on "
              "rank %d (%s): the plan stages instead of binding",
              short_id(info_.identity), decision_round_,
              static_cast<long long>(d.transient_position), d.transient_rank,
              d.transient_flags & kEntryBufferReused ? "buffer reused" : "in place");
  const size_t buckets = plan_buckets();
  if (d.dry_run) {
    trial_.begin(false, buckets);
    active_dry_ = true;
    activate(seq);
    return;
  }
  // Timed unless forced, or unless every moving bucket's size already has a verdict.
  bool timed = !options_.ce_force;
  for (uint16_t b = 0; timed && b < buckets; ++b)
    timed = policy_.size_verdict(bucket_bytes_of(d, b)) != ExplorationPolicy::SizeVerdict::Moves;
  if (!timed && !options_.ce_force)
    MAGI_INFO(Rewrite,
              "comm %012llx round %u: every moving bucket is as large as one the copy engine "
              "already won: not timed again",
              short_id(info_.identity), decision_round_);
  trial_.begin(timed, buckets);
  committing_ = timed;
  publish(seq);
}

// The shards a static plan binds (each exported, or copied): none in the default mode.
size_t CommAgreement::bound_shards() const {
  size_t shards = 0;
  if (decision_.bound)
    for (const GatherDecision& g : decision_.gathers) shards += g.moves ? 1 : 0;
  return shards;
}

// Sized by the agreed plan (its bound shards), not by this rank's table: the same on every rank,
// even one whose window fails.
size_t CommAgreement::publish_bytes() const { return publish_round_bytes(bound_shards()); }

void CommAgreement::publish(uint64_t seq) {
  Contribution c = header_for(RoundKind::Publish);
  c.header.decision_hash = decision_.hash;
  // The owner's side of the set-up (finding and exporting each allocation that holds a shard,
  // the window) runs off the program's calls when it would take long, as the attach does: the
  // publish then says "still setting up" and is issued again until every rank's is ready. Each
  // rank chooses for itself: the publish reads the same either way.
  const bool slow = options_.inject_fault.where == Options::Fault::Where::SlowPrepare &&
                    options_.inject_fault.rank == info_.rank;
  const std::chrono::milliseconds delay(slow ? kSlowSetUpMs : 0);
  const uint64_t expected_ns = bound_shards() * world_.make.export_ns +
                               static_cast<uint64_t>(std::chrono::nanoseconds(delay).count());
  wait_ = SetUpWait{};
  prepare_in_background_ = expected_ns > kSetUpAtTheCallNs;
  prepare_unsaid_ = true;
  try {
    const ce::WindowPlan plan = window_plan(decision_, seen_, layout_, options_);
    sources_.reset(decision_, seen_, layout_);
    other_source_calls_ = 0;
    if (prepare_in_background_) {
      serving_.begin_prepare(plan, delay);
      c.header.flags |= kCanServe | kSettingUp;
    } else {
      serving_.open_window(plan, c.header.handle);
      fill_publish(c);
    }
  } catch (const Error& e) {
    MAGI_WARN(Transport, "comm %012llx: cannot prepare a window: %s; everything stays on NCCL",
              short_id(info_.identity), e.what());
    c.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
    serving_.drop();
  }
  issue(RoundKind::Publish, c, seq, publish_bytes());
}

void CommAgreement::publish_again(uint64_t decision_hash, uint64_t seq) {
  Contribution c = header_for(RoundKind::Publish);
  c.header.decision_hash = decision_hash;
  std::string error;
  switch (serving_.poll_set_up(error)) {
    case Serving::SetUp::Running: c.header.flags |= kCanServe | kSettingUp; break;
    case Serving::SetUp::Done:
      c.header.handle = serving_.handle();
      fill_publish(c);
      break;
    case Serving::SetUp::Failed:
      if (prepare_unsaid_)
        MAGI_WARN(Transport, "comm %012llx: cannot prepare a window: %s; everything stays on NCCL",
                  short_id(info_.identity), error.empty() ? "no window" : error.c_str());
      prepare_unsaid_ = false;
      c.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
      serving_.drop();
      break;
  }
  issue(RoundKind::Publish, c, seq, publish_bytes());
}

void CommAgreement::fill_publish(Contribution& c) {
  c.header.flags |= kCanServe;
  const size_t window = serving_.window_bytes();
  if (!decision_.bound) {  // the default mode's staging window
    if (prepare_unsaid_)
      MAGI_INFO(Transport,
                "comm %012llx: window of %zu bytes (two staging slots of %zu) for %u gathers",
                short_id(info_.identity), window, layout_.slot_bytes, decision_.moved);
    prepare_unsaid_ = false;
    return;
  }
  const ce::SourceTable& table = serving_.sources();  // zero-copy: what the peers need to read
  c.table.resize(table.bytes() + 8);
  table.serialize(c.table);
  c.header.table_bytes = static_cast<uint32_t>(c.table.size());
  if (!prepare_unsaid_) return;  // said at an earlier publish of this plan
  const ce::WindowMemory m = serving_.memory();
  char where[64] = "";
  if (prepare_in_background_)
    std::snprintf(where, sizeof(where), "; prepared in %.1f ms off the program's calls",
                  static_cast<double>(serving_.set_up_ns()) / 1e6);
  MAGI_INFO(Transport,
            "comm %012llx: static weights: %u gathers: %zu shards exported in place (%zu bytes in "
            "%zu allocations, 0 copied), %zu bound (%zu bytes copied); window %zu bytes (%.1f "
            "MiB)%s",
            short_id(info_.identity), decision_.moved, m.exported_shards, m.exported_bytes,
            m.exported_allocations, m.bound_shards, m.bound_bytes, window,
            static_cast<double>(window) / (1 << 20), where);
  // One line per reason (the trace's windows table says the same), each with its count.
  for (const ce::WindowMemory::Refusal& r : m.refusals)
    MAGI_INFO(Transport,
              "comm %012llx: static weights: %zu shards (%zu bytes; the first: gather %lld of the "
              "plan) cannot be read in place (%s); bound instead",
              short_id(info_.identity), r.shards, r.bytes, static_cast<long long>(r.first),
              r.why.c_str());
  prepare_unsaid_ = false;
}

void CommAgreement::activate(uint64_t seq) {
  active_ = true;
  ++active_plan_;
  active_digest_ = step_digest_;
  active_hash_ = decision_.hash;
  active_bound_ = decision_.bound;
  active_graph_slots_ = decision_.graph_slots && !decision_.bound;
  trial_.start(policy_.steps(), static_cast<uint64_t>(options_.warmup_steps));
  record(active_dry_ ? RoundKind::Propose : RoundKind::Confirm, trace::RoundEvent::Activated, seq,
         decision_.mode, Reason::None, decision_.moved);
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: %s %u of %zu gathers per step from collective #%llu "
            "(%s%s)",
            short_id(info_.identity), decision_round_, active_dry_ ? "would move" : "moving",
            decision_.moved, decision_.gathers.size(), static_cast<unsigned long long>(seq),
            std::string(trace::mode_name(decision_.mode)).c_str(),
            active_graph_slots_ ? "; graph slots" : "");
}

void CommAgreement::issue_cost(uint64_t seq) {
  trial_.finish();  // from here every agreed bucket moves again, until the cost round is read
  Contribution c = header_for(RoundKind::Cost);
  c.header.decision_hash = decision_.hash;
  c.costs = trial_.medians();
  c.header.gathers = static_cast<uint32_t>(c.costs.size());
  issue(RoundKind::Cost, c, seq);
}

void CommAgreement::after_cost(std::span<const uint8_t> all, uint64_t seq) {
  const std::vector<CostVerdict> costs = decide_cost(all, info_.nranks, trial_.buckets());
  log_costs(info_.identity, decision_round_, costs);
  for (uint16_t b = 0; b < costs.size(); ++b)
    if (costs[b].measured) policy_.learn_size(bucket_bytes_of(decision_, b), costs[b].keep);
  policy_.count_timed_calls(trial_.launches_timed());
  policy_.count_slower_calls(trial_.launches_slower(costs));
  const uint32_t moved = keep_faster(costs, decision_, layout_);
  const bool changed = moved != decision_.moved;
  decision_.moved = moved;
  record(RoundKind::Cost, trace::RoundEvent::Read, seq, decision_.mode,
         changed ? Reason::NcclFaster : Reason::None, moved);
  if (!changed) {
    MAGI_INFO(Rewrite,
              "comm %012llx round %u: timed both ways, every moved bucket was as fast or "
              "faster off NCCL: %u gathers keep moving",
              short_id(info_.identity), decision_round_, moved);
    return;
  }
  record_decision(world_.trace, info_, seen_, decision_, decision_round_);
  if (moved == 0) {
    policy_.nccl_won_plan(active_hash_);
    deactivate(seq, Reason::NcclFaster);
    serving_.drop();
    return;
  }
  record(RoundKind::Cost, trace::RoundEvent::Activated, seq, decision_.mode, Reason::NcclFaster,
         moved);
  MAGI_INFO(Rewrite,
            "comm %012llx round %u: timed both ways: %u of %zu gathers keep moving, the "
            "rest were faster on NCCL",
            short_id(info_.identity), decision_round_, moved, decision_.gathers.size());
}

void CommAgreement::deactivate(uint64_t seq, Reason why) {
  if (!active_) return;
  active_ = false;
  active_dry_ = false;
  active_bound_ = false;
  active_graph_slots_ = false;
  active_hash_ = 0;
  trial_.stop();
  if (other_source_calls_ != 0)
    MAGI_INFO(Transport,
              "comm %012llx: static weights: %llu moved calls read another position's binding "
              "(their send buffer's) during this plan",
              short_id(info_.identity), static_cast<unsigned long long>(other_source_calls_));
  other_source_calls_ = 0;
  sources_.clear();
  record(RoundKind::Propose, trace::RoundEvent::Deactivated, seq, decision_.mode, why, 0);
  MAGI_INFO(Rewrite, "comm %012llx: gathers back on NCCL from collective #%llu (%s)",
            short_id(info_.identity), static_cast<unsigned long long>(seq),
            why == Reason::None ? "a new plan replaces this one"
                                : std::string(trace::reason_name(why)).c_str());
}

void CommAgreement::record(RoundKind kind, trace::RoundEvent event, uint64_t seq,
                           AgreementMode mode, Reason reason, uint32_t moved) const {
  RoundStamp stamp;
  stamp.comm_id = info_.identity;
  stamp.rank = info_.rank;
  stamp.step_digest = step_digest_;
  stamp.round = event == trace::RoundEvent::Issued || event == trace::RoundEvent::Abandoned
                    ? policy_.rounds()
                    : decision_round_;
  stamp.period = seen_.period();
  stamp.gathers = static_cast<uint32_t>(decision_.gathers.size());
  record_round(world_.trace, stamp, kind, event, seq, mode, reason, moved);
}

}  // namespace magi::rewrite
