// One allocation that holds several buffers (a rank's weight shards), each at an offset rounded
// up to 256 bytes, as PyTorch's caching allocator puts several tensors in one cudaMalloc
// segment. What kind of memory it is decides whether a peer can read a shard where it lies:
//   SharedFile  host memory: a MAP_SHARED mapping of a file in /dev/shm ("/magi-arena-<pid>"; a
//               process's further arenas "/magi-arena-<pid>.<index>"),
//               kept under its name while the arena lives so a peer can open and map it, and
//               unlinked when the arena goes, however the scenario ends (only a rank killed by a
//               signal leaves it behind)
//   CudaMalloc  one cudaMalloc on the current device (legacy IPC exports its base)
//   CudaVmm     one cuMemCreate allocation reserved, mapped and made accessible with the driver's
//               virtual memory calls, as PyTorch's expandable segments are: legacy IPC refuses it
#pragma once

#include <cstddef>
#include <string>

#include "tests/support/workload/scenario.h"

namespace workload {

class Arena {
 public:
  enum class Kind { SharedFile, CudaMalloc, CudaVmm };
  static constexpr size_t kAlignment = 256;

  // Room for `bytes` (rounded up to what the memory is allocated in). SharedFile needs host
  // placement, the others device placement; the placement must outlive the arena. `index` tells
  // a process's arenas apart (SharedFile: "/magi-arena-<pid>", then "/magi-arena-<pid>.<index>").
  Arena(const Placement& placement, Kind kind, size_t bytes, int index = 0);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // The next `bytes` of the arena, at an offset rounded up to kAlignment, as a Buffer that lends
  // them (its host side is its own with device placement). The Buffer must go before the arena.
  Buffer carve(size_t bytes);

  static size_t aligned(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

 private:
  void release() noexcept;

  const Placement& placement_;
  Kind kind_;
  size_t capacity_ = 0;  // bytes allocated (a whole number of pages or granules)
  size_t used_ = 0;
  void* base_ = nullptr;
  std::string file_name_;                  // SharedFile: the name shm_open knows it by
  unsigned long long vmm_allocation_ = 0;  // CudaVmm: the physical allocation's handle
  bool vmm_mapped_ = false;                // CudaVmm: the allocation is mapped at base_
};

}  // namespace workload
