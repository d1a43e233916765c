#include "capture/stream_capture.h"

#include <cuda.h>
#include <dlfcn.h>

#include <atomic>
#include <mutex>

#include "base/base.h"

namespace magi::capture {
namespace {

using IsCapturingFn = CUresult (*)(CUstream, CUstreamCaptureStatus*);
std::atomic<IsCapturingFn> g_is_capturing{nullptr};

}  // namespace

void probe_cuda_driver() {
  static std::once_flag once;
  std::call_once(once, [] {
    // RTLD_NOLOAD: if the program has not loaded the driver, we do not either.
    void* driver = dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
    if (driver == nullptr) {
      MAGI_INFO(Capture, "no CUDA driver in the process: graph-capture state is recorded as unknown");
      return;
    }
    dlclose(driver);
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuStreamIsCapturing", &fn, 10000,
                                                             cudaEnableDefault, &found);
    if (err != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
      MAGI_INFO(Capture, "cuStreamIsCapturing unavailable (%s): graph-capture state is unknown",
                cudaGetErrorName(err));
      return;
    }
    g_is_capturing.store(reinterpret_cast<IsCapturingFn>(fn), std::memory_order_release);
  });
}

StreamCapture stream_capture_status(cudaStream_t stream) {
  const IsCapturingFn is_capturing = g_is_capturing.load(std::memory_order_acquire);
  if (is_capturing == nullptr) return StreamCapture::Unknown;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (is_capturing(reinterpret_cast<CUstream>(stream), &status) != CUDA_SUCCESS)
    return StreamCapture::Unknown;
  return status == CU_STREAM_CAPTURE_STATUS_NONE ? StreamCapture::NotCapturing : StreamCapture::Capturing;
}

}  // namespace magi::capture
