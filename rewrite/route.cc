// The call path of rewrite/: finds the communicator's agreement, asks it for the call's route,
// and serves moved gathers now or, inside a group, when the group ends (one bucket per
// communicator, like NCCL launching a group's work at ncclGroupEnd).
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <new>
#include <span>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "rewrite/agreement.h"
#include "rewrite/observation.h"
#include "rewrite/rewrite.h"

namespace magi::rewrite {
namespace {

RealNcclCalls g_nccl{};

// Shared: a call in flight holds its agreement, so an abort from another thread (a watchdog, as
// NCCL allows) never frees it under that call; the last holder releases its windows.
using AgreementRef = std::shared_ptr<CommAgreement>;

std::mutex g_mutex;
std::unordered_map<ncclComm_t, AgreementRef>& agreements() {
  static auto* map = new std::unordered_map<ncclComm_t, AgreementRef>();
  return *map;  // never destroyed: exit hooks and late threads may still look things up
}

// Bumped whenever a communicator joins or leaves, so a thread's cached lookup can tell it is stale.
std::atomic<uint64_t> g_generation{0};

// Every intercepted collective looks its communicator up: a per-thread one-entry cache keeps the
// lock and the hash off that path while the set of communicators stays the same. The cache holds
// no reference (a thread that stops calling must not keep windows alive).
AgreementRef find(ncclComm_t comm) {
  thread_local ncclComm_t cached_comm = nullptr;
  thread_local std::weak_ptr<CommAgreement> cached;
  thread_local uint64_t cached_generation = ~uint64_t{0};
  const uint64_t generation = g_generation.load(std::memory_order_acquire);
  if (comm == cached_comm && generation == cached_generation) return cached.lock();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = agreements().find(comm);
  AgreementRef found = it == agreements().end() ? nullptr : it->second;
  cached_comm = comm;
  cached = found;
  cached_generation = g_generation.load(std::memory_order_relaxed);
  return found;
}

// Moved gathers issued inside the calling thread's open group, in call order.
struct Queued {
  AgreementRef agreement;
  uint16_t bucket;
  bool via_nccl;
  cudaStream_t stream;
  ce::GatherOp op;
  NcclGather call;
  bool served = false;  // its bucket was served at the group's end
};
thread_local std::vector<Queued> t_queued;

// What a failure at the group's end left unserved goes to NCCL as the program issued it: one
// NCCL group (so the calls of several communicators cannot meet in different orders).
ncclResult_t forward_unserved(std::span<Queued> queued) noexcept {
  const auto first =
      std::find_if(queued.begin(), queued.end(), [](const Queued& q) { return !q.served; });
  if (first == queued.end()) return ncclSuccess;
  const RealNcclCalls& nccl = first->agreement->world().nccl;
  nccl.group_start();
  ncclResult_t result = ncclSuccess;
  for (const Queued& q : queued) {
    if (q.served) continue;
    const NcclGather& g = q.call;
    const ncclResult_t r = q.agreement->world().nccl.all_gather(
        g.sendbuf, g.recvbuf, g.count, g.dtype, q.agreement->comm(), q.stream);
    if (result == ncclSuccess) result = r;
  }
  const ncclResult_t ended = nccl.group_end();
  return result != ncclSuccess ? result : ended;
}

}  // namespace

void install(const RealNcclCalls& calls) { g_nccl = calls; }

// A program may exit without destroying its communicators: their windows are released then
// (shared-memory names unlinked, device memory freed), so nothing outlives the process.
void release_at_exit() {
  std::lock_guard<std::mutex> lock(g_mutex);
  agreements().clear();
  g_generation.fetch_add(1, std::memory_order_release);
}

// A child after fork() owns none of this: its parent's windows, mappings and CUDA memory are the
// parent's (and CUDA does not survive fork). The child forgets them without releasing anything;
// the leak is of the parent's state and only in the child.
void forget_in_child() {
  new (&g_mutex) std::mutex();  // another parent thread may have held it at the fork
  // Set aside, reachable, never freed: it is the parent's (a leak checker in the child sees a
  // live pointer, not a leak).
  static auto* parents = new std::vector<AgreementRef>();
  for (auto& [comm, agreement] : agreements()) parents->push_back(std::move(agreement));
  agreements().clear();
  g_generation.fetch_add(1, std::memory_order_release);
  t_queued.clear();
}

void comm_joined(ncclComm_t comm, const capture::CommInfo& info) {
  static std::once_flag hook;
  std::call_once(hook, [] {
    std::atexit(release_at_exit);
    pthread_atfork(nullptr, nullptr, forget_in_child);
  });
  auto agreement = make_comm_agreement(comm, info, g_nccl);
  std::lock_guard<std::mutex> lock(g_mutex);
  agreements()[comm] = std::move(agreement);
  g_generation.fetch_add(1, std::memory_order_release);
}

Departure comm_left(ncclComm_t comm, bool aborting) {
  AgreementRef gone;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = agreements().find(comm);
    if (it == agreements().end()) return {};
    gone = std::move(it->second);
    agreements().erase(it);
    g_generation.fetch_add(1, std::memory_order_release);
  }
  std::erase_if(t_queued, [&](const Queued& q) { return q.agreement == gone; });
  if (aborting) gone->abandon();
  Departure departure;
  departure.agreement_ = std::move(gone);
  return departure;
}

Departure::Departure() = default;
Departure::Departure(Departure&&) noexcept = default;
Departure& Departure::operator=(Departure&&) noexcept = default;
Departure::~Departure() {
  guarded("releasing a communicator's windows", [&] { agreement_.reset(); });
}

Outcome intercept(ncclComm_t comm, const capture::CallArgs& args, capture::CallRecord& record,
                  const capture::StepView& view) noexcept {
  Outcome outcome;
  guarded("rewrite", [&] {
    if (!view.collective) return;
    const AgreementRef agreement = find(comm);
    if (agreement != nullptr) outcome = route_call(agreement, args, record, view);
  });
  return outcome;
}

Outcome route_call(const AgreementRef& agreement, const capture::CallArgs& args,
                   capture::CallRecord& record, const capture::StepView& view) noexcept {
  Outcome outcome;
  guarded("rewrite", [&] {
    const Route route = agreement->on_collective(args, record, view);
    if (route.kind == Route::Kind::WouldMove) record.flags |= trace::kCallWouldMove;
    if (route.kind != Route::Kind::Move && route.kind != Route::Kind::TrialNccl) return;
    const bool via_nccl = route.kind == Route::Kind::TrialNccl;
    const ce::GatherOp op{args.sendbuf, args.recvbuf,
                          args.count * datatype_bytes(static_cast<uint8_t>(args.dtype)),
                          route.slot_offset};
    const NcclGather call{args.sendbuf, args.recvbuf, args.count, args.dtype};
    // Served only once it was: until then, whatever is thrown leaves the call to NCCL. Inside a
    // group, queued is as good as served: group_ended serves it, or forwards it if that fails.
    ncclResult_t result = ncclSuccess;
    if (agreement->world().group().depth > 0) {
      t_queued.push_back({agreement, route.bucket, via_nccl, args.stream, op, call});
    } else {
      result = agreement->serve({&op, 1}, {&call, 1}, args.stream, route.bucket, via_nccl);
    }
    outcome.served = true;
    outcome.result = result;
    if (!via_nccl) record.flags |= trace::kCallMoved;
  });
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
        if (queued[j].agreement != queued[i].agreement || queued[j].bucket != queued[i].bucket)
          continue;
        bucket.push_back(queued[j].op);
        calls.push_back(queued[j].call);
        members.push_back(j);
        done[j] = true;
      }
      const ncclResult_t served = queued[i].agreement->serve(bucket, calls, queued[i].stream,
                                                             queued[i].bucket, queued[i].via_nccl);
      for (const size_t j : members) queued[j].served = true;
      if (result == ncclSuccess) result = served;
    }
  });
  if (!all_served) {
    const ncclResult_t forwarded = forward_unserved(queued);
    if (result == ncclSuccess) result = forwarded;
  }
  return result;
}

void group_discarded() noexcept {
  t_queued.clear();
  // The part of the group launched before an agreement round really ran: a simulation cannot
  // take it back. Rare (nothing in PyTorch simulates groups), and said rather than hidden.
  const EarlyLaunches early = std::exchange(early_launches(), {});
  if (early.calls > 0)
    MAGI_WARN(Rewrite, "ncclGroupSimulateEnd: an agreement round launched the first %u call(s) of "
              "this group for real; they ran, and the simulation covers only the calls after them",
              early.calls);
}

}  // namespace magi::rewrite
