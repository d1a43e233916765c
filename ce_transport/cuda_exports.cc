// The CUDA backend's exports (exports.h): cudaMalloc allocations, by the IPC handle of their
// base, asked at plan time (and at propose, for the cap on bound bytes), never on the call path.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/exports.h"

namespace magi::ce::exports {

// Zero-copy: the allocation that holds a shard, exported by the IPC handle of its base (a
// handle names a whole allocation; a handle of an interior pointer would open at the base too).
Exportable find_cuda_export(const void* sendbuf, size_t bytes) {
  Exportable e;
  CUdeviceptr base = 0;
  size_t size = 0;
  const auto at = reinterpret_cast<CUdeviceptr>(sendbuf);
  if (MAGI_CUDA_DRIVER_FN(cuMemGetAddressRange)(&base, &size, at) != CUDA_SUCCESS) {
    e.refusal = "cuMemGetAddressRange refused its address";
    return e;
  }
  if (at + bytes > base + size) {
    e.refusal = "the shard runs past its allocation";
    return e;
  }
  cudaIpcMemHandle_t handle{};
  const cudaError_t got = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
  if (got != cudaSuccess) {
    cudaGetLastError();
    e.refusal = std::string("cudaIpcGetMemHandle: ") + cudaGetErrorName(got) +
                "; memory from cuMemCreate (PyTorch's expandable segments) or from a memory "
                "pool cannot be shared this way";
    return e;
  }
  static_assert(sizeof(handle) == sizeof(e.record.handle));
  std::memcpy(e.record.handle, &handle, sizeof(handle));
  e.record.bytes = size;
  e.base = static_cast<uintptr_t>(base);
  e.identity = identify_buffer(Backend::Cuda, reinterpret_cast<const void*>(base)).allocation_id;
  e.ok = true;
  return e;
}

}  // namespace magi::ce::exports
