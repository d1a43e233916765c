#include <cuda_runtime_api.h>

#include <chrono>
#include <string>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/backends.h"

namespace magi::ce {
namespace {

class WallTimer final : public CompletionTimer {
 public:
  void start(void*) override { begin_ = std::chrono::steady_clock::now(); }
  void stop(void*) override { end_ = std::chrono::steady_clock::now(); }
  uint64_t elapsed_ns() override {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(end_ - begin_).count());
  }

 private:
  std::chrono::steady_clock::time_point begin_, end_;
};

class EventTimer final : public CompletionTimer {
 public:
  EventTimer() {
    cuda_check(cudaEventCreate(&begin_), "cudaEventCreate (bucket timer)");
    const cudaError_t err = cudaEventCreate(&end_);
    if (err != cudaSuccess) cudaEventDestroy(begin_);  // no destructor runs for a throwing one
    cuda_check(err, "cudaEventCreate (bucket timer)");
  }
  ~EventTimer() override {
    cudaEventDestroy(begin_);
    cudaEventDestroy(end_);
  }
  void start(void* stream) override { cudaEventRecord(begin_, static_cast<cudaStream_t>(stream)); }
  void stop(void* stream) override { cudaEventRecord(end_, static_cast<cudaStream_t>(stream)); }
  uint64_t elapsed_ns() override {
    float ms = 0;
    if (cudaEventSynchronize(end_) != cudaSuccess ||
        cudaEventElapsedTime(&ms, begin_, end_) != cudaSuccess) {
      cudaGetLastError();
      return 0;  // not measured
    }
    return static_cast<uint64_t>(static_cast<double>(ms) * 1e6);
  }

 private:
  cudaEvent_t begin_ = nullptr;
  cudaEvent_t end_ = nullptr;
};

}  // namespace

std::unique_ptr<CompletionTimer> make_wall_timer() { return std::make_unique<WallTimer>(); }
std::unique_ptr<CompletionTimer> make_event_timer() { return std::make_unique<EventTimer>(); }

}  // namespace magi::ce
