#include "ce_transport/cuda_thread.h"

#include <cuda_runtime_api.h>

#include "base/base.h"
#include "base/cuda_driver.h"

namespace magi::ce {

ThreadDevice::ThreadDevice(int device) {
  if (device < 0 || cudaGetDevice(&saved_) != cudaSuccess || saved_ == device) {
    saved_ = -1;
    cudaGetLastError();
    return;
  }
  cuda_check(cudaSetDevice(device), "cudaSetDevice");
}

ThreadDevice::~ThreadDevice() {
  if (saved_ >= 0) cudaSetDevice(saved_);
  cudaGetLastError();
}

int relax_capture_mode() {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode) == cudaSuccess) return static_cast<int>(mode);
  cudaGetLastError();
  return -1;
}

void restore_capture_mode(int saved) {
  if (saved < 0) return;
  auto mode = static_cast<cudaStreamCaptureMode>(saved);
  cudaThreadExchangeStreamCaptureMode(&mode);
  cudaGetLastError();
}

}  // namespace magi::ce
