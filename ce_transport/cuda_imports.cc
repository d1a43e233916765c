// The peers' exported allocations this process maps (zero-copy static weights: exports.h): by
// CUDA IPC handle, or a peer's cuMemCreate pieces by descriptor (fd_channel.h).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/cuda_memory.h"
#include "ce_transport/exports.h"
#include "ce_transport/fd_channel.h"

namespace magi::ce {
namespace {

// A peer's cuMemCreate pieces, imported from their descriptors and mapped one after the other
// into one reserved range, so its shards read as they do at the owner. The mapping holds the
// memory: the imported handles are released once mapped; unmapped and freed by unmap().
struct PieceMapping {
  CUdeviceptr base = 0;
  size_t bytes = 0;
  std::vector<size_t> pieces;  // mapped, in order
  void unmap() {
    size_t at = 0;
    for (size_t size : pieces) {
      MAGI_CUDA_DRIVER_FN(cuMemUnmap)(base + at, size);
      at += size;
    }
    if (base != 0) MAGI_CUDA_DRIVER_FN(cuMemAddressFree)(base, bytes);
    pieces.clear();
    base = 0;
  }
};

PieceMapping map_by_descriptor(const ExportRecord& record, int device) {
  const fd_channel::Address where = exports::descriptor_source(record);
  std::vector<CUmemGenericAllocationHandle> handles;
  PieceMapping m;
  auto release_handles = [&] {
    for (CUmemGenericAllocationHandle h : handles) MAGI_CUDA_DRIVER_FN(cuMemRelease)(h);
    handles.clear();
  };
  try {
    const std::vector<uint8_t> payload =
        fd_channel::fetch(where, record.index, [&](size_t, int fd) {
          CUmemGenericAllocationHandle h = 0;
          const CUresult imported = MAGI_CUDA_DRIVER_FN(cuMemImportFromShareableHandle)(
              &h, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
          ::close(fd);
          cuda_check(imported, "cuMemImportFromShareableHandle (a peer's cuMemCreate shards)");
          handles.push_back(h);
        });
    std::vector<uint64_t> sizes(payload.size() / sizeof(uint64_t));
    std::memcpy(sizes.data(), payload.data(), sizes.size() * sizeof(uint64_t));
    uint64_t total = 0;
    for (uint64_t size : sizes) total += size;
    if (handles.empty() || sizes.size() != handles.size() || total != record.bytes)
      throw Error(ErrorKind::Usage, "a peer's cuMemCreate export came as " +
                                        std::to_string(handles.size()) + " pieces of " +
                                        std::to_string(total) + " bytes, not its record's " +
                                        std::to_string(record.bytes));
    CUmemAllocationProp prop{};
    cuda_check(MAGI_CUDA_DRIVER_FN(cuMemGetAllocationPropertiesFromHandle)(&prop, handles[0]),
               "cuMemGetAllocationPropertiesFromHandle (a peer's piece)");
    size_t granularity = 0;
    cuda_check(MAGI_CUDA_DRIVER_FN(cuMemGetAllocationGranularity)(&granularity, &prop,
                                                                  CU_MEM_ALLOC_GRANULARITY_MINIMUM),
               "cuMemGetAllocationGranularity");
    cuda_check(MAGI_CUDA_DRIVER_FN(cuMemAddressReserve)(&m.base, record.bytes, granularity, 0, 0),
               "cuMemAddressReserve (a peer's cuMemCreate shards)");
    m.bytes = record.bytes;
    size_t at = 0;
    for (size_t i = 0; i < handles.size(); ++i) {
      cuda_check(MAGI_CUDA_DRIVER_FN(cuMemMap)(m.base + at, sizes[i], 0, handles[i], 0),
                 "cuMemMap (a peer's cuMemCreate piece)");
      m.pieces.push_back(sizes[i]);
      at += sizes[i];
    }
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = device;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    cuda_check(MAGI_CUDA_DRIVER_FN(cuMemSetAccess)(m.base, m.bytes, &access, 1),
               "cuMemSetAccess (a peer's cuMemCreate shards)");
    release_handles();  // the mappings hold the memory
    return m;
  } catch (...) {
    m.unmap();
    release_handles();
    throw;
  }
}

// The peers' exported allocations this process has mapped. Process-wide: CUDA maps a handle at
// most once per process ("already mapped" the second time), and two communicators may read the
// same peer allocation. Counted; unmapped when the last reader lets go. An export by descriptor
// is fetched and mapped outside the lock (a peer's channel may take its time); two readers that
// raced map it twice and one mapping goes, which VMM allows (legacy IPC would not).
class ImportedAllocations {
 public:
  static ImportedAllocations& get() {
    static ImportedAllocations* imports = new ImportedAllocations;  // outlives atexit handlers
    return *imports;
  }
  uint8_t* open(const ExportRecord& record, int device) {
    Key key{};
    std::memcpy(key.data(), record.handle, sizeof(record.handle));
    std::memcpy(key.data() + sizeof(record.handle), &record.index, sizeof(record.index));
    key.back() = static_cast<uint8_t>(record.kind);
    std::unique_lock<std::mutex> lock(mutex_);
    auto it = open_.find(key);
    if (it != open_.end()) {
      ++it->second.readers;
      return it->second.base;
    }
    if (record.kind == ExportRecord::Kind::ByDescriptor) {
      lock.unlock();
      PieceMapping mapped = map_by_descriptor(record, device);
      lock.lock();
      it = open_.find(key);
      if (it != open_.end()) {
        mapped.unmap();
        ++it->second.readers;
        return it->second.base;
      }
      auto* base = reinterpret_cast<uint8_t*>(mapped.base);
      open_.emplace(key, Entry{base, 1, std::move(mapped)});
      return base;
    }
    cudaIpcMemHandle_t handle{};
    std::memcpy(&handle, record.handle, sizeof(handle));
    void* mapped = nullptr;
    cuda_check(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess),
               "cudaIpcOpenMemHandle (a peer's exported shards)");
    open_.emplace(key, Entry{static_cast<uint8_t*>(mapped), 1, {}});
    return static_cast<uint8_t*>(mapped);
  }
  void close(uint8_t* base) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = open_.begin(); it != open_.end(); ++it) {
      if (it->second.base != base) continue;
      if (--it->second.readers == 0) {
        if (it->second.pieces.base != 0) {
          it->second.pieces.unmap();
        } else {
          cudaIpcCloseMemHandle(base);
          cudaGetLastError();
        }
        open_.erase(it);
      }
      return;
    }
  }

 private:
  // The handle, the index and the kind.
  using Key = std::array<uint8_t, sizeof(ExportRecord::handle) + sizeof(uint32_t) + 1>;
  struct Entry {
    uint8_t* base;
    size_t readers;
    PieceMapping pieces;  // by descriptor; empty for legacy IPC
  };
  std::mutex mutex_;
  std::map<Key, Entry> open_;
};

}  // namespace

uint8_t* open_imported(const ExportRecord& record, int device) {
  return ImportedAllocations::get().open(record, device);
}

void close_imported(uint8_t* base) { ImportedAllocations::get().close(base); }

}  // namespace magi::ce
