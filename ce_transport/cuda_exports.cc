// The CUDA backend's exports (exports.h): cudaMalloc allocations, by the IPC handle of their
// base, and cuMemCreate allocations made shareable as file descriptors, walked piece by piece;
// asked at plan time (and at propose, for the cap on bound bytes), never on the call path.
// Nothing here exports a descriptor: the backend does, when a peer asks (cuda_memory_ops.cc).
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/exports.h"

namespace magi::ce::exports {

namespace {

// A retained allocation handle, released when it goes.
struct Retained {
  CUmemGenericAllocationHandle handle = 0;
  bool held = false;
  ~Retained() {
    if (held) MAGI_CUDA_DRIVER_FN(cuMemRelease)(handle);
  }
};

// cuMemCreate memory under [at, at + bytes): the physical allocations mapped there, walked in
// order. cuMemGetAddressRange names the mapping that holds an address (one allocation's, as
// PyTorch's expandable segments map each 2 MiB or 20 MiB granule on its own); a range it gives
// that holds more than one allocation, a piece mapped from an offset into its allocation, or an
// allocation made without the POSIX file descriptor handle type are refused, with the reason.
bool walk_pieces(CUdeviceptr at, size_t bytes, Exportable& e) {
  const CUdeviceptr end = at + bytes;
  for (CUdeviceptr p = at; p < end;) {
    CUdeviceptr base = 0;
    size_t size = 0;
    if (MAGI_CUDA_DRIVER_FN(cuMemGetAddressRange)(&base, &size, p) != CUDA_SUCCESS || base > p ||
        size == 0) {
      e.refusal = "cuMemGetAddressRange refused an address inside the shard";
      return false;
    }
    Retained first, last;
    if (MAGI_CUDA_DRIVER_FN(cuMemRetainAllocationHandle)(
            &first.handle, reinterpret_cast<void*>(base)) != CUDA_SUCCESS) {
      e.refusal = "neither cudaIpcGetMemHandle nor cuMemRetainAllocationHandle takes it (memory "
                  "from a pool, or managed memory)";
      return false;
    }
    first.held = true;
    CUmemAllocationProp prop{};
    if (MAGI_CUDA_DRIVER_FN(cuMemGetAllocationPropertiesFromHandle)(&prop, first.handle) !=
        CUDA_SUCCESS) {
      e.refusal = "cuMemGetAllocationPropertiesFromHandle refused its cuMemCreate allocation";
      return false;
    }
    if ((prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
      e.refusal = "a cuMemCreate allocation made without the POSIX file descriptor handle type "
                  "(requestedHandleTypes), so no other process can map it";
      return false;
    }
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
      e.refusal = "a cuMemCreate allocation that is not device memory";
      return false;
    }
    if (MAGI_CUDA_DRIVER_FN(cuMemRetainAllocationHandle)(
            &last.handle, reinterpret_cast<void*>(base + size - 1)) != CUDA_SUCCESS) {
      e.refusal = "cuMemRetainAllocationHandle refused the end of a mapping under the shard";
      return false;
    }
    last.held = true;
    if (last.handle != first.handle) {
      e.refusal = "cuMemGetAddressRange gives a range of more than one cuMemCreate allocation";
      return false;
    }
    if (!e.pieces.empty() && e.pieces.back().first + e.pieces.back().second != base) {
      e.refusal = "the shard's cuMemCreate mappings are not contiguous";
      return false;
    }
    e.pieces.emplace_back(static_cast<uintptr_t>(base), size);
    p = base + size;
  }
  return !e.pieces.empty();
}

}  // namespace

// Zero-copy: the allocation that holds a shard, exported by the IPC handle of its base (a
// handle names a whole allocation; a handle of an interior pointer would open at the base too);
// where legacy IPC refuses, the cuMemCreate allocations under the shard, by descriptor.
Exportable find_cuda_export(const void* sendbuf, size_t bytes) {
  Exportable e;
  CUdeviceptr base = 0;
  size_t size = 0;
  const auto at = reinterpret_cast<CUdeviceptr>(sendbuf);
  if (MAGI_CUDA_DRIVER_FN(cuMemGetAddressRange)(&base, &size, at) != CUDA_SUCCESS) {
    e.refusal = "cuMemGetAddressRange refused its address";
    return e;
  }
  cudaIpcMemHandle_t handle{};
  const cudaError_t got = cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base));
  if (got != cudaSuccess) {
    cudaGetLastError();
    if (!walk_pieces(at, bytes, e)) {
      e.pieces.clear();
      e.refusal = std::string("cudaIpcGetMemHandle: ") + cudaGetErrorName(got) + ", and " +
                  e.refusal;
      return e;
    }
    e.base = e.pieces.front().first;
    e.record.kind = ExportRecord::Kind::ByDescriptor;
    e.record.bytes = e.pieces.back().first + e.pieces.back().second - e.base;
    e.identity = identify_buffer(Backend::Cuda, reinterpret_cast<const void*>(e.base)).allocation_id;
    e.ok = true;
    return e;
  }
  if (at + bytes > base + size) {
    e.refusal = "the shard runs past its allocation";
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
