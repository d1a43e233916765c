// The CUDA driver, reached only once the program has loaded it, and CUDA's one error check.
//
// The library must never start CUDA on its own: a process without a GPU, or one that has not
// touched CUDA yet, must stay that way. So every driver entry point is looked up through the
// runtime (cudaGetDriverEntryPointByVersion) only after libcuda.so.1 is in the process already,
// and each is declared once below, with the ABI version it is asked for (NCCL's cudawrap.h).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

namespace magi {

// Every driver entry point the library calls: name, its function type, the CUDA version asked.
// cuStreamBatchMemOp is asked at 12.0, where 64-bit waits and writes need no opt-in. The
// stream, context, event and host-function calls serve the flight recorder's completion
// (capture/completion.h).
#define MAGI_CUDA_DRIVER_ENTRY_POINTS(X)                                                       \
  X(cuGetErrorName, PFN_cuGetErrorName_v6000, 6000)                                            \
  X(cuDeviceGet, PFN_cuDeviceGet_v2000, 2000)                                                  \
  X(cuDeviceGetUuid, PFN_cuDeviceGetUuid_v11040, 11040)                                        \
  X(cuStreamIsCapturing, PFN_cuStreamIsCapturing_v10000, 10000)                                \
  X(cuPointerGetAttributes, PFN_cuPointerGetAttributes_v7000, 7000)                            \
  X(cuMemGetAddressRange, PFN_cuMemGetAddressRange_v3020, 3020)                                \
  X(cuStreamBatchMemOp, PFN_cuStreamBatchMemOp_v11070, 12000)                                  \
  X(cuStreamGetCtx, PFN_cuStreamGetCtx_v9020, 9020)                                            \
  X(cuCtxGetCurrent, PFN_cuCtxGetCurrent_v4000, 4000)                                          \
  X(cuCtxSetCurrent, PFN_cuCtxSetCurrent_v4000, 4000)                                          \
  X(cuCtxPushCurrent, PFN_cuCtxPushCurrent_v4000, 4000)                                        \
  X(cuCtxPopCurrent, PFN_cuCtxPopCurrent_v4000, 4000)                                          \
  X(cuEventCreate, PFN_cuEventCreate_v2000, 2000)                                              \
  X(cuEventRecord, PFN_cuEventRecord_v2000, 2000)                                              \
  X(cuEventQuery, PFN_cuEventQuery_v2000, 2000)                                                \
  X(cuLaunchHostFunc, PFN_cuLaunchHostFunc_v10000, 10000)                                      \
  X(cuThreadExchangeStreamCaptureMode, PFN_cuThreadExchangeStreamCaptureMode_v10010, 10010)    \
  X(cuMemRetainAllocationHandle, PFN_cuMemRetainAllocationHandle_v11000, 11000)                \
  X(cuMemGetAllocationPropertiesFromHandle, PFN_cuMemGetAllocationPropertiesFromHandle_v10020, \
    10020)                                                                                     \
  X(cuMemExportToShareableHandle, PFN_cuMemExportToShareableHandle_v10020, 10020)              \
  X(cuMemImportFromShareableHandle, PFN_cuMemImportFromShareableHandle_v10020, 10020)          \
  X(cuMemGetAllocationGranularity, PFN_cuMemGetAllocationGranularity_v10020, 10020)            \
  X(cuMemAddressReserve, PFN_cuMemAddressReserve_v10020, 10020)                                \
  X(cuMemAddressFree, PFN_cuMemAddressFree_v10020, 10020)                                      \
  X(cuMemMap, PFN_cuMemMap_v10020, 10020)                                                      \
  X(cuMemUnmap, PFN_cuMemUnmap_v10020, 10020)                                                  \
  X(cuMemSetAccess, PFN_cuMemSetAccess_v10020, 10020)                                          \
  X(cuMemRelease, PFN_cuMemRelease_v10020, 10020)

// One pointer per entry point, named after it (`cuStreamBatchMemOp_fn`); nullptr where the
// driver lacks it. The `##` keeps cuda.h's renaming macros (cuMemGetAddressRange ->
// cuMemGetAddressRange_v2) out of the member names.
struct CudaDriver {
#define MAGI_CUDA_DRIVER_MEMBER(name, type, version) type name##_fn = nullptr;
  MAGI_CUDA_DRIVER_ENTRY_POINTS(MAGI_CUDA_DRIVER_MEMBER)
#undef MAGI_CUDA_DRIVER_MEMBER
};

// True when libcuda.so.1 is already loaded (dlopen RTLD_NOLOAD); never loads it. Cheap while it
// is absent: asked again only once the loader has loaded something new.
bool cuda_driver_loaded();

// The driver's entry points, looked up once (thread-safe) the first time this is asked with the
// driver loaded; nullptr while it is not (a later call looks again: the program may load it
// after us). Off the call path for the first call; an atomic load after.
const CudaDriver* cuda_driver();

// The entry point `name` of the driver, or an Error(Cuda) naming it when the driver is not
// loaded or lacks it: MAGI_CUDA_DRIVER_FN(cuStreamBatchMemOp)(stream, ...).
[[noreturn]] void cuda_driver_missing(const char* name);
#define MAGI_CUDA_DRIVER_FN(name) \
  (::magi::cuda_driver_fn([](const ::magi::CudaDriver& d) { return d.name##_fn; }, #name))
template <class Pick>
auto cuda_driver_fn(Pick pick, const char* name) {
  const CudaDriver* driver = cuda_driver();
  const auto fn = driver != nullptr ? pick(*driver) : nullptr;
  if (fn == nullptr) cuda_driver_missing(name);
  return fn;
}

// The one check of a CUDA call. A failure clears the runtime's last error (it would otherwise
// be reported to the program's next cudaGetLastError as if it were the program's own), then
// throws Error(ErrorKind::Cuda) naming `what` (the call, and what it was for) and the error.
void cuda_check(cudaError_t err, const char* what);
// The same for a driver call's result (the driver keeps no last error).
void cuda_check(CUresult result, const char* what);

}  // namespace magi
