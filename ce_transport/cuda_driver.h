// The CUDA driver, reached only when the program has already loaded it.
//
// The transport must never start CUDA on its own (a process without a GPU, or one that has not
// touched CUDA yet, must stay that way), so every driver or runtime query here is gated on
// libcuda.so.1 being in the process already.
#pragma once

namespace magi::ce {

// True when libcuda.so.1 is already loaded (dlopen RTLD_NOLOAD); never loads it.
bool cuda_driver_loaded();

// The driver function `name` at ABI version `cuda_version` (cudaGetDriverEntryPointByVersion),
// or nullptr when the driver is not loaded or lacks it. Off the call path: every miss asks again.
void* cuda_driver_function(const char* name, unsigned cuda_version);

}  // namespace magi::ce
