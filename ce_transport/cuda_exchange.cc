// The agreement-round buffers of the CUDA backend: the real NCCL gathers device memory, so the
// contribution goes up to the device before the all-gather and the result comes back to pinned
// host memory after it, on a stream of our own that never waits for the program's work.
#include <cuda_runtime_api.h>

#include <cstring>
#include <string>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/backends.h"

namespace magi::ce {
namespace {

class CudaExchange final : public Exchange {
 public:
  CudaExchange(size_t contribution_bytes, int nranks)
      : contribution_bytes_(contribution_bytes),
        result_bytes_(contribution_bytes * static_cast<size_t>(nranks > 0 ? nranks : 0)) {
    if (nranks < 1)
      throw Error(ErrorKind::Usage, "an exchange of " + std::to_string(nranks) + " ranks");
    try {
      cuda_check(cudaMalloc(&send_, contribution_bytes_), "cudaMalloc (exchange send buffer)");
      cuda_check(cudaMalloc(&recv_, result_bytes_), "cudaMalloc (exchange receive buffer)");
      cuda_check(cudaMallocHost(&staged_, contribution_bytes_),
                 "cudaMallocHost (exchange staging)");
      cuda_check(cudaMallocHost(&result_, result_bytes_), "cudaMallocHost (exchange result)");
      cuda_check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags");
      cuda_check(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags");
    } catch (...) {
      free_all();
      throw;
    }
  }
  ~CudaExchange() override { free_all(); }

  void* send_buffer() override { return send_; }
  void* recv_buffer() override { return recv_; }
  void* stream() override { return stream_; }

  void stage(std::span<const uint8_t> contribution) override {
    if (contribution.size() != contribution_bytes_)
      throw Error(ErrorKind::Internal, "a contribution of " + std::to_string(contribution.size()) +
                                           " bytes for an exchange of " +
                                           std::to_string(contribution_bytes_));
    // The previous round's copies may still read the staging buffer or fill the result.
    cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (exchange)");
    issued_ = false;
    if (contribution_bytes_ == 0) return;
    std::memcpy(staged_, contribution.data(), contribution_bytes_);
    cuda_check(
        cudaMemcpyAsync(send_, staged_, contribution_bytes_, cudaMemcpyHostToDevice, stream_),
        "cudaMemcpyAsync (exchange contribution)");
  }

  void issued() override {
    if (result_bytes_ != 0)
      cuda_check(cudaMemcpyAsync(result_, recv_, result_bytes_, cudaMemcpyDeviceToHost, stream_),
                 "cudaMemcpyAsync (exchange result)");
    cuda_check(cudaEventRecord(copied_, stream_), "cudaEventRecord (exchange)");
    issued_ = true;
  }

  bool ready() override {
    if (!issued_) return false;
    const cudaError_t err = cudaEventQuery(copied_);
    if (err == cudaErrorNotReady) return false;
    cuda_check(err, "cudaEventQuery (exchange)");
    return true;
  }

  std::span<const uint8_t> result() override {
    if (!issued_)
      throw Error(ErrorKind::Internal, "exchange result asked before the all-gather was issued");
    cuda_check(cudaEventSynchronize(copied_), "cudaEventSynchronize (exchange)");
    return {static_cast<const uint8_t*>(result_), result_bytes_};
  }

 private:
  // Best effort: a destructor has nowhere to report to, and a failed free leaks at worst.
  void free_all() noexcept {
    if (stream_ != nullptr) cudaStreamSynchronize(stream_);
    if (copied_ != nullptr) cudaEventDestroy(copied_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    if (result_ != nullptr) cudaFreeHost(result_);
    if (staged_ != nullptr) cudaFreeHost(staged_);
    if (recv_ != nullptr) cudaFree(recv_);
    if (send_ != nullptr) cudaFree(send_);
    copied_ = nullptr;
    stream_ = nullptr;
    result_ = staged_ = recv_ = send_ = nullptr;
  }

  const size_t contribution_bytes_;
  const size_t result_bytes_;
  void* send_ = nullptr;    // device
  void* recv_ = nullptr;    // device
  void* staged_ = nullptr;  // pinned host: the contribution on its way up
  void* result_ = nullptr;  // pinned host: the gathered contributions on their way down
  cudaStream_t stream_ = nullptr;
  cudaEvent_t copied_ = nullptr;
  bool issued_ = false;
};

}  // namespace

std::unique_ptr<Exchange> make_cuda_exchange(size_t contribution_bytes, int nranks, int device) {
  // Never the first to start CUDA in a process: only a program that already uses it gets here.
  if (!cuda_driver_loaded())
    throw Error(ErrorKind::System, "the CUDA driver is not loaded in this process");
  // Our CUDA runtime is not the program's: it follows the communicator's device explicitly.
  if (device >= 0) cuda_check(cudaSetDevice(device), "cudaSetDevice");
  return std::make_unique<CudaExchange>(contribution_bytes, nranks);
}

}  // namespace magi::ce
