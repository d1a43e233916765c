// Collectives, Send/Recv and groups. Each call is checked here, then becomes an Operation that
// runs now or at the outermost ncclGroupEnd (group.h). The work is done on the calling thread;
// the stream matters only for device buffers, which are staged through host memory on it
// (device_memory.h).
#include <nccl.h>

#include "tests/support/standin/comm.h"
#include "tests/support/standin/device_memory.h"
#include "tests/support/standin/elements.h"
#include "tests/support/standin/export.h"
#include "tests/support/standin/group.h"
#include "tests/support/standin/operation.h"
#include "tests/support/standin/report.h"

using standin::api_edge;
using standin::CollectiveArgs;
using standin::Failure;
using standin::format;
using standin::OpKind;

namespace {

void check_buffer(const void* buffer, size_t count, bool used, const char* what) {
  if (used && count != 0 && buffer == nullptr) {
    throw Failure(ncclInvalidArgument, format("%s is NULL", what));
  }
}

ncclResult_t collective(const char* entry_point, ncclComm_t comm, const CollectiveArgs& a,
                        cudaStream_t stream) {
  return api_edge(entry_point, [&] {
    standin::check_usable(comm);
    if (!standin::valid_datatype(a.dtype)) {
      throw Failure(ncclInvalidArgument, format("datatype %d is not an NCCL datatype", a.dtype));
    }
    if (a.redop != -1 && !standin::valid_redop(a.redop)) {
      throw Failure(ncclInvalidArgument,
                    format("reduction op %d is not built in (user-made ops are not supported by "
                           "the stand-in)",
                           a.redop));
    }
    if (a.root != -1 && (a.root < 0 || a.root >= comm->nranks)) {
      throw Failure(ncclInvalidArgument,
                    format("root %d is not in 0..%d", a.root, comm->nranks - 1));
    }
    const bool is_root = comm->rank == a.root;
    bool sends = true;
    bool receives = true;
    switch (a.kind) {
      case OpKind::Broadcast:
      case OpKind::Scatter: sends = is_root; break;
      case OpKind::Reduce:
      case OpKind::Gather: receives = is_root; break;
      default: break;
    }
    check_buffer(a.sendbuf, a.count, sends, "sendbuff");
    check_buffer(a.recvbuf, a.count, receives, "recvbuff");
    return standin::submit(standin::collective_on_any_memory(comm, a, sends, receives, stream));
  });
}

ncclResult_t point_to_point(const char* entry_point, ncclComm_t comm, bool sending, void* buffer,
                            size_t count, ncclDataType_t dtype, int peer, cudaStream_t stream) {
  return api_edge(entry_point, [&] {
    standin::check_usable(comm);
    if (!standin::valid_datatype(dtype)) {
      throw Failure(ncclInvalidArgument, format("datatype %d is not an NCCL datatype", dtype));
    }
    if (peer < 0 || peer >= comm->nranks) {
      throw Failure(ncclInvalidArgument, format("peer %d is not in 0..%d", peer, comm->nranks - 1));
    }
    check_buffer(buffer, count, true, sending ? "sendbuff" : "recvbuff");
    return standin::submit(
        standin::transfer_on_any_memory(comm, sending, buffer, count, dtype, peer, stream));
  });
}

}  // namespace

STANDIN_API ncclResult_t pncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                        ncclDataType_t datatype, ncclComm_t comm,
                                        cudaStream_t stream) {
  return collective("ncclAllGather", comm,
                    {OpKind::AllGather, sendbuff, recvbuff, sendcount, datatype, -1, -1}, stream);
}
STANDIN_ALIAS(ncclAllGather)

STANDIN_API ncclResult_t pncclAllReduce(const void* sendbuff, void* recvbuff, size_t count,
                                        ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                        cudaStream_t stream) {
  return collective("ncclAllReduce", comm,
                    {OpKind::AllReduce, sendbuff, recvbuff, count, datatype, -1, op}, stream);
}
STANDIN_ALIAS(ncclAllReduce)

STANDIN_API ncclResult_t pncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                            ncclDataType_t datatype, ncclRedOp_t op,
                                            ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclReduceScatter", comm,
                    {OpKind::ReduceScatter, sendbuff, recvbuff, recvcount, datatype, -1, op},
                    stream);
}
STANDIN_ALIAS(ncclReduceScatter)

STANDIN_API ncclResult_t pncclBroadcast(const void* sendbuff, void* recvbuff, size_t count,
                                        ncclDataType_t datatype, int root, ncclComm_t comm,
                                        cudaStream_t stream) {
  return collective("ncclBroadcast", comm,
                    {OpKind::Broadcast, sendbuff, recvbuff, count, datatype, root, -1}, stream);
}
STANDIN_ALIAS(ncclBroadcast)

// As in NCCL itself, ncclBcast calls the public ncclBroadcast. That call goes through the PLT, so
// a shim in front of the library sees it as a second NCCL call, made from inside the first;
// the shim must not take it for one of the program's.
STANDIN_API ncclResult_t pncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root,
                                    ncclComm_t comm, cudaStream_t stream) {
  return ncclBroadcast(buff, buff, count, datatype, root, comm, stream);
}
STANDIN_ALIAS(ncclBcast)

STANDIN_API ncclResult_t pncclReduce(const void* sendbuff, void* recvbuff, size_t count,
                                     ncclDataType_t datatype, ncclRedOp_t op, int root,
                                     ncclComm_t comm, cudaStream_t stream) {
  return collective("ncclReduce", comm,
                    {OpKind::Reduce, sendbuff, recvbuff, count, datatype, root, op}, stream);
}
STANDIN_ALIAS(ncclReduce)

STANDIN_API ncclResult_t pncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count,
                                       ncclDataType_t datatype, ncclComm_t comm,
                                       cudaStream_t stream) {
  return collective("ncclAlltoAll", comm,
                    {OpKind::AlltoAll, sendbuff, recvbuff, count, datatype, -1, -1}, stream);
}
STANDIN_ALIAS(ncclAlltoAll)

STANDIN_API ncclResult_t pncclGather(const void* sendbuff, void* recvbuff, size_t count,
                                     ncclDataType_t datatype, int root, ncclComm_t comm,
                                     cudaStream_t stream) {
  return collective("ncclGather", comm,
                    {OpKind::Gather, sendbuff, recvbuff, count, datatype, root, -1}, stream);
}
STANDIN_ALIAS(ncclGather)

STANDIN_API ncclResult_t pncclScatter(const void* sendbuff, void* recvbuff, size_t count,
                                      ncclDataType_t datatype, int root, ncclComm_t comm,
                                      cudaStream_t stream) {
  return collective("ncclScatter", comm,
                    {OpKind::Scatter, sendbuff, recvbuff, count, datatype, root, -1}, stream);
}
STANDIN_ALIAS(ncclScatter)

STANDIN_API ncclResult_t pncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype,
                                   int peer, ncclComm_t comm, cudaStream_t stream) {
  return point_to_point("ncclSend", comm, true, const_cast<void*>(sendbuff), count, datatype, peer,
                        stream);
}
STANDIN_ALIAS(ncclSend)

STANDIN_API ncclResult_t pncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                                   ncclComm_t comm, cudaStream_t stream) {
  return point_to_point("ncclRecv", comm, false, recvbuff, count, datatype, peer, stream);
}
STANDIN_ALIAS(ncclRecv)

STANDIN_API ncclResult_t pncclGroupStart() {
  standin::group_start();
  return ncclSuccess;
}
STANDIN_ALIAS(ncclGroupStart)

STANDIN_API ncclResult_t pncclGroupEnd() {
  return api_edge("ncclGroupEnd", [] { return standin::group_end(); });
}
STANDIN_ALIAS(ncclGroupEnd)

STANDIN_API ncclResult_t pncclGroupSimulateEnd(ncclSimInfo_t* simInfo) {
  return api_edge("ncclGroupSimulateEnd", [&] {
    if (simInfo != nullptr) simInfo->estimatedTime = 0.0f;
    return standin::group_simulate_end();
  });
}
STANDIN_ALIAS(ncclGroupSimulateEnd)
