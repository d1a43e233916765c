// Whether a call's stream is capturing a CUDA graph, without ever starting CUDA ourselves.
//
// The driver is asked only once the program itself has loaded it (libcuda.so.1 is in the
// process when the first communicator joins: real NCCL needs it), and is reached through
// cudaGetDriverEntryPointByVersion, so a process without a GPU or driver never touches CUDA
// here. Without the driver the answer is "unknown", which later stages treat as "capturing".
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace magi::capture {

enum class StreamCapture : uint8_t { NotCapturing, Capturing, Unknown };

// Looks for the driver; call when a communicator joins (off the call path).
void probe_cuda_driver();

StreamCapture stream_capture_status(cudaStream_t stream);

}  // namespace magi::capture
