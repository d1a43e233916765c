// The call path of rewrite/: asks the communicator's agreement for the call's route (by the plan:
// route_by_plan, route.h), and serves moved gathers now or, inside a group, when the group ends
// (one bucket per communicator, like NCCL launching a group's work at ncclGroupEnd).
#include "rewrite/route.h"

#include <algorithm>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "rewrite/agreement.h"
#include "rewrite/observation.h"
#include "rewrite/rewrite.h"
#include "rewrite/set_up.h"

namespace magi::rewrite {
namespace {

RealNcclCalls g_nccl{};

using AgreementRef = std::shared_ptr<CommAgreement>;

// Moved gathers issued inside the calling thread's open group, in call order.
struct Queued {
  AgreementRef agreement;
  uint16_t bucket;
  bool via_nccl;
  cudaStream_t stream;
  uint32_t plan;
  uint64_t collective;  // the call's collective index
  ce::GatherOp op;
  NcclGather call;
  uint64_t seq;  // the call's record, already written: its outcome follows in a record of its own
  bool served = false;  // its bucket was served at the group's end
};
thread_local std::vector<Queued> t_queued;

// What a failure at the group's end left unserved. A trial call goes to NCCL as the program
// issued it (every rank sends that bucket to NCCL), in one NCCL group so that the calls of
// several communicators cannot meet in different orders. A moved call does not: its peers serve
// it through the transport, and one rank's NCCL all-gather would meet no peer there (the route
// would split); it fails instead, and its communicator leaves the transport at its next round.
ncclResult_t settle_unserved(std::span<Queued> queued) noexcept {
  ncclResult_t result = ncclSuccess;
  bool trial_calls = false;
  for (Queued& q : queued) {
    if (q.served) continue;
    if (q.via_nccl) {
      trial_calls = true;
      continue;
    }
    q.agreement->fail_transport("a moved gather could not be served at the end of its group");
    result = ncclInternalError;
  }
  if (!trial_calls) return result;
  const auto first = std::find_if(queued.begin(), queued.end(),
                                  [](const Queued& q) { return !q.served && q.via_nccl; });
  const RealNcclCalls& nccl = first->agreement->world().nccl;
  nccl.group_start();
  for (const Queued& q : queued) {
    if (q.served || !q.via_nccl) continue;
    const NcclGather& g = q.call;
    const ncclResult_t r =
        nccl.all_gather(g.sendbuf, g.recvbuf, g.count, g.dtype, q.agreement->comm(), q.stream);
    if (result == ncclSuccess) result = r;
  }
  const ncclResult_t ended = nccl.group_end();
  return result != ncclSuccess ? result : ended;
}

// Marks a queued call as an ungrouped one is marked when it returns (see intercept).
void record_served(const Queued& q, ncclResult_t result, bool moved) {
  if (q.via_nccl || (result != ncclSuccess && result != ncclRemoteError)) return;
  const capture::CommInfo& info = q.agreement->info();
  trace::GroupServedRecord r{};
  r.comm_id = info.identity;
  r.seq = q.seq;
  r.rank = info.rank;
  r.flags = moved ? trace::kCallMoved : trace::kCallFellBack;
  q.agreement->world().trace(trace::RecordType::GroupServed, &r, sizeof(r));
}

}  // namespace

Routed route_by_plan(const PlanRoutes& plan, const CallPlace& place) {
  const SlotLayout& layout = *plan.layout;
  const bool in_layout = place.gather && place.position < layout.offset_by_position.size() &&
                         layout.offset_by_position[place.position] != SIZE_MAX;
  Routed routed;
  if (plan.committing && !place.capturing && place.digest == plan.committed_digest) {
    // Before the plan being committed is active, its gathers go to NCCL anyway: timed there, they
    // are the cost trial's NCCL side, so no call has to run the slower way on purpose.
    if (!in_layout) return routed;
    routed.route = {Route::Kind::TrialNccl, layout.offset_by_position[place.position],
                    layout.bucket_by_position[place.position]};
    routed.route.plan = plan.plan + 1;  // the plan it would be served by once active
    return routed;
  }
  if (!plan.in_force || place.digest != plan.digest || !in_layout) return routed;
  // A captured gather moves with static weights (its copies read memory that never changes,
  // so a replay repeats nothing that orders the ranks), or in the default mode on the graph
  // slots of a plan that has them (a handshake of latches, which every replay leaves as it
  // found it). The eager handshake counts buckets, which a replay cannot: without graph slots
  // captured gathers stay on NCCL. The route follows the agreed plan by position alone, as an
  // eager call's does, so every rank that captures the same calls captures the same route. A
  // static read waits on no peer, so a rank that runs the call eagerly instead is served alike;
  // graph slots need every rank to capture it (as assumed of programs: rewrite/agreement.h).
  if (place.capturing) {
    const bool moves = (plan.bound || plan.graph_slots) && !plan.dry;
    routed.captured = moves ? Routed::Captured::Moves : Routed::Captured::Stays;
    if (!moves) return routed;
  }
  Route::Kind kind = plan.dry ? Route::Kind::WouldMove : Route::Kind::Move;
  if (plan.trial_to_nccl) {
    // The trial's NCCL side is timed with events, which a graph cannot hold: a captured call of
    // that step is plain NCCL, on every rank (the step count is shared).
    if (place.capturing) return routed;
    kind = Route::Kind::TrialNccl;
  }
  routed.route = {kind, layout.offset_by_position[place.position],
                  layout.bucket_by_position[place.position]};
  routed.route.plan = plan.plan;
  routed.route.captured = place.capturing;
  return routed;
}

void install(const RealNcclCalls& calls) { g_nccl = calls; }

std::shared_ptr<CommAgreement> join(ncclComm_t comm, const capture::CommInfo& info) {
  return make_comm_agreement(comm, info, g_nccl);
}

bool watching(const CommAgreement& agreement) noexcept { return agreement.watching(); }

void abandon(CommAgreement& agreement) noexcept {
  guarded("abandoning a communicator's windows", [&] { agreement.abandon(); });
}

ncclResult_t async_error(CommAgreement& agreement) noexcept {
  ncclResult_t result = ncclSuccess;
  guarded("reading a communicator's asynchronous error", [&] { result = agreement.async_error(); });
  return result;
}

void forget_queued(const CommAgreement& agreement) noexcept {
  std::erase_if(t_queued, [&](const Queued& q) { return q.agreement.get() == &agreement; });
}

void forget_in_child() noexcept {
  // The vector's buffer is the parent's thread's; dropping the references would release the
  // parent's windows from the child. Set aside, reachable, never freed.
  static auto* parents = new std::vector<Queued>();
  for (Queued& q : t_queued) parents->push_back(std::move(q));
  t_queued.clear();
  forget_orphans_in_child();
}

void finish_set_ups() noexcept {
  guarded("finishing the plans' set-ups at exit", [] { join_orphans(); });
}

Outcome intercept(const AgreementRef& agreement, const capture::CallArgs& args,
                  capture::CallRecord& record, const capture::StepView& view) noexcept {
  Outcome outcome;
  if (!view.collective || agreement == nullptr) return outcome;
  Route route;
  // Until its route is known, whatever is thrown leaves the call to NCCL, unmarked.
  if (!guarded("rewrite", [&] { route = agreement->on_collective(args, record, view); }))
    return outcome;
  outcome.watching = agreement->watching();
  if (route.kind == Route::Kind::WouldMove) record.flags |= trace::kCallWouldMove;
  if (route.kind != Route::Kind::Move && route.kind != Route::Kind::TrialNccl) return outcome;
  const bool via_nccl = route.kind == Route::Kind::TrialNccl;
  // A trial call goes to NCCL on every rank: a throw before it got there forwards it. A moved
  // call is never forwarded alone, since its peers serve it through the transport (the route
  // would split, and the ranks hang): a throw fails it, and the communicator leaves the
  // transport at its next round. Served (and marked moved) only once it was; inside a group,
  // queued is as good as served: group_ended serves it, or settles it if that fails, and
  // records how it went.
  bool moved = false;
  bool queued = false;
  const bool done = guarded("rewrite", [&] {
    const ce::GatherOp op{args.sendbuf,
                          args.recvbuf,
                          args.count * datatype_bytes(static_cast<uint8_t>(args.dtype)),
                          route.slot_offset,
                          route.verify_now,
                          route.own_offset,
                          route.captured,
                          route.bucket};
    const NcclGather call{args.sendbuf, args.recvbuf, args.count, args.dtype};
    if (agreement->world().group().depth > 0) {
      t_queued.push_back({agreement, route.bucket, via_nccl, args.stream, route.plan,
                          view.collective_index, op, call, record.seq});
      queued = true;
      outcome.queued_to_move = !via_nccl;
      outcome.result = ncclSuccess;
    } else {
      outcome.result = agreement->serve({&op, 1}, {&call, 1}, args.stream, route.bucket, via_nccl,
                                        route.plan, view.collective_index, &moved);
    }
  });
  if (done) {
    outcome.served = true;
    // ncclRemoteError: served, but the ranks' static reads were found to disagree (serving.h).
    const bool served = outcome.result == ncclSuccess || outcome.result == ncclRemoteError;
    if (!via_nccl && served && !queued)
      record.flags |= moved ? trace::kCallMoved : trace::kCallFellBack;
  } else if (!via_nccl) {
    agreement->fail_transport("a moved gather could not be served");
    outcome.served = true;
    outcome.result = ncclInternalError;
  }
  return outcome;
}

ncclResult_t group_ended(ncclResult_t nccl_result) noexcept {
  const ncclResult_t flushed = std::exchange(early_launches(), {}).error;
  if (nccl_result == ncclSuccess && flushed != ncclSuccess) nccl_result = flushed;
  if (t_queued.empty()) return nccl_result;
  ncclResult_t result = nccl_result;
  std::vector<Queued> queued = std::move(t_queued);
  t_queued.clear();
  const bool all_served = guarded("ncclGroupEnd", [&] {
    // One bucket of the plan at a time, in the order the group first named each. The ranks
    // queued the same calls (routes are shared), so they serve the same buckets in this order.
    std::vector<bool> done(queued.size(), false);
    std::vector<ce::GatherOp> bucket;
    std::vector<NcclGather> calls;
    std::vector<size_t> members;
    for (size_t i = 0; i < queued.size(); ++i) {
      if (done[i]) continue;
      bucket.clear();
      calls.clear();
      members.clear();
      for (size_t j = i; j < queued.size(); ++j) {
        if (done[j] || queued[j].agreement != queued[i].agreement ||
            queued[j].bucket != queued[i].bucket || queued[j].plan != queued[i].plan)
          continue;
        // A group longer than the step holds one position twice (a step of one gather, layers
        // grouped in pairs): both would stage at its one slot offset. The second goes in a
        // bucket of its own, served next; every rank queued the same calls, so all split alike.
        const auto same_slot = [&](const ce::GatherOp& op) {
          return op.slot_offset == queued[j].op.slot_offset;
        };
        if (std::any_of(bucket.begin(), bucket.end(), same_slot)) continue;
        bucket.push_back(queued[j].op);
        calls.push_back(queued[j].call);
        members.push_back(j);
        done[j] = true;
      }
      // queued[i] is the bucket's first call: the group queued them in call order.
      bool moved = false;
      const ncclResult_t served = queued[i].agreement->serve(
          bucket, calls, queued[i].stream, queued[i].bucket, queued[i].via_nccl, queued[i].plan,
          queued[i].collective, &moved);
      for (const size_t j : members) {
        queued[j].served = true;
        record_served(queued[j], served, moved);
      }
      if (result == ncclSuccess) result = served;
    }
  });
  if (!all_served) {
    const ncclResult_t settled = settle_unserved(queued);
    if (result == ncclSuccess) result = settled;
  }
  return result;
}

void group_discarded() noexcept {
  t_queued.clear();
  // The part of the group launched before an agreement round really ran: a simulation cannot
  // take it back. Rare (nothing in PyTorch simulates groups), and said rather than hidden.
  const EarlyLaunches early = std::exchange(early_launches(), {});
  if (early.calls > 0)
    MAGI_WARN(Rewrite,
              "ncclGroupSimulateEnd: an agreement round launched the first %u call(s) of "
              "this group for real; they ran, and the simulation covers only the calls after them",
              early.calls);
}

}  // namespace magi::rewrite
