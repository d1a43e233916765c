// One allocation that holds several buffers (a rank's weight shards), each at an offset rounded
// up to 256 bytes, as PyTorch's caching allocator puts several tensors in one cudaMalloc
// segment. A block given back (give_back) is handed out again by the next carve that fits it, the
// last one given back first, as a caching allocator reuses a freed block of its segment for the
// next tensor. What kind of memory it is decides whether a peer can read a shard where it lies:
//   Heap        host memory of this process alone (aligned_alloc): no peer can map it
//   SharedFile  host memory: a MAP_SHARED mapping of a file in /dev/shm (named as
//               arena_name.h says: with the launch's tag and the process's pid), kept under its
//               name while the arena lives so a peer can open and map it, and unlinked when the
//               arena goes, however the scenario ends (a rank killed by a signal leaves it behind;
//               its launcher then removes it)
//   HostMemfd   host memory: a MAP_SHARED mapping of a memfd_create file, which has no name a
//               peer could open; the arena keeps its descriptor open while it lives, as a program
//               that shares such memory does
//   CudaMalloc  one cudaMalloc on the current device (legacy IPC exports its base)
//   CudaVmm     a reserved range mapped granule by granule (2 MiB each, its own cuMemCreate made
//               shareable as a POSIX file descriptor), as PyTorch's expandable segments are: legacy
//               IPC refuses it, a peer maps it from descriptors
//   CudaVmmPrivate  one cuMemCreate allocation made without a shareable handle type: no other
//               process can map it
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "tests/support/workload/scenario.h"

namespace workload {

class Arena {
 public:
  enum class Kind { Heap, SharedFile, HostMemfd, CudaMalloc, CudaVmm, CudaVmmPrivate };
  static constexpr size_t kAlignment = 256;

  // Room for `bytes` (rounded up to what the memory is allocated in). Heap and SharedFile need
  // host placement, the others device placement; the placement must outlive the arena. `index`
  // tells a process's arenas apart (SharedFile: arena_name.h).
  Arena(const Placement& placement, Kind kind, size_t bytes, int index = 0);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // `bytes` of the arena as a Buffer that lends them (its host side is its own with device
  // placement): the block given back last that holds them, else the next bytes at an offset
  // rounded up to kAlignment. The Buffer must go before the arena.
  Buffer carve(size_t bytes);
  // `buffer` (carved from this arena) is free: a later carve may hand its block out again.
  void give_back(Buffer buffer);

  static size_t aligned(size_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

 private:
  void release() noexcept;

  const Placement& placement_;
  Kind kind_;
  size_t capacity_ = 0;  // bytes allocated (a whole number of pages or granules)
  size_t used_ = 0;
  struct Block {
    size_t offset;
    size_t bytes;
  };
  std::vector<Block> free_;  // given back, the last at the end
  void* base_ = nullptr;
  std::string file_name_;  // SharedFile: the name shm_open knows it by
  int memfd_ = -1;         // HostMemfd: its file
  // CudaVmm*: the physical allocations' handles, and the bytes of each mapped from base_ on.
  std::vector<unsigned long long> vmm_allocations_;
  std::vector<size_t> vmm_mapped_;
};

}  // namespace workload
