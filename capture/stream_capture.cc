#include "capture/stream_capture.h"

#include <atomic>
#include <mutex>

#include "base/base.h"
#include "base/cuda_driver.h"

namespace magi::capture {
namespace {

std::atomic<PFN_cuStreamIsCapturing_v10000> g_is_capturing{nullptr};

}  // namespace

void probe_cuda_driver() {
  static std::once_flag once;
  std::call_once(once, [] {
    // cuda_driver() never loads the driver: if the program has not, we do not either.
    const CudaDriver* driver = cuda_driver();
    if (driver == nullptr) {
      MAGI_INFO(Capture,
                "no CUDA driver in the process: graph-capture state is recorded as unknown");
      return;
    }
    if (driver->cuStreamIsCapturing_fn == nullptr) {
      MAGI_INFO(Capture, "cuStreamIsCapturing unavailable: graph-capture state is unknown");
      return;
    }
    g_is_capturing.store(driver->cuStreamIsCapturing_fn, std::memory_order_release);
  });
}

StreamCapture stream_capture_status(cudaStream_t stream) {
  const auto is_capturing = g_is_capturing.load(std::memory_order_acquire);
  if (is_capturing == nullptr) return StreamCapture::Unknown;
  CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
  if (is_capturing(reinterpret_cast<CUstream>(stream), &status) != CUDA_SUCCESS)
    return StreamCapture::Unknown;
  return status == CU_STREAM_CAPTURE_STATUS_NONE ? StreamCapture::NotCapturing
                                                 : StreamCapture::Capturing;
}

}  // namespace magi::capture
