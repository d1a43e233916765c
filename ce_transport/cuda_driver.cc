#include "ce_transport/cuda_driver.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

namespace magi::ce {

bool cuda_driver_loaded() {
  void* driver = dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
  if (driver == nullptr) return false;
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
