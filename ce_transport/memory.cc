// Which memory a buffer is, and where this process runs: the facts rewrite/ checks before a
// gather may leave NCCL.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <climits>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>

#include "base/cuda_driver.h"
#include "base/host.h"
#include "ce_transport/backends.h"
#include "ce_transport/ce_transport.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace magi::ce {

BufferIdentity identify_cuda_buffer(const void* ptr) {
  // Asked at each call: the program may load the driver after us.
  const CudaDriver* driver = cuda_driver();
  const auto get = driver != nullptr ? driver->cuPointerGetAttributes_fn : nullptr;
  if (get == nullptr) return {};
  CUpointer_attribute attributes[] = {
      CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED,
      CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  // The attributes are unsigned int, bool, unsigned long long and int: each gets a zeroed 8-byte
  // word, so whatever width the driver writes, the low bytes read back right (little-endian).
  uint64_t memory_type = 0, is_managed = 0, buffer_id = 0, ordinal = 0;
  void* data[] = {&memory_type, &is_managed, &buffer_id, &ordinal};
  if (get(static_cast<unsigned>(std::size(attributes)), attributes, data,
          reinterpret_cast<CUdeviceptr>(ptr)) != CUDA_SUCCESS)
    return {};
  int32_t device = 0;
  std::memcpy(&device, &ordinal, sizeof(device));
  BufferIdentity id;
  id.allocation_id = buffer_id;
  if (is_managed != 0) {
    id.kind = MemoryKind::Managed;
    id.device = device;
  } else if (static_cast<uint32_t>(memory_type) == CU_MEMORYTYPE_DEVICE) {
    id.kind = MemoryKind::Device;
    id.device = device;
  } else {
    // CU_MEMORYTYPE_HOST (pinned) or 0: memory CUDA does not know, i.e. pageable host memory.
    id.kind = MemoryKind::Host;
  }
  return id;
}

// Equal for processes that share a machine and its current boot, so shared memory between them
// is real. The machine is machine_name(): a test may make ranks of one host differ here.
uint64_t host_fingerprint() {
  std::string key(machine_name());
  key.push_back('\n');
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  key.append(std::istreambuf_iterator<char>(boot), std::istreambuf_iterator<char>());
  return XXH3_64bits(key.data(), key.size());
}

// Only with the driver already loaded: the runtime would otherwise start CUDA.
uint64_t peer_access_mask(int device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  uint64_t mask = 0;
  for (int d = 0; d < count && d < 64; ++d) {
    int can = 0;
    if (d == device) {
      can = 1;
    } else if (cudaDeviceCanAccessPeer(&can, device, d) != cudaSuccess) {
      (void)cudaGetLastError();
      can = 0;
    }
    if (can != 0) mask |= uint64_t{1} << d;
  }
  return mask;
}

}  // namespace magi::ce
