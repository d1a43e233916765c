// Communicator entry points: creation, derivation, queries and teardown.
#include <nccl.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "tests/support/standin/comm.h"
#include "tests/support/standin/device_memory.h"
#include "tests/support/standin/export.h"
#include "tests/support/standin/group.h"
#include "tests/support/standin/report.h"

using standin::api_edge;
using standin::Failure;
using standin::format;

namespace {

// NCCL refuses a config not made with NCCL_CONFIG_INITIALIZER; so do we. A non-blocking config
// (blocking == 0) makes ncclCommInitRank* outside a group return ncclInProgress until every rank
// joined, as NCCL does, so that a waiting rank can give up (ncclCommAbort); every other call
// completes before it returns, which a non-blocking program must also accept (ncclSuccess
// instead of ncclInProgress). Returns whether the config is non-blocking.
bool check_config(const ncclConfig_t* config) {
  if (config != nullptr && config->magic != 0xcafebeef) {
    throw Failure(ncclInvalidArgument, "config was not initialized with NCCL_CONFIG_INITIALIZER");
  }
  return config != nullptr && config->blocking == 0;
}

ncclResult_t init_rank(ncclComm_t* comm, int nranks, const ncclUniqueId& id, int rank,
                       bool nonblocking = false) {
  if (comm == nullptr) throw Failure(ncclInvalidArgument, "comm is NULL");
  if (nranks < 1) throw Failure(ncclInvalidArgument, format("nranks %d is not positive", nranks));
  if (rank < 0 || rank >= nranks) {
    throw Failure(ncclInvalidArgument, format("rank %d is not in 0..%d", rank, nranks - 1));
  }
  // Like NCCL, the communicator belongs to the device current at its creation; without a loaded
  // driver there is no device to ask (and CUDA is not started to find one): 0.
  ncclComm* joined = standin::join_communicator(standin::segment_name_of(id), nranks, rank,
                                                standin::current_cuda_device(0));
  *comm = joined;
  if (nonblocking && !standin::group_open()) {
    joined->joining = standin::make_join_wait(joined);
    joined->joining->launch();
    return standin::advance_join(joined);
  }
  // Inside a group the wait for the other ranks happens at ncclGroupEnd, so one thread can
  // create several communicators of one clique.
  return standin::submit(standin::make_join_wait(joined));
}

}  // namespace

STANDIN_API ncclResult_t pncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId,
                                           int rank) {
  return api_edge("ncclCommInitRank", [&] { return init_rank(comm, nranks, commId, rank); });
}
STANDIN_ALIAS(ncclCommInitRank)

STANDIN_API ncclResult_t pncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId,
                                                 int rank, ncclConfig_t* config) {
  return api_edge("ncclCommInitRankConfig", [&] {
    const bool nonblocking = check_config(config);
    return init_rank(comm, nranks, commId, rank, nonblocking);
  });
}
STANDIN_ALIAS(ncclCommInitRankConfig)

STANDIN_API ncclResult_t pncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank,
                                                   int nId, ncclUniqueId* commIds,
                                                   ncclConfig_t* config) {
  return api_edge("ncclCommInitRankScalable", [&] {
    check_config(config);
    if (nId < 1 || commIds == nullptr) throw Failure(ncclInvalidArgument, "no unique ids given");
    return init_rank(newcomm, nranks, commIds[0], myrank);
  });
}
STANDIN_ALIAS(ncclCommInitRankScalable)

STANDIN_API ncclResult_t pncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  return api_edge("ncclCommInitAll", [&] {
    if (comms == nullptr) throw Failure(ncclInvalidArgument, "comms is NULL");
    if (ndev < 1) throw Failure(ncclInvalidArgument, format("ndev %d is not positive", ndev));
    const std::string name = standin::segment_name_of(standin::make_unique_id());
    std::vector<ncclComm*> made;
    try {
      // Every rank lives in this process, so all have joined when the loop ends.
      for (int i = 0; i < ndev; ++i) {
        made.push_back(standin::join_communicator(name, ndev, i, devlist ? devlist[i] : i));
      }
    } catch (...) {
      for (ncclComm* c : made) delete c;
      throw;
    }
    std::copy(made.begin(), made.end(), comms);
    return ncclSuccess;
  });
}
STANDIN_ALIAS(ncclCommInitAll)

STANDIN_API ncclResult_t pncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                        ncclConfig_t* config) {
  return api_edge("ncclCommSplit", [&] {
    standin::check_usable(comm);
    check_config(config);
    if (newcomm == nullptr) throw Failure(ncclInvalidArgument, "newcomm is NULL");
    if (color < 0 && color != NCCL_SPLIT_NOCOLOR) {
      throw Failure(ncclInvalidArgument, format("color %d is negative", color));
    }
    *newcomm = nullptr;
    return standin::submit(standin::make_split(comm, color, key, newcomm));
  });
}
STANDIN_ALIAS(ncclCommSplit)

// The excluded ranks do not call this (they are presumed gone), so it needs no exchange: the
// survivors keep their relative order, and the child's name comes from the parent's name, its
// shrink count and the excluded list, which every survivor passes alike.
STANDIN_API ncclResult_t pncclCommShrink(ncclComm_t comm, int* excludeRanksList,
                                         int excludeRanksCount, ncclComm_t* newcomm,
                                         ncclConfig_t* config, int) {
  return api_edge("ncclCommShrink", [&] {
    if (comm == nullptr || newcomm == nullptr) throw Failure(ncclInvalidArgument, "NULL argument");
    check_config(config);
    if (excludeRanksCount < 0 || (excludeRanksCount > 0 && excludeRanksList == nullptr)) {
      throw Failure(ncclInvalidArgument, "bad exclude list");
    }
    std::vector<int> excluded(excludeRanksList, excludeRanksList + excludeRanksCount);
    std::sort(excluded.begin(), excluded.end());
    excluded.erase(std::unique(excluded.begin(), excluded.end()), excluded.end());
    std::string listed;
    for (int r : excluded) {
      if (r < 0 || r >= comm->nranks) {
        throw Failure(ncclInvalidArgument,
                      format("excluded rank %d is not in the communicator", r));
      }
      if (r == comm->rank)
        throw Failure(ncclInvalidUsage, "an excluded rank called ncclCommShrink");
      listed += format("%d,", r);
    }
    const int survivors = comm->nranks - static_cast<int>(excluded.size());
    const int new_rank =
        comm->rank -
        static_cast<int>(std::lower_bound(excluded.begin(), excluded.end(), comm->rank) -
                         excluded.begin());
    const std::string name = standin::child_segment_name(
        comm->segment->name(),
        format("shrink %llu excluding %s", static_cast<unsigned long long>(comm->shrinks++),
               listed.c_str()));
    ncclComm* child = standin::join_communicator(name, survivors, new_rank, comm->cuda_device);
    *newcomm = child;
    return standin::submit(standin::make_join_wait(child));
  });
}
STANDIN_ALIAS(ncclCommShrink)

// Work completes before each call returns, so there is nothing left to flush.
STANDIN_API ncclResult_t pncclCommFinalize(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  comm->finalized = true;
  return ncclSuccess;
}
STANDIN_ALIAS(ncclCommFinalize)

// The segment's name went away when the last rank joined; the mapping goes with the last
// reference, and peers keep their own mappings.
STANDIN_API ncclResult_t pncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  delete comm;
  return ncclSuccess;
}
STANDIN_ALIAS(ncclCommDestroy)

// NCCL lets another thread abort a communicator while a call on it is blocked (a watchdog): the
// call then returns an error. So the object is not freed: it stays, reachable, marked aborted.
STANDIN_API ncclResult_t pncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclInvalidArgument;
  static std::mutex aborted_mutex;
  static auto* aborted = new std::vector<ncclComm_t>();
  comm->aborted.store(true);
  (void)standin::advance_join(comm);  // a join in progress gives up (its name goes)
  if (comm->segment) comm->segment->abort_here();
  std::lock_guard<std::mutex> lock(aborted_mutex);
  aborted->push_back(comm);
  return ncclSuccess;
}
STANDIN_ALIAS(ncclCommAbort)

STANDIN_API ncclResult_t pncclCommRevoke(ncclComm_t comm, int revokeFlags) {
  if (comm == nullptr || revokeFlags != NCCL_REVOKE_DEFAULT) return ncclInvalidArgument;
  comm->revoked = true;
  return ncclSuccess;
}
STANDIN_ALIAS(ncclCommRevoke)

STANDIN_API ncclResult_t pncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}
STANDIN_ALIAS(ncclCommCount)

STANDIN_API ncclResult_t pncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}
STANDIN_ALIAS(ncclCommUserRank)

STANDIN_API ncclResult_t pncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (comm == nullptr || device == nullptr) return ncclInvalidArgument;
  *device = comm->cuda_device;
  return ncclSuccess;
}
STANDIN_ALIAS(ncclCommCuDevice)

// Nothing runs asynchronously but a non-blocking initialisation, advanced here; a communicator
// broken by a timeout reports it here too.
STANDIN_API ncclResult_t pncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (comm == nullptr || asyncError == nullptr) return ncclInvalidArgument;
  if (comm->joining) {
    *asyncError = standin::advance_join(comm);
    if (*asyncError != ncclSuccess) return ncclSuccess;
  }
  *asyncError = comm->broken.empty() ? ncclSuccess : ncclSystemError;
  return ncclSuccess;
}
STANDIN_ALIAS(ncclCommGetAsyncError)
