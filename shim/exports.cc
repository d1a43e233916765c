// The NCCL entry points the host program reaches through LD_PRELOAD.
//
// Each one records the call (capture/) and forwards it, unchanged, to the real NCCL, whose result
// the program sees; the one exception is an all-gather every rank agreed to move (rewrite/),
// served by the copy-engine transport, whose result the program sees instead. Nothing here runs
// at load time: the real NCCL is found, and options read, on the first call.
#include <nccl.h>

#include <algorithm>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "base/base.h"
#include "capture/capture.h"
#include "rewrite/rewrite.h"
#include "shim/communicators.h"
#include "shim/real_nccl.h"

#define MAGI_EXPORT extern "C" __attribute__((visibility("default")))

namespace magi::shim {
namespace {

using capture::CallArgs;
using capture::CommInfo;
using capture::CommOrigin;
using capture::Op;

// NCCL calls some of its own public functions (its ncclBcast calls ncclBroadcast, its
// ncclCommInitAll calls ncclGroupStart and ncclCommInitRank...). Those calls go through the PLT
// and so reach us, from inside a call we are forwarding. They are not the program's calls:
// they are passed straight on, unrecorded. The depth is per thread, as NCCL's calls are.
thread_local int t_inside_real_nccl = 0;

bool inside_real_nccl() { return t_inside_real_nccl > 0; }

template <class... Params, class... Args>
ncclResult_t forward_to(ncclResult_t (*real)(Params...), const char* name, Args&&... args) {
  if (real == nullptr) return missing_function(name);
  ++t_inside_real_nccl;
  const ncclResult_t result = real(std::forward<Args>(args)...);
  --t_inside_real_nccl;
  return result;
}

// Calls the real function, or answers for a function the real library lacks.
#define MAGI_FORWARD(name, ...) forward_to(real_nccl().name, #name __VA_OPT__(, ) __VA_ARGS__)

// Records one call around its forwarding, and lets rewrite/ take an agreed gather off NCCL.
// The record lives on this stack frame.
template <class Forward>
ncclResult_t recorded(const char* entry_point, ncclComm_t comm, const CallArgs& args,
                      Forward&& forward) noexcept {
  if (inside_real_nccl()) return forward();
  capture::CallRecord record;
  capture::StepView view;
  CommRef state;  // held for the whole call: an abort from another thread cannot free it
  const bool seen = guarded(entry_point, [&] {
    state = comm_of(comm);
    capture::begin_call(state->capture, args, record, &view);
  });
  const rewrite::Outcome outcome =
      seen ? rewrite::intercept(state->agreement, args, record, view) : rewrite::Outcome{};
  if (!outcome.watching) capture::stop_gather_callsites(state->capture);
  const ncclResult_t result = outcome.served ? outcome.result : forward();
  if (seen) guarded(entry_point, [&] { capture::end_call(record, result); });
  return result;
}

// Agreement rounds reach the real NCCL through here, so that whatever NCCL calls back into its
// own API from inside passes straight through, as for the program's calls.
ncclResult_t agreement_all_gather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  return MAGI_FORWARD(AllGather, sendbuff, recvbuff, sendcount, datatype, comm, stream);
}
ncclResult_t agreement_group_start() { return MAGI_FORWARD(GroupStart); }
ncclResult_t agreement_group_end() { return MAGI_FORWARD(GroupEnd); }
// The inter-machine sub-communicators of plans spanning machines: the real NCCL's own, never
// ours, so none of them is a communicator the program knows.
ncclResult_t agreement_unique_id(ncclUniqueId* id) { return MAGI_FORWARD(GetUniqueId, id); }
ncclResult_t agreement_comm_init(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                 ncclConfig_t* config) {
  return MAGI_FORWARD(CommInitRankConfig, comm, nranks, id, rank, config);
}
ncclResult_t agreement_async_error(ncclComm_t comm, ncclResult_t* error) {
  return MAGI_FORWARD(CommGetAsyncError, comm, error);
}
ncclResult_t agreement_comm_destroy(ncclComm_t comm) { return MAGI_FORWARD(CommDestroy, comm); }
ncclResult_t agreement_comm_abort(ncclComm_t comm) { return MAGI_FORWARD(CommAbort, comm); }

int query(ncclResult_t (*const fn)(const ncclComm_t, int*), ncclComm_t comm) {
  int value = -1;
  if (fn == nullptr || fn(comm, &value) != ncclSuccess) return -1;
  return value;
}

// After a successful init, tells capture who the new communicator is. Non-blocking
// communicators may still be initialising (ncclInProgress); their handle is valid already.
// Non-blocking communicators: from their config, or (Split/Shrink without one) their parent's,
// which NCCL then hands down.
bool nonblocking(const ncclConfig_t* config, ncclComm_t parent = nullptr) {
  if (config != nullptr) return config->blocking == 0;
  const CommRef record = parent != nullptr ? find_comm(parent) : nullptr;
  return record != nullptr && record->capture.info.nonblocking;
}

void joined(ncclResult_t result, ncclComm_t comm, uint64_t identity, uint64_t parent,
            CommOrigin origin, int rank_hint = -1, int nranks_hint = -1,
            bool is_nonblocking = false) {
  if ((result != ncclSuccess && result != ncclInProgress) || comm == nullptr) {
    capture::comm_join_failed(identity);
    return;
  }
  const RealNccl& real = real_nccl();
  CommInfo info{};
  info.identity = identity;
  info.parent_identity = parent;
  info.rank = rank_hint >= 0 ? rank_hint : query(real.CommUserRank, comm);
  info.nranks = nranks_hint >= 0 ? nranks_hint : query(real.CommCount, comm);
  info.cuda_device = query(real.CommCuDevice, comm);
  info.origin = origin;
  info.nonblocking = is_nonblocking;
  static std::once_flag installed;
  std::call_once(installed, [] {
    rewrite::install({&agreement_all_gather, &agreement_group_start, &agreement_group_end,
                      &agreement_unique_id, &agreement_comm_init, &agreement_async_error,
                      &agreement_comm_destroy, &agreement_comm_abort});
  });
  add_comm(comm, info, rewrite::join(comm, info));
}

// Derived on every rank, NOCOLOR ones too, so the parent's derivation count stays equal.
uint64_t child_identity(ncclComm_t parent, CommOrigin origin, int color,
                        std::span<const int> excluded) {
  return capture::derive_identity(comm_of(parent)->capture, origin, color, excluded);
}

uint64_t identity_of(ncclComm_t comm) {
  const CommRef record = find_comm(comm);
  return record ? record->capture.info.identity : 0;
}

// The communicator ends for the library: no lookup finds it after this, its CommEnd record is
// flushed to the trace. Returns its record, whose last holder releases its windows (see
// shim/lifecycle.cc for the order). Abort and revoke first make the agreement's waits on peers
// give up: another thread may be blocked on one.
CommRef end_comm(ncclComm_t comm, capture::CommEndKind how) {
  CommRef record = remove_comm(comm);
  if (record == nullptr) return nullptr;
  if (record->agreement) rewrite::forget_queued(*record->agreement);
  const bool aborting = how == capture::CommEndKind::Abort || how == capture::CommEndKind::Revoke;
  if (aborting && record->agreement) rewrite::abandon(*record->agreement);
  capture::comm_ended(record->capture, how);
  return record;
}

}  // namespace
}  // namespace magi::shim

using namespace magi::shim;  // the entry points below are extern "C" and cannot live in a namespace
using magi::guarded;
using magi::capture::CallArgs;
using magi::capture::CommEndKind;
using magi::capture::CommOrigin;
using magi::capture::Op;

// ---------------------------------------------------------------- communicators

MAGI_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
  const bool nested = inside_real_nccl();
  if (!nested)
    guarded("ncclCommInitRank", [&] {
      magi::capture::comm_joining(magi::capture::identity_from_unique_ids({&id, 1}), rank, nranks,
                                  CommOrigin::InitRank);
    });
  const ncclResult_t r = MAGI_FORWARD(CommInitRank, comm, nranks, id, rank);
  if (!nested)
    guarded("ncclCommInitRank", [&] {
      joined(r, comm ? *comm : nullptr, magi::capture::identity_from_unique_ids({&id, 1}), 0,
             CommOrigin::InitRank, rank, nranks);
    });
  return r;
}

MAGI_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                                int rank, ncclConfig_t* config) {
  const bool nested = inside_real_nccl();
  if (!nested)
    guarded("ncclCommInitRankConfig", [&] {
      magi::capture::comm_joining(magi::capture::identity_from_unique_ids({&id, 1}), rank, nranks,
                                  CommOrigin::InitRankConfig);
    });
  const ncclResult_t r = MAGI_FORWARD(CommInitRankConfig, comm, nranks, id, rank, config);
  if (!nested)
    guarded("ncclCommInitRankConfig", [&] {
      joined(r, comm ? *comm : nullptr, magi::capture::identity_from_unique_ids({&id, 1}), 0,
             CommOrigin::InitRankConfig, rank, nranks, nonblocking(config));
    });
  return r;
}

MAGI_EXPORT ncclResult_t ncclCommInitRankScalable(ncclComm_t* comm, int nranks, int rank, int nIds,
                                                  ncclUniqueId* ids, ncclConfig_t* config) {
  const bool nested = inside_real_nccl();
  if (!nested && ids != nullptr && nIds > 0)
    guarded("ncclCommInitRankScalable", [&] {
      magi::capture::comm_joining(
          magi::capture::identity_from_unique_ids({ids, static_cast<size_t>(nIds)}), rank, nranks,
          CommOrigin::InitRankScalable);
    });
  const ncclResult_t r = MAGI_FORWARD(CommInitRankScalable, comm, nranks, rank, nIds, ids, config);
  if (!nested)
    guarded("ncclCommInitRankScalable", [&] {
      if (ids == nullptr || nIds <= 0) return;
      joined(r, comm ? *comm : nullptr,
             magi::capture::identity_from_unique_ids({ids, static_cast<size_t>(nIds)}), 0,
             CommOrigin::InitRankScalable, rank, nranks, nonblocking(config));
    });
  return r;
}

MAGI_EXPORT ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  const bool nested = inside_real_nccl();
  const ncclResult_t r = MAGI_FORWARD(CommInitAll, comms, ndev, devlist);
  if (!nested)
    guarded("ncclCommInitAll", [&] {
      if (r != ncclSuccess || comms == nullptr) return;
      const uint64_t identity = magi::capture::identity_for_init_all(ndev);
      for (int i = 0; i < ndev; ++i) joined(r, comms[i], identity, 0, CommOrigin::InitAll, i, ndev);
    });
  return r;
}

MAGI_EXPORT ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                       ncclConfig_t* config) {
  const bool nested = inside_real_nccl();
  uint64_t identity = 0;
  if (!nested)
    guarded("ncclCommSplit",
            [&] { identity = child_identity(comm, CommOrigin::Split, color, {}); });
  const ncclResult_t r = MAGI_FORWARD(CommSplit, comm, color, key, newcomm, config);
  if (!nested)
    guarded("ncclCommSplit", [&] {
      joined(r, newcomm ? *newcomm : nullptr, identity, identity_of(comm), CommOrigin::Split, -1,
             -1, nonblocking(config, comm));
    });
  return r;
}

MAGI_EXPORT ncclResult_t ncclCommShrink(ncclComm_t comm, int* excludeRanksList,
                                        int excludeRanksCount, ncclComm_t* newcomm,
                                        ncclConfig_t* config, int shrinkFlags) {
  const bool nested = inside_real_nccl();
  uint64_t identity = 0;
  if (!nested)
    guarded("ncclCommShrink", [&] {
      std::vector<int> excluded;
      if (excludeRanksList != nullptr && excludeRanksCount > 0)
        excluded.assign(excludeRanksList, excludeRanksList + excludeRanksCount);
      std::sort(excluded.begin(), excluded.end());  // the same set, however each rank listed it
      identity = child_identity(comm, CommOrigin::Shrink, 0, excluded);
    });
  const ncclResult_t r = MAGI_FORWARD(CommShrink, comm, excludeRanksList, excludeRanksCount,
                                      newcomm, config, shrinkFlags);
  if (!nested)
    guarded("ncclCommShrink", [&] {
      joined(r, newcomm ? *newcomm : nullptr, identity, identity_of(comm), CommOrigin::Shrink, -1,
             -1, nonblocking(config, comm));
    });
  return r;
}

// Finalize ends the communicator's collectives but leaves it for destroy: it is recorded as
// ended, and its record (and windows) go at destroy.
MAGI_EXPORT ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  const bool nested = inside_real_nccl();
  const ncclResult_t r = MAGI_FORWARD(CommFinalize, comm);
  if (!nested)
    guarded("ncclCommFinalize", [&] {
      if (const CommRef record = find_comm(comm))
        magi::capture::comm_ended(record->capture, CommEndKind::Finalize);
    });
  return r;
}

// Destroy and Abort: forget the communicator before NCCL frees it, so a handle NCCL hands out
// again later can never meet this one's state. Destroy releases the windows first (NCCL's destroy
// finishes the communicator's work, ours included); abort gives up this rank's waits first and
// releases after NCCL's abort has stopped its kernels (another thread may be blocked on either).
MAGI_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  const bool nested = inside_real_nccl();
  if (!nested) guarded("ncclCommDestroy", [&] { (void)end_comm(comm, CommEndKind::Destroy); });
  return MAGI_FORWARD(CommDestroy, comm);
}

MAGI_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) {
  const bool nested = inside_real_nccl();
  CommRef ended;  // released after NCCL's abort
  if (!nested) guarded("ncclCommAbort", [&] { ended = end_comm(comm, CommEndKind::Abort); });
  return MAGI_FORWARD(CommAbort, comm);
}

MAGI_EXPORT ncclResult_t ncclCommRevoke(ncclComm_t comm, int revokeFlags) {
  const bool nested = inside_real_nccl();
  const ncclResult_t r = MAGI_FORWARD(CommRevoke, comm, revokeFlags);
  // Revoked work is cancelled, ours too.
  if (!nested) guarded("ncclCommRevoke", [&] { (void)end_comm(comm, CommEndKind::Revoke); });
  return r;
}

// NCCL's own error first; where it has none, ours: a static-weights plan whose ranks were found
// to have read different shards (rewrite/serving.h) reports ncclRemoteError, as a peer's failure
// does, so that a watchdog polling this (PyTorch's) ends the job instead of training on wrong
// bytes.
MAGI_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  const ncclResult_t r = MAGI_FORWARD(CommGetAsyncError, comm, asyncError);
  if (r != ncclSuccess || asyncError == nullptr || *asyncError != ncclSuccess || inside_real_nccl())
    return r;
  guarded("ncclCommGetAsyncError", [&] {
    const CommRef record = find_comm(comm);
    if (record != nullptr && record->agreement != nullptr) {
      const ncclResult_t ours = magi::rewrite::async_error(*record->agreement);
      if (ours != ncclSuccess) *asyncError = ours;
    }
  });
  return r;
}

// ---------------------------------------------------------------- groups

// Group depth is tracked for the program's own groups only (thread-local counters: cannot fail).
MAGI_EXPORT ncclResult_t ncclGroupStart() {
  if (!inside_real_nccl()) magi::capture::group_start();
  return MAGI_FORWARD(GroupStart);
}

// The group's NCCL work is launched first, then the moved gathers it queued (rewrite/).
MAGI_EXPORT ncclResult_t ncclGroupEnd() {
  const bool nested = inside_real_nccl();
  const ncclResult_t r = MAGI_FORWARD(GroupEnd);
  if (nested) return r;
  magi::capture::group_end();
  if (magi::capture::group_depth() != 0) return r;
  const ncclResult_t ended = magi::rewrite::group_ended(r);
  magi::capture::group_launched(ended);
  return ended;
}

MAGI_EXPORT ncclResult_t ncclGroupSimulateEnd(ncclSimInfo_t* simInfo) {
  const bool nested = inside_real_nccl();
  const ncclResult_t r = MAGI_FORWARD(GroupSimulateEnd, simInfo);
  if (!nested) {
    magi::capture::group_end();  // it closes the group, like ncclGroupEnd, but runs nothing
    if (magi::capture::group_depth() == 0) {
      magi::rewrite::group_discarded();
      magi::capture::group_simulated();
    }
  }
  return r;
}

// ---------------------------------------------------------------- collectives and p2p

MAGI_EXPORT ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                       ncclDataType_t datatype, ncclComm_t comm,
                                       cudaStream_t stream) {
  return recorded("ncclAllGather", comm,
                  {Op::AllGather, datatype, sendcount, -1, -1, sendbuff, recvbuff, stream}, [&] {
                    return MAGI_FORWARD(AllGather, sendbuff, recvbuff, sendcount, datatype, comm,
                                        stream);
                  });
}

MAGI_EXPORT ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                                       ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                       cudaStream_t stream) {
  return recorded("ncclAllReduce", comm,
                  {Op::AllReduce, datatype, count, -1, op, sendbuff, recvbuff, stream}, [&] {
                    return MAGI_FORWARD(AllReduce, sendbuff, recvbuff, count, datatype, op, comm,
                                        stream);
                  });
}

MAGI_EXPORT ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                           ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                           cudaStream_t stream) {
  return recorded("ncclReduceScatter", comm,
                  {Op::ReduceScatter, datatype, recvcount, -1, op, sendbuff, recvbuff, stream},
                  [&] {
                    return MAGI_FORWARD(ReduceScatter, sendbuff, recvbuff, recvcount, datatype, op,
                                        comm, stream);
                  });
}

MAGI_EXPORT ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                                       ncclDataType_t datatype, int root, ncclComm_t comm,
                                       cudaStream_t stream) {
  return recorded("ncclBroadcast", comm,
                  {Op::Broadcast, datatype, count, root, -1, sendbuff, recvbuff, stream}, [&] {
                    return MAGI_FORWARD(Broadcast, sendbuff, recvbuff, count, datatype, root, comm,
                                        stream);
                  });
}

MAGI_EXPORT ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root,
                                   ncclComm_t comm, cudaStream_t stream) {
  return recorded("ncclBcast", comm, {Op::Broadcast, datatype, count, root, -1, buff, buff, stream},
                  [&] { return MAGI_FORWARD(Bcast, buff, count, datatype, root, comm, stream); });
}

MAGI_EXPORT ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count,
                                    ncclDataType_t datatype, ncclRedOp_t op, int root,
                                    ncclComm_t comm, cudaStream_t stream) {
  return recorded(
      "ncclReduce", comm, {Op::Reduce, datatype, count, root, op, sendbuff, recvbuff, stream}, [&] {
        return MAGI_FORWARD(Reduce, sendbuff, recvbuff, count, datatype, op, root, comm, stream);
      });
}

MAGI_EXPORT ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
                                      ncclDataType_t datatype, ncclComm_t comm,
                                      cudaStream_t stream) {
  return recorded(
      "ncclAlltoAll", comm, {Op::AlltoAll, datatype, count, -1, -1, sendbuff, recvbuff, stream},
      [&] { return MAGI_FORWARD(AlltoAll, sendbuff, recvbuff, count, datatype, comm, stream); });
}

MAGI_EXPORT ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count,
                                    ncclDataType_t datatype, int root, ncclComm_t comm,
                                    cudaStream_t stream) {
  return recorded(
      "ncclGather", comm, {Op::Gather, datatype, count, root, -1, sendbuff, recvbuff, stream}, [&] {
        return MAGI_FORWARD(Gather, sendbuff, recvbuff, count, datatype, root, comm, stream);
      });
}

MAGI_EXPORT ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count,
                                     ncclDataType_t datatype, int root, ncclComm_t comm,
                                     cudaStream_t stream) {
  return recorded("ncclScatter", comm,
                  {Op::Scatter, datatype, count, root, -1, sendbuff, recvbuff, stream}, [&] {
                    return MAGI_FORWARD(Scatter, sendbuff, recvbuff, count, datatype, root, comm,
                                        stream);
                  });
}

MAGI_EXPORT ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype,
                                  int peer, ncclComm_t comm, cudaStream_t stream) {
  return recorded(
      "ncclSend", comm, {Op::Send, datatype, count, peer, -1, sendbuff, nullptr, stream},
      [&] { return MAGI_FORWARD(Send, sendbuff, count, datatype, peer, comm, stream); });
}

MAGI_EXPORT ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                                  ncclComm_t comm, cudaStream_t stream) {
  return recorded(
      "ncclRecv", comm, {Op::Recv, datatype, count, peer, -1, nullptr, recvbuff, stream},
      [&] { return MAGI_FORWARD(Recv, recvbuff, count, datatype, peer, comm, stream); });
}
