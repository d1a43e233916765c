#include "base/cuda_driver.h"

#include <dlfcn.h>
#include <link.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include "base/check.h"
#include "base/log.h"

namespace magi {
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

// The runtime's entry-point lookup would load the driver itself: called only once it is there.
template <class Fn>
void look_up(Fn& fn, const char* name, unsigned cuda_version) {
  void* found_fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t err =
      cudaGetDriverEntryPointByVersion(name, &found_fn, cuda_version, cudaEnableDefault, &found);
  if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || found_fn == nullptr) {
    if (err != cudaSuccess) cudaGetLastError();
    MAGI_INFO(Init, "the CUDA driver offers no %s at version %u (%s)", name, cuda_version,
              cudaGetErrorName(err));
    return;
  }
  fn = reinterpret_cast<Fn>(found_fn);
}

CudaDriver g_driver;
std::atomic<bool> g_driver_ready{false};
std::mutex g_driver_loading;

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

const CudaDriver* cuda_driver() {
  if (g_driver_ready.load(std::memory_order_acquire)) return &g_driver;
  if (!cuda_driver_loaded()) return nullptr;
  std::lock_guard<std::mutex> lock(g_driver_loading);
  if (!g_driver_ready.load(std::memory_order_relaxed)) {
    // A driver once loaded stays (it is never unloaded), and so does what it offers: one look.
#define MAGI_CUDA_DRIVER_LOOK_UP(name, type, version) look_up(g_driver.name##_fn, #name, version);
    MAGI_CUDA_DRIVER_ENTRY_POINTS(MAGI_CUDA_DRIVER_LOOK_UP)
#undef MAGI_CUDA_DRIVER_LOOK_UP
    g_driver_ready.store(true, std::memory_order_release);
  }
  return &g_driver;
}

void cuda_driver_missing(const char* name) {
  throw Error(ErrorKind::Cuda, cuda_driver_loaded()
                                   ? std::string("the CUDA driver offers no ") + name
                                   : std::string("the CUDA driver is not loaded in this process"));
}

void cuda_check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // the runtime keeps the last error; do not leave ours to the program
  throw Error(ErrorKind::Cuda, std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                                   cudaGetErrorString(err) + ")");
}

void cuda_check(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const CudaDriver* driver = cuda_driver();
  if (driver == nullptr || driver->cuGetErrorName_fn == nullptr ||
      driver->cuGetErrorName_fn(result, &name) != CUDA_SUCCESS || name == nullptr)
    name = "CUresult";
  throw Error(ErrorKind::Cuda, std::string(what) + ": " + name + " (" +
                                   std::to_string(static_cast<int>(result)) + ")");
}

}  // namespace magi
