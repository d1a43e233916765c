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

// The allocation mapped at `p`, or 0 where none is (cudaMalloc memory, a hole, an address
// outside any mapping); the handle is not kept.
CUmemGenericAllocationHandle allocation_at(CUdeviceptr p) {
  Retained r;
  if (MAGI_CUDA_DRIVER_FN(cuMemRetainAllocationHandle)(&r.handle, reinterpret_cast<void*>(p)) !=
      CUDA_SUCCESS)
    return 0;
  r.held = true;
  return r.handle;
}

// cuMemCreate memory under [at, at + bytes): the physical allocations mapped there, walked in
// order. Where one allocation's mapping begins and ends is found by asking which allocation is
// mapped at each granule (mappings are granule-aligned): cuMemGetAddressRange alone may name the
// whole reserved range, which holds many (PyTorch's expandable segments map each 2 MiB or 20 MiB
// granule on its own). An allocation made without the POSIX file descriptor handle type, or not
// on a device, is refused, with the reason.
bool walk_pieces(CUdeviceptr at, size_t bytes, Exportable& e) {
  size_t granularity = 0;
  for (CUdeviceptr p = at; p < at + bytes;) {
    // The range the driver knows p in (one mapping, or the whole reserved range): the walk
    // stays inside it.
    CUdeviceptr range_base = 0;
    size_t range_size = 0;
    if (MAGI_CUDA_DRIVER_FN(cuMemGetAddressRange)(&range_base, &range_size, p) != CUDA_SUCCESS) {
      e.refusal = "cuMemGetAddressRange refused an address inside the shard";
      return false;
    }
    const CUdeviceptr range_end = range_base + range_size;
    const CUmemGenericAllocationHandle handle = allocation_at(p);
    if (handle == 0) {
      e.refusal =
          "neither cudaIpcGetMemHandle nor cuMemRetainAllocationHandle takes it (memory "
          "from a pool, managed memory, or a hole in a reserved range)";
      return false;
    }
    if (granularity == 0) {
      CUmemAllocationProp prop{};
      if (MAGI_CUDA_DRIVER_FN(cuMemGetAllocationPropertiesFromHandle)(&prop, handle) !=
          CUDA_SUCCESS) {
        e.refusal = "cuMemGetAllocationPropertiesFromHandle refused its cuMemCreate allocation";
        return false;
      }
      if ((prop.requestedHandleTypes & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) == 0) {
        e.refusal =
            "a cuMemCreate allocation made without the POSIX file descriptor handle type "
            "(requestedHandleTypes), so no other process can map it";
        return false;
      }
      if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE) {
        e.refusal = "a cuMemCreate allocation that is not device memory";
        return false;
      }
      if (MAGI_CUDA_DRIVER_FN(cuMemGetAllocationGranularity)(
              &granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS ||
          granularity == 0) {
        e.refusal = "cuMemGetAllocationGranularity refused its cuMemCreate allocation";
        return false;
      }
    }
    // This allocation's mapping: back and forth from p, a granule at a time, inside the range.
    CUdeviceptr begin = p / granularity * granularity;
    if (e.pieces.empty()) {
      while (begin >= range_base + granularity && allocation_at(begin - granularity) == handle)
        begin -= granularity;
    } else if (begin != p) {
      e.refusal = "a cuMemCreate mapping under the shard is not granule-aligned";
      return false;
    }
    CUdeviceptr end = begin + granularity;
    while (end < range_end && allocation_at(end) == handle) end += granularity;
    e.pieces.emplace_back(static_cast<uintptr_t>(begin), static_cast<size_t>(end - begin));
    p = end;
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
      e.refusal =
          std::string("cudaIpcGetMemHandle: ") + cudaGetErrorName(got) + ", and " + e.refusal;
      return e;
    }
    e.base = e.pieces.front().first;
    e.record.kind = ExportRecord::Kind::ByDescriptor;
    e.record.bytes = e.pieces.back().first + e.pieces.back().second - e.base;
    e.identity =
        identify_buffer(Backend::Cuda, reinterpret_cast<const void*>(e.base)).allocation_id;
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
