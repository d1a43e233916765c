#include "ce_transport/cuda_driver.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace magi::ce {
namespace {

// How many objects the loader has loaded so far (no system call; 0 if it does not say).
uint64_t loader_adds() {
  uint64_t adds = 0;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t size, void* out) {
        if (size >= offsetof(dl_phdr_info, dlpi_adds) + sizeof(info->dlpi_adds))
          *static_cast<uint64_t*>(out) = info->dlpi_adds;
        return 1;  // the first object carries the counters
      },
      &adds);
  return adds;
}

}  // namespace

bool cuda_driver_loaded() {
  // dlopen(RTLD_NOLOAD) of a library that is absent searches the library path (a dozen failed
  // opens, the loader cache mapped and unmapped): asked again only once something was loaded.
  static std::atomic<uint64_t> absent_at_adds{0};
  const uint64_t adds = loader_adds();
  if (adds != 0 && adds == absent_at_adds.load(std::memory_order_relaxed)) return false;
  void* driver = dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
  if (driver == nullptr) {
    absent_at_adds.store(adds, std::memory_order_relaxed);
    return false;
  }
  dlclose(driver);  // drops only the reference RTLD_NOLOAD just took
  return true;
}

void* cuda_driver_function(const char* name, unsigned cuda_version) {
  // The runtime's entry-point lookup would load the driver itself: ask only once it is there.
  if (!cuda_driver_loaded()) return nullptr;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &fn, cuda_version, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) return nullptr;
  return fn;
}

}  // namespace magi::ce
