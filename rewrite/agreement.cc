#include "rewrite/agreement.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>

namespace magi::rewrite {
namespace {

constexpr uint64_t kNever = UINT64_MAX;

ce::Backend backend_of(const Options& options) {
  return options.backend == Options::Backend::Host ? ce::Backend::Host : ce::Backend::Cuda;
}


// Why a communicator can never take part in agreement; Reason::None if it can.
Reason unagreeable(const capture::CommInfo& info, const Options& options) {
  if (options.transport == Options::Transport::Nccl) return Reason::CommNotAgreeable;
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

CommAgreement::CommAgreement(ncclComm_t comm, const capture::CommInfo& info,
                             const RealNcclCalls& nccl)
    : comm_(comm), info_(info), nccl_(nccl), options_(Options::get()),
      backend_(backend_of(options_)) {
  agreeable_ = unagreeable(info_, options_) == Reason::None && nccl_.all_gather != nullptr;
  if (!agreeable_) {
    MAGI_INFO(Rewrite, "comm %012llx: no agreement on this communicator (%s)", short_id(info_.identity),
              options_.transport == Options::Transport::Nccl ? "MAGI_TRANSPORT=nccl"
              : info_.nonblocking                            ? "non-blocking communicator"
                                                             : "ncclCommInitAll or unknown");
  } else if (!ce::backend_available(backend_)) {
    // Every rank of a job runs with the same environment and the same kind of program, so they
    // all end up here alike.
    agreeable_ = false;
    MAGI_INFO(Rewrite, "comm %012llx: no agreement: MAGI_BACKEND=cuda and the program has not loaded "
              "the CUDA driver (MAGI_BACKEND=host serves host buffers)", short_id(info_.identity));
  }
}

CommAgreement::~CommAgreement() {
  drop_transport();
  // A round still in flight belongs to NCCL until it completes; a finished one is freed here.
  // One that never launched (a group left open at destroy) is left, not waited for.
  if (pending_) retire(std::move(pending_->exchange));
  for (auto& exchange : retired_) {
    if (exchange && !exchange->ready()) {
      MAGI_WARN(Rewrite, "comm %012llx: an agreement round was still in flight at destroy; its "
                "buffers are left allocated", short_id(info_.identity));
      exchange.release();
    }
  }
}

Route CommAgreement::on_collective(const capture::CallArgs& args, capture::CallRecord& record,
                                   const capture::StepView& view) {
  if (!agreeable_ || !view.collective) return {};
  if (view.event == capture::StepDetector::Event::Lost) on_lost(view.collective_index);
  if (!view.found) return {};
  if (view.event == capture::StepDetector::Event::Found || view.digest != step_digest_) {
    if (active_) deactivate(view.collective_index, Reason::Deviated);
    if (pending_) {
      record_round(pending_->kind, trace::RoundEvent::Abandoned, view.collective_index,
                   AgreementMode::None, Reason::Deviated, 0);
      retire(std::move(pending_->exchange));
      pending_.reset();
    }
    seen_.reset(view.period);
    stale_positions_.clear();
    step_digest_ = view.digest;
    steps_ = 0;
    anchor_ = 0;
    next_propose_ = static_cast<uint64_t>(options_.warmup_steps) + 1;
  }
  // A call captured into a CUDA graph stays on NCCL: a replayed graph would repeat the
  // handshake's sequence numbers of the capture. Nor does a round happen at a captured anchor:
  // a capture forbids the waits and allocations a round may need, and the round's all-gather
  // must run now, not at each replay. Capture is the one input here that is not a shape:
  // programs capture the same calls on every rank (one graph, replayed by all).
  const bool capturing = (record.flags & trace::kCallCapturing) != 0;
  if (view.position == 0) seen_.begin_step();
  if (view.position == anchor_) {
    ++steps_;
    if (!capturing) at_anchor(view);
  }
  seen_.observe(view.position, args, record, backend_);

  if (active_ && !capturing && view.digest == active_digest_ && args.op == trace::Op::AllGather &&
      view.position < layout_.offset_by_position.size()) {
    const size_t offset = layout_.offset_by_position[view.position];
    if (offset != SIZE_MAX) {
      Route::Kind kind = active_dry_ ? Route::Kind::WouldMove : Route::Kind::Move;
      if (trial_ && (steps_ - trial_start_) % 2 == 0) kind = Route::Kind::TrialNccl;
      return {kind, offset, layout_.bucket_by_position[view.position]};
    }
  }
  return {};
}

ncclResult_t CommAgreement::serve(std::span<const ce::GatherOp> bucket,
                                  std::span<const NcclGather> calls, cudaStream_t stream,
                                  uint16_t bucket_id, bool via_nccl) {
  if (!transport_) return ncclInternalError;  // routes say Move only with a transport
  std::unique_ptr<ce::CompletionTimer> timer;
  if (trial_) {
    try {
      timer = ce::make_timer(backend_);
      timer->start(stream);
    } catch (const Error&) {
      timer.reset();  // unmeasured: the cost round then keeps the bucket moving
    }
  }
  struct Stop {
    CommAgreement& self;
    std::unique_ptr<ce::CompletionTimer>& timer;
    cudaStream_t stream;
    uint16_t bucket;
    bool via_nccl;
    ~Stop() {
      if (!timer) return;
      timer->stop(stream);
      self.timings_.push_back({bucket, via_nccl, std::move(timer)});
    }
  } stop{*this, timer, stream, bucket_id, via_nccl};
  if (via_nccl) return forward_to_nccl(calls, stream);
  try {
    const auto timing = timer ? ce::Transport::Timing::Timed : ce::Transport::Timing::Untimed;
    if (transport_->gather(bucket, stream, timing) == ce::Transport::Served::FallBack) {
      // Every rank learned of the failure in this bucket: all of them hand it to NCCL now, and
      // refuse its gathers at the next round.
      if (!transport_failed_)
        MAGI_WARN(Transport, "comm %012llx: the transport failed on some rank; its gathers go to NCCL "
                  "until the next agreement round takes them back", short_id(info_.identity));
      transport_failed_ = true;
      return forward_to_nccl(calls, stream);
    }
    for (const size_t offset : transport_->take_stale_bindings()) {
      for (uint32_t p = 0; p < layout_.offset_by_position.size(); ++p) {
        if (layout_.offset_by_position[p] != offset) continue;
        MAGI_WARN(Transport, "comm %012llx: MAGI_STATIC_WEIGHTS=1, but the shard of the gather at "
                  "position %u changed after it was bound; peers may have read stale bytes. It goes "
                  "back to NCCL at the next agreement round", short_id(info_.identity), p);
        stale_positions_.push_back(p);
      }
    }
    return ncclSuccess;
  } catch (const Error& e) {
    if (!transport_failed_)
      MAGI_WARN(Transport, "comm %012llx: a moved gather failed: %s; the communicator goes back to "
                "NCCL at its next agreement round", short_id(info_.identity), e.what());
    transport_failed_ = true;
    return e.result();
  }
}

ncclResult_t CommAgreement::forward_to_nccl(std::span<const NcclGather> calls, cudaStream_t stream) {
  const bool grouped = calls.size() > 1;
  if (grouped) nccl_.group_start();
  ncclResult_t result = ncclSuccess;
  for (const NcclGather& g : calls) {
    const ncclResult_t r = nccl_.all_gather(g.sendbuf, g.recvbuf, g.count, g.dtype, comm_, stream);
    if (result == ncclSuccess) result = r;
  }
  if (grouped) {
    const ncclResult_t r = nccl_.group_end();
    if (result == ncclSuccess) result = r;
  }
  return result;
}

void CommAgreement::on_lost(uint64_t seq) {
  if (active_) deactivate(seq, Reason::Deviated);
  if (pending_) {
    record_round(pending_->kind, trace::RoundEvent::Abandoned, seq, AgreementMode::None,
                 Reason::Deviated, 0);
    retire(std::move(pending_->exchange));
    pending_.reset();
  }
  // The window stays until the next plan replaces it or the communicator ends: gathers routed
  // before this call inside the still-open group are served when the group ends.
  step_digest_ = 0;
}

void CommAgreement::at_anchor(const capture::StepView& view) {
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (!(*it)->ready()) {
      ++it;
      continue;
    }
    if (!spare_) spare_ = std::move(*it);
    it = retired_.erase(it);
  }
  collect_timings();
  if (pending_) {
    read_round(view);
  } else if (trial_ && active_ && steps_ >= trial_end_) {
    issue_cost(view.collective_index);
  } else if (steps_ >= next_propose_ &&
             seen_.complete_steps() >= static_cast<uint64_t>(options_.warmup_steps)) {
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
  return c;
}

void CommAgreement::propose(uint64_t seq) {
  ++rounds_;
  Contribution c = header_for(RoundKind::Propose);
  c.entries = seen_.entries(options_, backend_, stale_positions_);
  if (transport_failed_) {
    for (GatherEntry& e : c.entries) e.reason = static_cast<uint8_t>(Reason::TransportFailed);
  }
  ContributionHeader& h = c.header;
  h.gathers = static_cast<uint32_t>(c.entries.size());
  h.callsite_digest = seen_.callsite_digest();
  h.group_digest = seen_.group_digest();
  if (!seen_.groups_stable()) h.flags |= kGroupsUnstable;
  const ce::Locality here = ce::local_locality(backend_, info_.cuda_device);
  h.host = here.host;
  h.device = here.device;
  h.peer_access_mask = here.peer_access_mask;
  issue(RoundKind::Propose, c, seq);
}

void CommAgreement::issue(RoundKind kind, Contribution& c, uint64_t seq) {
  const bool in_group = capture::group_depth() > 0;
  if (in_group) {
    c.header.flags |= kIssuedInGroup;
    c.header.flags &= ~kCanServe;
  }
  c.header.round = rounds_;
  auto round = std::make_unique<Round>();
  round->kind = kind;
  round->number = rounds_;
  round->voted_no = in_group;
  round->decision_hash = c.header.decision_hash;
  try {
    // Round buffers are reused: making them (and freeing them, which waits for the whole
    // device) at every round would stall the program's streams each time.
    round->exchange = spare_ ? std::move(spare_)
                             : ce::make_exchange(backend_, kContributionBytes, info_.nranks, info_.cuda_device);
    std::vector<uint8_t> bytes(kContributionBytes);
    c.serialize(bytes);
    round->exchange->stage(bytes);
  } catch (const Error& e) {
    // Rare and serious (no memory for a few kilobytes): without a round of our own the peers'
    // round would meet the program's next call, so say so loudly.
    MAGI_WARN(Rewrite, "comm %012llx: cannot prepare an agreement round (%s); peers may wait for it",
              short_id(info_.identity), e.what());
    agreeable_ = false;
    return;
  }
  // NCCL runs the collectives of one group largest first. A round issued inside the program's
  // open group would run after the group's larger collectives on this rank, and before them on
  // a rank that issued the same collectives ungrouped: the ranks would meet different
  // collectives and hang. So the group so far is launched first, the round goes alone, and the
  // group is opened again to the same depth: on every rank the round then runs between the same
  // collectives. Not with a Send or Recv in the group, whose halves must launch together.
  const int depth = capture::group_depth();
  const bool flush = depth > 0 && !capture::group_holds_point_to_point();
  if (depth > 0 && !flush && !told_point_to_point_group_) {
    // The round then sits inside the program's group. Safe where every rank groups these calls
    // alike (NCCL orders identical groups identically); a rank that does not could meet another
    // collective there. Said once, so that such a hang can be traced to this.
    told_point_to_point_group_ = true;
    MAGI_WARN(Rewrite, "comm %012llx: an agreement round was issued inside a group holding Send/Recv, "
              "which cannot be launched in two parts; if other ranks do not group these calls alike, "
              "NCCL may order the round differently there (MAGI_TRANSPORT=nccl turns rounds off)",
              short_id(info_.identity));
  }
  if (flush) {
    EarlyLaunches& early = early_launches();
    early.calls = capture::group_calls() - 1;  // all but the anchor's call, which goes after the round
    for (int i = 0; i < depth; ++i) {
      // A failure, or ncclInProgress from a non-blocking communicator in the group, is the
      // program's: it gets it from its own ncclGroupEnd.
      const ncclResult_t ended = nccl_.group_end();
      if (ended != ncclSuccess && early.error == ncclSuccess) early.error = ended;
    }
  }
  const ncclResult_t result = nccl_.all_gather(
      round->exchange->send_buffer(), round->exchange->recv_buffer(), kContributionBytes,
      ncclUint8, comm_, static_cast<cudaStream_t>(round->exchange->stream()));
  if (flush)
    for (int i = 0; i < depth; ++i) nccl_.group_start();
  if (result != ncclSuccess && result != ncclInProgress) {
    MAGI_WARN(Rewrite, "comm %012llx: NCCL refused an agreement round (%d); no agreement on this "
              "communicator from now on", short_id(info_.identity), static_cast<int>(result));
    agreeable_ = false;
    return;
  }
  round->exchange->issued();
  pending_ = std::move(round);
  record_round(kind, trace::RoundEvent::Issued, seq, AgreementMode::None, Reason::None, 0);
}

void CommAgreement::read_round(const capture::StepView& view) {
  std::unique_ptr<Round> round = std::move(pending_);
  const uint64_t seq = view.collective_index;
  const int n = info_.nranks;
  if (round->voted_no) {
    // This rank said no, so the answer is no whatever the others said: no need to wait for a
    // round that may not have launched yet.
    retire(std::move(round->exchange));
    if (round->kind == RoundKind::Propose) {
      Decision d;
      d.reason = Reason::AnchorInGroup;
      for (const GatherEntry& e : seen_.entries(options_, backend_))
        d.gathers.push_back({e.position, e.bucket, false, Reason::AnchorInGroup, -1});
      decision_ = d;
      decision_round_ = round->number;
      record_round(RoundKind::Propose, trace::RoundEvent::Read, seq, d.mode, d.reason, 0);
      record_decision(d);
      after_propose(d, seq);
    } else if (round->kind == RoundKind::Cost) {
      // Unread, so unmeasured for every rank alike: the agreed plan stands as it is.
      record_round(RoundKind::Cost, trace::RoundEvent::Read, seq, decision_.mode, Reason::AnchorInGroup,
                   decision_.moved);
    } else {
      record_round(round->kind, trace::RoundEvent::Read, seq, AgreementMode::None,
                   Reason::AnchorInGroup, 0);
      drop_transport();
      next_propose_ = options_.reagree_steps > 0 ? steps_ + options_.reagree_steps : kNever;
    }
    return;
  }

  const std::span<const uint8_t> all = round->exchange->result();
  struct KeepSpare {  // once the result has been used, whatever path the round takes
    std::unique_ptr<ce::Exchange>& spare;
    std::unique_ptr<ce::Exchange>& used;
    ~KeepSpare() {
      if (!spare) spare = std::move(used);
    }
  } keep{spare_, round->exchange};
  switch (round->kind) {
    case RoundKind::Propose: {
      Decision d = decide(all, n, info_.rank);
      if (d.moves_anything() && d.hash == nccl_faster_hash_) {
        // This very plan was timed and NCCL won every bucket: trying it again would only
        // disturb the program every MAGI_REAGREE_STEPS. Every rank read the same cost round,
        // so every rank skips it alike; a plan that differs in any way is tried afresh.
        for (GatherDecision& g : d.gathers) {
          if (!g.moves) continue;
          g.moves = false;
          g.reason = Reason::NcclFaster;
        }
        d.moved = 0;
        d.hash = 0;
      }
      decision_ = d;
      decision_round_ = round->number;
      record_round(RoundKind::Propose, trace::RoundEvent::Read, seq, d.mode, d.reason, d.moved);
      record_decision(d);
      after_propose(d, seq);
      break;
    }
    case RoundKind::Publish: {
      const CommitOutcome c = decide_commit(all, n, RoundKind::Publish, round->decision_hash);
      record_round(RoundKind::Publish, trace::RoundEvent::Read, seq, decision_.mode, c.reason,
                   c.agreed ? decision_.moved : 0);
      if (!c.agreed) {
        MAGI_INFO(Rewrite, "comm %012llx round %u: not every rank can serve the plan (%s); "
                  "everything stays on NCCL", short_id(info_.identity), round->number,
                  std::string(trace::reason_name(c.reason)).c_str());
        drop_transport();
        next_propose_ = options_.reagree_steps > 0 ? steps_ + options_.reagree_steps : kNever;
        break;
      }
      Contribution confirm = header_for(RoundKind::Confirm);
      confirm.header.decision_hash = round->decision_hash;
      try {
        transport_->attach(c.handles);
        confirm.header.flags |= kCanServe;
      } catch (const Error& e) {
        MAGI_WARN(Transport, "comm %012llx: cannot open the peers' windows: %s; everything stays on NCCL",
                  short_id(info_.identity), e.what());
        confirm.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
      }
      issue(RoundKind::Confirm, confirm, seq);
      break;
    }
    case RoundKind::Cost:
      after_cost(all, seq);
      break;
    case RoundKind::Confirm: {
      const CommitOutcome c = decide_commit(all, n, RoundKind::Confirm, round->decision_hash);
      record_round(RoundKind::Confirm, trace::RoundEvent::Read, seq, decision_.mode, c.reason,
                   c.agreed ? decision_.moved : 0);
      if (c.agreed) {
        activate(seq);
      } else {
        MAGI_INFO(Rewrite, "comm %012llx round %u: the commit was not confirmed by every rank (%s); "
                  "everything stays on NCCL", short_id(info_.identity), round->number,
                  std::string(trace::reason_name(c.reason)).c_str());
        drop_transport();
      }
      next_propose_ = options_.reagree_steps > 0 ? steps_ + options_.reagree_steps : kNever;
      break;
    }
  }
}

void CommAgreement::after_propose(const Decision& d, uint64_t seq) {
  decision_ = d;
  next_propose_ = options_.reagree_steps > 0 ? steps_ + options_.reagree_steps : kNever;
  if (d.reason == Reason::AnchorInGroup && seen_.period() > 1) {
    // Every rank reached this same decision: all move the anchor, and try again a step later.
    anchor_ = (anchor_ + 1) % seen_.period();
    next_propose_ = steps_ + 1;
  }
  if (!d.moves_anything()) {
    if (active_) deactivate(seq, d.reason != Reason::None ? d.reason : Reason::OtherRankRefused);
    drop_transport();
    return;
  }

  if (active_ && d.hash == active_hash_ && d.dry_run == active_dry_) return;  // the plan stands
  if (active_) deactivate(seq, Reason::None);
  layout_ = lay_out_slots(seen_, d.gathers, d.bound);
  if (d.dry_run) {
    active_dry_ = true;
    activate(seq);
    return;
  }
  publish(seq);
}

void CommAgreement::publish(uint64_t seq) {
  Contribution c = header_for(RoundKind::Publish);
  c.header.decision_hash = decision_.hash;
  drop_transport();
  transport_failed_ = false;
  try {
    ce::WindowPlan plan;
    plan.slot_bytes = layout_.slot_bytes;
    plan.bound = decision_.bound;
    plan.verify_every = static_cast<uint64_t>(options_.verify_every);
    if (plan.bound) {
      // The send buffers of the last step: stable (same address and allocation) for the whole
      // warmup, which is what made them candidates.
      for (const GatherDecision& g : decision_.gathers) {
        if (!g.moves) continue;
        const PositionSeen& p = seen_.at(g.position);
        plan.bind.push_back({reinterpret_cast<const void*>(p.sendbuf), p.count * datatype_bytes(p.dtype),
                             layout_.offset_by_position[g.position]});
      }
    }
    {
      std::lock_guard<std::mutex> lock(transport_mutex_);
      if (aborted_) throw Error(ErrorKind::Usage, "the communicator is being aborted");
      transport_ = ce::make_transport(backend_, info_.rank, info_.nranks, info_.identity, info_.cuda_device);
    }
    transport_->prepare(plan, c.header.handle);
    c.header.flags |= kCanServe;
    if (plan.bound)
      MAGI_INFO(Transport, "comm %012llx: static weights: %u gathers bound in a window of %zu bytes "
                "(%.1f MiB; MAGI_BIND_MAX_MIB=%s)", short_id(info_.identity), decision_.moved,
                transport_->window_bytes(), static_cast<double>(transport_->window_bytes()) / (1 << 20),
                options_.value_text("MAGI_BIND_MAX_MIB").c_str());
    else
      MAGI_INFO(Transport, "comm %012llx: window of %zu bytes (two staging slots of %zu) for %u gathers",
                short_id(info_.identity), transport_->window_bytes(), layout_.slot_bytes, decision_.moved);
  } catch (const Error& e) {
    MAGI_WARN(Transport, "comm %012llx: cannot prepare a window: %s; everything stays on NCCL",
              short_id(info_.identity), e.what());
    c.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
    drop_transport();
  }
  issue(RoundKind::Publish, c, seq);
}

void CommAgreement::activate(uint64_t seq) {
  active_ = true;
  active_digest_ = step_digest_;
  active_hash_ = decision_.hash;
  trial_ = !active_dry_ && !options_.ce_force;
  trial_start_ = steps_;
  trial_end_ = steps_ + 2 * static_cast<uint64_t>(options_.warmup_steps);
  timings_.clear();
  size_t buckets = 0;
  for (const GatherDecision& g : decision_.gathers)
    if (g.moves) buckets = std::max<size_t>(buckets, g.bucket + 1u);
  moved_ns_.assign(buckets, {});
  nccl_ns_.assign(buckets, {});
  record_round(active_dry_ ? RoundKind::Propose : RoundKind::Confirm, trace::RoundEvent::Activated,
               seq, decision_.mode, Reason::None, decision_.moved);
  MAGI_INFO(Rewrite, "comm %012llx round %u: %s %u of %zu gathers per step from collective #%llu (%s)",
            short_id(info_.identity), decision_round_, active_dry_ ? "would move" : "moving",
            decision_.moved, decision_.gathers.size(), static_cast<unsigned long long>(seq),
            std::string(trace::mode_name(decision_.mode)).c_str());
}

void CommAgreement::collect_timings() {
  for (Timing& t : timings_) {
    const uint64_t ns = t.timer->elapsed_ns();  // a step later: long complete
    if (ns == 0 || t.bucket >= moved_ns_.size()) continue;
    (t.via_nccl ? nccl_ns_ : moved_ns_)[t.bucket].push_back(ns);
  }
  timings_.clear();
}

void CommAgreement::issue_cost(uint64_t seq) {
  trial_ = false;  // from here every agreed bucket moves again, until the cost round is read
  collect_timings();
  Contribution c = header_for(RoundKind::Cost);
  c.header.decision_hash = decision_.hash;
  auto median = [](std::vector<uint64_t> v) -> uint64_t {
    if (v.empty()) return 0;
    std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
    return v[v.size() / 2];
  };
  for (size_t b = 0; b < moved_ns_.size(); ++b) c.costs.push_back({median(moved_ns_[b]), median(nccl_ns_[b])});
  c.header.gathers = static_cast<uint32_t>(c.costs.size());
  issue(RoundKind::Cost, c, seq);
}

void CommAgreement::after_cost(std::span<const uint8_t> all, uint64_t seq) {
  const std::vector<CostVerdict> costs = decide_cost(all, info_.nranks, moved_ns_.size());
  if (log_detail::enabled(1, Subsystem::Rewrite)) {
    // What the choice rested on, bucket by bucket (the first few): why a gather stays or moves.
    std::string text;
    constexpr size_t kShown = 6;
    for (size_t b = 0; b < costs.size() && b < kShown; ++b) {
      const CostVerdict& k = costs[b];
      char line[112];
      if (k.measured)
        std::snprintf(line, sizeof line, "%sbucket %zu: copy engine %.1f us, NCCL %.1f us -> %s",
                      b ? "; " : "", b, k.moved_ns / 1e3, k.nccl_ns / 1e3, k.keep ? "copy engine" : "NCCL");
      else
        std::snprintf(line, sizeof line, "%sbucket %zu: not measured on every rank -> copy engine", b ? "; " : "", b);
      text += line;
    }
    if (costs.size() > kShown) text += "; ...";
    MAGI_INFO(Rewrite, "comm %012llx round %u: cost on the slowest rank (median per call): %s",
              short_id(info_.identity), decision_round_, text.c_str());
  }
  uint32_t moved = 0;
  for (GatherDecision& g : decision_.gathers) {
    if (!g.moves) continue;
    if (g.bucket < costs.size() && !costs[g.bucket].keep) {
      g.moves = false;
      g.reason = Reason::NcclFaster;
      layout_.offset_by_position[g.position] = SIZE_MAX;
    } else {
      ++moved;
    }
  }
  const bool changed = moved != decision_.moved;
  decision_.moved = moved;
  record_round(RoundKind::Cost, trace::RoundEvent::Read, seq, decision_.mode,
               changed ? Reason::NcclFaster : Reason::None, moved);
  if (!changed) {
    MAGI_INFO(Rewrite, "comm %012llx round %u: timed both ways, every moved bucket was as fast or "
              "faster off NCCL: %u gathers keep moving", short_id(info_.identity), decision_round_, moved);
    return;
  }
  record_decision(decision_);
  if (moved == 0) {
    nccl_faster_hash_ = active_hash_;
    deactivate(seq, Reason::NcclFaster);
    drop_transport();
    return;
  }
  record_round(RoundKind::Cost, trace::RoundEvent::Activated, seq, decision_.mode, Reason::NcclFaster, moved);
  MAGI_INFO(Rewrite, "comm %012llx round %u: timed both ways: %u of %zu gathers keep moving, the rest "
            "were faster on NCCL", short_id(info_.identity), decision_round_, moved, decision_.gathers.size());
}

void CommAgreement::deactivate(uint64_t seq, Reason why) {
  if (!active_) return;
  active_ = false;
  active_dry_ = false;
  active_hash_ = 0;
  trial_ = false;
  timings_.clear();
  record_round(RoundKind::Propose, trace::RoundEvent::Deactivated, seq, decision_.mode, why, 0);
  MAGI_INFO(Rewrite, "comm %012llx: gathers back on NCCL from collective #%llu (%s)",
            short_id(info_.identity), static_cast<unsigned long long>(seq),
            why == Reason::None ? "a new plan replaces this one"
                                : std::string(trace::reason_name(why)).c_str());
}

void CommAgreement::drop_transport() {
  std::lock_guard<std::mutex> lock(transport_mutex_);
  if (!transport_) return;
  try {
    transport_->release();
  } catch (const Error& e) {
    MAGI_WARN(Transport, "comm %012llx: releasing the window: %s", short_id(info_.identity), e.what());
  }
  transport_.reset();
}

void CommAgreement::abandon() {
  std::lock_guard<std::mutex> lock(transport_mutex_);
  aborted_ = true;
  if (!transport_) return;
  try {
    transport_->abandon();
  } catch (const Error& e) {
    MAGI_WARN(Transport, "comm %012llx: abandoning the window: %s", short_id(info_.identity), e.what());
  }
}

void CommAgreement::retire(std::unique_ptr<ce::Exchange> exchange) {
  if (exchange) retired_.push_back(std::move(exchange));
}

void CommAgreement::record_round(RoundKind kind, trace::RoundEvent event, uint64_t seq,
                                 AgreementMode mode, Reason reason, uint32_t moved) const {
  trace::AgreementRecord r{};
  r.comm_id = info_.identity;
  r.seq = seq;
  r.step_digest = step_digest_;
  r.round = event == trace::RoundEvent::Issued || event == trace::RoundEvent::Abandoned
                ? rounds_ : decision_round_;
  r.period = seen_.period();
  r.gathers = static_cast<uint32_t>(decision_.gathers.size());
  r.moved = moved;
  r.rank = info_.rank;
  r.kind = static_cast<uint8_t>(kind);
  r.event = static_cast<uint8_t>(event);
  r.mode = static_cast<uint8_t>(mode);
  r.reason = static_cast<uint8_t>(reason);
  capture::trace_record(trace::RecordType::Agreement, &r, sizeof(r));
}

void CommAgreement::record_decision(const Decision& d) const {
  std::map<Reason, uint32_t> stays;
  for (const GatherDecision& g : d.gathers) {
    const PositionSeen& p = seen_.at(g.position);
    trace::DecisionRecord r{};
    r.comm_id = info_.identity;
    r.callsite = p.callsite;
    r.count = p.count;
    r.round = decision_round_;
    r.position = g.position;
    r.rank = info_.rank;
    r.refused_by = g.refused_by;
    r.bucket = g.bucket;
    r.dtype = p.dtype;
    r.verdict = static_cast<uint8_t>(!g.moves ? trace::Verdict::Stays
                                     : d.dry_run ? trace::Verdict::WouldMove
                                                 : trace::Verdict::Moved);
    r.reason = static_cast<uint8_t>(g.reason);
    r.mode = static_cast<uint8_t>(d.mode);
    capture::trace_record(trace::RecordType::Decision, &r, sizeof(r));
    if (!g.moves) ++stays[g.reason];
    MAGI_TRACE(Rewrite, "comm %012llx round %u gather at position %u: %s%s%s",
               short_id(info_.identity), decision_round_, g.position,
               std::string(trace::verdict_name(static_cast<trace::Verdict>(r.verdict))).c_str(),
               g.moves ? "" : ": ", g.moves ? "" : std::string(trace::reason_name(g.reason)).c_str());
  }
  std::string why;
  for (const auto& [reason, count] : stays)
    why += (why.empty() ? "" : "; ") + std::to_string(count) + " " + std::string(trace::reason_name(reason));
  MAGI_INFO(Rewrite, "comm %012llx round %u: mode %s, %u of %zu gathers %s%s%s",
            short_id(info_.identity), decision_round_, std::string(trace::mode_name(d.mode)).c_str(),
            d.moved, d.gathers.size(), d.dry_run ? "would move" : "move", why.empty() ? "" : "; stay: ",
            why.c_str());
}

}  // namespace magi::rewrite
