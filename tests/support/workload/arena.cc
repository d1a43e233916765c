#include "tests/support/workload/arena.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <iterator>

#include "tests/support/workload/arena_name.h"

namespace workload {
namespace {

[[noreturn]] void fail_errno(const std::string& what) {
  throw ScenarioFailure(what + ": " + std::strerror(errno));
}

void driver_check(CUresult result, const char* call) {
  if (result != CUDA_SUCCESS) throw ScenarioFailure(format("%s: CUresult %d", call, result));
}

// A driver entry point through the runtime, so the workload links no libcuda (the runtime has
// loaded the driver by the time Placement has set the device).
template <class Fn>
Fn driver_entry_point(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
    throw ScenarioFailure(format("the CUDA driver offers no %s (%s)", name, cudaGetErrorName(err)));
  }
  return reinterpret_cast<Fn>(fn);
}

// The driver's virtual memory calls, looked up once.
struct VmmCalls {
  PFN_cuMemGetAllocationGranularity_v10020 granularity =
      driver_entry_point<PFN_cuMemGetAllocationGranularity_v10020>("cuMemGetAllocationGranularity");
  PFN_cuMemCreate_v10020 create = driver_entry_point<PFN_cuMemCreate_v10020>("cuMemCreate");
  PFN_cuMemAddressReserve_v10020 reserve =
      driver_entry_point<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve");
  PFN_cuMemMap_v10020 map = driver_entry_point<PFN_cuMemMap_v10020>("cuMemMap");
  PFN_cuMemSetAccess_v10020 set_access =
      driver_entry_point<PFN_cuMemSetAccess_v10020>("cuMemSetAccess");
  PFN_cuMemUnmap_v10020 unmap = driver_entry_point<PFN_cuMemUnmap_v10020>("cuMemUnmap");
  PFN_cuMemAddressFree_v10020 address_free =
      driver_entry_point<PFN_cuMemAddressFree_v10020>("cuMemAddressFree");
  PFN_cuMemRelease_v10020 release = driver_entry_point<PFN_cuMemRelease_v10020>("cuMemRelease");

  static const VmmCalls& get() {
    static const VmmCalls calls;
    return calls;
  }
};

size_t round_up(size_t bytes, size_t unit) { return (bytes + unit - 1) / unit * unit; }

// "/" and the name arena_name.h gives, with the launcher's tag when there is one.
std::string shared_file_name(int index) {
  const char* tag = std::getenv("STANDIN_SHM_TAG");
  return "/" + arena_file_name(tag != nullptr ? tag : "", static_cast<int>(::getpid()), index);
}

}  // namespace

Arena::Arena(const Placement& placement, Kind kind, size_t bytes, int index)
    : placement_(placement), kind_(kind) {
  const bool host = kind == Kind::Heap || kind == Kind::SharedFile || kind == Kind::HostMemfd;
  if (host == placement.device()) {
    throw ScenarioFailure(
        "the heap and /dev/shm arenas are host memory; the CUDA ones need "
        "--device 1");
  }
  bytes = bytes == 0 ? kAlignment : bytes;
  try {
    switch (kind) {
      case Kind::Heap:
        capacity_ = aligned(bytes);
        base_ = std::aligned_alloc(kAlignment, capacity_);
        if (base_ == nullptr) throw ScenarioFailure(format("cannot allocate %zu bytes", capacity_));
        break;
      case Kind::SharedFile: {
        const std::string name = shared_file_name(index);
        int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        if (fd < 0 && errno == EEXIST) {
          // The name holds this process's pid: the file is what a process that had this pid
          // before left behind when a signal killed it (pids are reused), never a live one's.
          ::shm_unlink(name.c_str());
          fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
        }
        if (fd < 0) fail_errno("shm_open " + name);
        file_name_ = name;
        capacity_ = round_up(bytes, static_cast<size_t>(::sysconf(_SC_PAGESIZE)));
        if (::ftruncate(fd, static_cast<off_t>(capacity_)) != 0) {
          const int err = errno;
          ::close(fd);
          errno = err;
          fail_errno("ftruncate " + name);
        }
        void* mapped = ::mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        const int err = errno;
        ::close(fd);  // the mapping keeps the file's pages; its name keeps it for peers
        errno = err;
        if (mapped == MAP_FAILED) fail_errno("mmap " + name);
        base_ = mapped;
        break;
      }
      case Kind::HostMemfd: {
        memfd_ = ::memfd_create("magi-arena", MFD_CLOEXEC);
        if (memfd_ < 0) fail_errno("memfd_create");
        capacity_ = round_up(bytes, static_cast<size_t>(::sysconf(_SC_PAGESIZE)));
        if (::ftruncate(memfd_, static_cast<off_t>(capacity_)) != 0) fail_errno("ftruncate memfd");
        void* mapped = ::mmap(nullptr, capacity_, PROT_READ | PROT_WRITE, MAP_SHARED, memfd_, 0);
        if (mapped == MAP_FAILED) fail_errno("mmap memfd");
        base_ = mapped;
        break;
      }
      case Kind::CudaMalloc:
        capacity_ = aligned(bytes);
        Placement::cuda_check(cudaMalloc(&base_, capacity_), "cudaMalloc of the arena");
        break;
      case Kind::CudaVmm:
      case Kind::CudaVmmPrivate: {
        const VmmCalls& vmm = VmmCalls::get();
        int device = 0;
        Placement::cuda_check(cudaGetDevice(&device), "cudaGetDevice");
        CUmemAllocationProp prop{};
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device;
        if (kind == Kind::CudaVmm)
          prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        size_t granularity = 0;
        driver_check(vmm.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                     "cuMemGetAllocationGranularity");
        // Expandable segments map a small pool's segment in 2 MiB granules.
        const size_t granule = kind == Kind::CudaVmm ? round_up(size_t{2} << 20, granularity) : 0;
        const size_t size = round_up(bytes, kind == Kind::CudaVmm ? granule : granularity);
        CUdeviceptr address = 0;
        driver_check(vmm.reserve(&address, size, 0, 0, 0), "cuMemAddressReserve");
        base_ = reinterpret_cast<void*>(address);
        capacity_ = size;
        const size_t piece = kind == Kind::CudaVmm ? granule : size;
        for (size_t at = 0; at < size; at += piece) {
          CUmemGenericAllocationHandle allocation = 0;
          driver_check(vmm.create(&allocation, piece, &prop, 0), "cuMemCreate");
          vmm_allocations_.push_back(allocation);
          driver_check(vmm.map(address + at, piece, 0, allocation, 0), "cuMemMap");
          vmm_mapped_.push_back(piece);
        }
        CUmemAccessDesc access{};
        access.location = prop.location;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        driver_check(vmm.set_access(address, size, &access, 1), "cuMemSetAccess");
        break;
      }
    }
  } catch (...) {
    release();  // the destructor does not run for an arena that was never made
    throw;
  }
}

Arena::~Arena() { release(); }

void Arena::release() noexcept {
  switch (kind_) {
    case Kind::Heap: std::free(base_); break;
    case Kind::SharedFile:
      if (base_ != nullptr) ::munmap(base_, capacity_);
      if (!file_name_.empty()) ::shm_unlink(file_name_.c_str());
      break;
    case Kind::HostMemfd:
      if (base_ != nullptr) ::munmap(base_, capacity_);
      if (memfd_ >= 0) ::close(memfd_);
      break;
    case Kind::CudaMalloc:
      if (base_ != nullptr) cudaFree(base_);
      break;
    case Kind::CudaVmm:
    case Kind::CudaVmmPrivate: {
      if (vmm_allocations_.empty() && base_ == nullptr) break;  // nothing made
      const VmmCalls& vmm = VmmCalls::get();
      const auto address = reinterpret_cast<CUdeviceptr>(base_);
      size_t at = 0;
      for (size_t mapped : vmm_mapped_) {
        vmm.unmap(address + at, mapped);
        at += mapped;
      }
      if (base_ != nullptr) vmm.address_free(address, capacity_);
      for (unsigned long long allocation : vmm_allocations_) vmm.release(allocation);
      break;
    }
  }
  base_ = nullptr;
  memfd_ = -1;
  file_name_.clear();
  vmm_mapped_.clear();
  vmm_allocations_.clear();
}

Buffer Arena::carve(size_t bytes) {
  for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
    if (it->bytes < bytes) continue;
    const size_t offset = it->offset;
    free_.erase(std::next(it).base());
    return Buffer(placement_, bytes, static_cast<unsigned char*>(base_) + offset);
  }
  const size_t offset = aligned(used_);
  if (offset > capacity_ || bytes > capacity_ - offset) {
    throw ScenarioFailure(
        format("an arena of %zu bytes has no room for %zu more at %zu", capacity_, bytes, offset));
  }
  used_ = offset + bytes;
  return Buffer(placement_, bytes, static_cast<unsigned char*>(base_) + offset);
}

void Arena::give_back(Buffer buffer) {
  const auto* at = static_cast<const unsigned char*>(buffer.nccl());
  const auto* base = static_cast<const unsigned char*>(base_);
  if (at < base || at + buffer.bytes() > base + capacity_)
    throw ScenarioFailure("a buffer given back to an arena that did not carve it");
  free_.push_back({static_cast<size_t>(at - base), buffer.bytes()});
}

}  // namespace workload
