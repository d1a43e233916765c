// The real NCCL behind the shim, found at first use, however the program loaded it.
//
// Search order (the first that yields a library other than ourselves wins):
//   1. dlopen("libnccl.so.2", RTLD_NOLOAD): NCCL already loaded under its soname, also when it
//      was loaded RTLD_LOCAL under an extension (PyTorch does this, and there dlsym(RTLD_NEXT)
//      returns NULL);
//   2. dl_iterate_phdr: any loaded object whose file name starts with "libnccl";
//   3. dlsym(RTLD_NEXT): NCCL linked after us in the global scope under another name;
//   4. MAGI_NCCL_LIBRARY: a path the user names, opened RTLD_LOCAL.
// Functions are looked up as pncclX first (NCCL's own aliases, which no other interposer
// overrides), then ncclX. A function the library lacks (an older NCCL, a partial stand-in) stays
// NULL: calling it returns an error with one log line, and never disturbs the others.
#pragma once

#include <nccl.h>

namespace magi::shim {

// Every function the shim forwards: return type, name without the "nccl" prefix, parameters.
#define MAGI_NCCL_FUNCTIONS(X)                                                                    \
  X(ncclResult_t, GetVersion, (int* version))                                                     \
  X(ncclResult_t, GetUniqueId, (ncclUniqueId * id))                                               \
  X(ncclResult_t, CommInitRank, (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank))       \
  X(ncclResult_t, CommInitRankConfig,                                                             \
    (ncclComm_t * comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config))             \
  X(ncclResult_t, CommInitAll, (ncclComm_t * comms, int ndev, const int* devlist))                \
  X(ncclResult_t, CommInitRankScalable,                                                           \
    (ncclComm_t * comm, int nranks, int rank, int nIds, ncclUniqueId* ids, ncclConfig_t* config)) \
  X(ncclResult_t, CommSplit,                                                                      \
    (ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config))             \
  X(ncclResult_t, CommShrink,                                                                     \
    (ncclComm_t comm, int* exclude, int nexclude, ncclComm_t* newcomm, ncclConfig_t* config,      \
     int flags))                                                                                  \
  X(ncclResult_t, CommFinalize, (ncclComm_t comm))                                                \
  X(ncclResult_t, CommDestroy, (ncclComm_t comm))                                                 \
  X(ncclResult_t, CommAbort, (ncclComm_t comm))                                                   \
  X(ncclResult_t, CommRevoke, (ncclComm_t comm, int flags))                                       \
  X(ncclResult_t, CommGetAsyncError, (ncclComm_t comm, ncclResult_t * async_error))               \
  X(ncclResult_t, CommCount, (const ncclComm_t comm, int* count))                                 \
  X(ncclResult_t, CommUserRank, (const ncclComm_t comm, int* rank))                               \
  X(ncclResult_t, CommCuDevice, (const ncclComm_t comm, int* device))                             \
  X(ncclResult_t, AllGather,                                                                      \
    (const void* sendbuf, void* recvbuf, size_t sendcount, ncclDataType_t dtype, ncclComm_t comm, \
     cudaStream_t stream))                                                                        \
  X(ncclResult_t, AllReduce,                                                                      \
    (const void* sendbuf, void* recvbuf, size_t count, ncclDataType_t dtype, ncclRedOp_t op,      \
     ncclComm_t comm, cudaStream_t stream))                                                       \
  X(ncclResult_t, ReduceScatter,                                                                  \
    (const void* sendbuf, void* recvbuf, size_t recvcount, ncclDataType_t dtype, ncclRedOp_t op,  \
     ncclComm_t comm, cudaStream_t stream))                                                       \
  X(ncclResult_t, Broadcast,                                                                      \
    (const void* sendbuf, void* recvbuf, size_t count, ncclDataType_t dtype, int root,            \
     ncclComm_t comm, cudaStream_t stream))                                                       \
  X(ncclResult_t, Bcast,                                                                          \
    (void* buf, size_t count, ncclDataType_t dtype, int root, ncclComm_t comm,                    \
     cudaStream_t stream))                                                                        \
  X(ncclResult_t, Reduce,                                                                         \
    (const void* sendbuf, void* recvbuf, size_t count, ncclDataType_t dtype, ncclRedOp_t op,      \
     int root, ncclComm_t comm, cudaStream_t stream))                                             \
  X(ncclResult_t, AlltoAll,                                                                       \
    (const void* sendbuf, void* recvbuf, size_t count, ncclDataType_t dtype, ncclComm_t comm,     \
     cudaStream_t stream))                                                                        \
  X(ncclResult_t, Gather,                                                                         \
    (const void* sendbuf, void* recvbuf, size_t count, ncclDataType_t dtype, int root,            \
     ncclComm_t comm, cudaStream_t stream))                                                       \
  X(ncclResult_t, Scatter,                                                                        \
    (const void* sendbuf, void* recvbuf, size_t count, ncclDataType_t dtype, int root,            \
     ncclComm_t comm, cudaStream_t stream))                                                       \
  X(ncclResult_t, Send,                                                                           \
    (const void* sendbuf, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm,          \
     cudaStream_t stream))                                                                        \
  X(ncclResult_t, Recv,                                                                           \
    (void* recvbuf, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm,                \
     cudaStream_t stream))                                                                        \
  X(ncclResult_t, GroupStart, ())                                                                 \
  X(ncclResult_t, GroupEnd, ())                                                                   \
  X(ncclResult_t, GroupSimulateEnd, (ncclSimInfo_t * info))

struct RealNccl {
#define MAGI_REAL_NCCL_POINTER(ret, name, params) ret(*name) params = nullptr;
  MAGI_NCCL_FUNCTIONS(MAGI_REAL_NCCL_POINTER)
#undef MAGI_REAL_NCCL_POINTER
  bool found = false;
  const char* how = "";  // which search step found it, for the log
  char path[512] = "";
};

// The real NCCL; resolved once, thread-safe. Never NULL; `found` says whether anything was found.
const RealNccl& real_nccl();

// Called when a program calls a function the real library lacks: logs once per function and
// returns the error code to give back.
ncclResult_t missing_function(const char* name);

}  // namespace magi::shim
