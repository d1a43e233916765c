// Entry points that touch no communicator state: version, ids, errors, memory, registration.
#include <nccl.h>

#include <cstdlib>
#include <cstring>

#include "tests/support/standin/comm.h"
#include "tests/support/standin/export.h"
#include "tests/support/standin/report.h"

using standin::api_edge;
using standin::Failure;

STANDIN_API ncclResult_t pncclGetVersion(int* version) {
  return api_edge("ncclGetVersion", [&] {
    if (version == nullptr) throw Failure(ncclInvalidArgument, "version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
  });
}
STANDIN_ALIAS(ncclGetVersion)

STANDIN_API ncclResult_t pncclGetUniqueId(ncclUniqueId* uniqueId) {
  return api_edge("ncclGetUniqueId", [&] {
    if (uniqueId == nullptr) throw Failure(ncclInvalidArgument, "uniqueId is NULL");
    *uniqueId = standin::make_unique_id();
    return ncclSuccess;
  });
}
STANDIN_ALIAS(ncclGetUniqueId)

STANDIN_API const char* pncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error (see stderr)";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument (see ncclGetLastError)";
    case ncclInvalidUsage: return "invalid usage (see ncclGetLastError)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}
STANDIN_ALIAS(ncclGetErrorString)

STANDIN_API const char* pncclGetLastError(ncclComm_t) { return standin::last_error(); }
STANDIN_ALIAS(ncclGetLastError)

STANDIN_API ncclResult_t pncclMemAlloc(void** ptr, size_t size) {
  return api_edge("ncclMemAlloc", [&] {
    if (ptr == nullptr) throw Failure(ncclInvalidArgument, "ptr is NULL");
    // Page-aligned, like the granularity real NCCL rounds to, so windows can use it.
    if (posix_memalign(ptr, 4096, size == 0 ? 1 : size) != 0) {
      throw Failure(ncclSystemError, "out of memory");
    }
    return ncclSuccess;
  });
}
STANDIN_ALIAS(ncclMemAlloc)

STANDIN_API ncclResult_t pncclMemFree(void* ptr) {
  std::free(ptr);
  return ncclSuccess;
}
STANDIN_ALIAS(ncclMemFree)

// Registration only matters to GPU transports; the stand-in accepts and forgets it.
STANDIN_API ncclResult_t pncclCommRegister(const ncclComm_t comm, void* buff, size_t,
                                           void** handle) {
  return api_edge("ncclCommRegister", [&] {
    if (comm == nullptr || handle == nullptr) throw Failure(ncclInvalidArgument, "NULL argument");
    *handle = buff;
    return ncclSuccess;
  });
}
STANDIN_ALIAS(ncclCommRegister)

STANDIN_API ncclResult_t pncclCommDeregister(const ncclComm_t comm, void*) {
  return comm == nullptr ? ncclInvalidArgument : ncclSuccess;
}
STANDIN_ALIAS(ncclCommDeregister)

STANDIN_API ncclResult_t pncclCommWindowRegister(ncclComm_t comm, void* buff, size_t,
                                                 ncclWindow_t* win, int) {
  return api_edge("ncclCommWindowRegister", [&] {
    if (comm == nullptr || win == nullptr) throw Failure(ncclInvalidArgument, "NULL argument");
    *win = reinterpret_cast<ncclWindow_t>(buff);
    return ncclSuccess;
  });
}
STANDIN_ALIAS(ncclCommWindowRegister)

STANDIN_API ncclResult_t pncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t) {
  return comm == nullptr ? ncclInvalidArgument : ncclSuccess;
}
STANDIN_ALIAS(ncclCommWindowDeregister)

STANDIN_API ncclResult_t pncclRedOpCreatePreMulSum(ncclRedOp_t*, void*, ncclDataType_t,
                                                   ncclScalarResidence_t, ncclComm_t) {
  standin::set_last_error("ncclRedOpCreatePreMulSum: not supported by the stand-in");
  return ncclInvalidUsage;
}
STANDIN_ALIAS(ncclRedOpCreatePreMulSum)

STANDIN_API ncclResult_t pncclRedOpDestroy(ncclRedOp_t, ncclComm_t) {
  standin::set_last_error("ncclRedOpDestroy: not supported by the stand-in");
  return ncclInvalidUsage;
}
STANDIN_ALIAS(ncclRedOpDestroy)
