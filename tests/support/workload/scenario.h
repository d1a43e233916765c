// What every workload scenario shares: its command-line options, the failure that ends it with
// a message, and the NCCL call check. Scenarios use only the NCCL API (and bootstrap.h), like a
// user's program, so the same run can go straight to NCCL or through the shim.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace workload {

// "--name value" pairs after the scenario name.
class ScenarioOptions {
 public:
  ScenarioOptions(int argc, char** argv);  // argv[0] is the scenario name
  long number(const std::string& name, long fallback) const;
  std::string text(const std::string& name, const std::string& fallback) const;
  bool has(const std::string& name) const { return values_.count(name) != 0; }

 private:
  std::map<std::string, std::string> values_;
};

// Ends the scenario: the entry point prints "<scenario>: <message>" and returns 1.
class ScenarioFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Throws ScenarioFailure naming the call unless it succeeded.
void check(ncclResult_t result, const char* call);
#define WORKLOAD_CHECK(call) ::workload::check((call), #call)

// A communicator the scenario owns: destroyed however the scenario ends, so a failing rank
// leaks nothing (leak checkers look at every rank). destroy() is the checked, normal end.
class OwnedComm {
 public:
  OwnedComm() = default;
  explicit OwnedComm(ncclComm_t comm) : comm_(comm) {}
  OwnedComm(OwnedComm&& other) noexcept : comm_(std::exchange(other.comm_, nullptr)) {}
  OwnedComm& operator=(OwnedComm&&) = delete;
  ~OwnedComm() {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }
  ncclComm_t get() const { return comm_; }
  ncclComm_t* out() { return &comm_; }  // for the NCCL calls that make one
  void destroy() { check(ncclCommDestroy(std::exchange(comm_, nullptr)), "ncclCommDestroy"); }

 private:
  ncclComm_t comm_ = nullptr;
};

// Where a scenario keeps the buffers it hands to NCCL. Host memory by default. With --device 1
// every such buffer is cudaMalloc'ed on GPU 0 (all ranks share that GPU), its data is written on
// the host as before and copied in with cudaMemcpy before each call, the result is copied out
// after the stream is synchronized, and the calls run on a stream the scenario creates (not the
// legacy default stream). Without --device nothing here calls CUDA: a run on a machine without a
// GPU never starts it.
class Placement {
 public:
  explicit Placement(const ScenarioOptions& options) : device_(options.number("device", 0) != 0) {
    if (!device_) return;
    cuda_check(cudaSetDevice(0), "cudaSetDevice(0)");
    // A blocking stream: it waits for the cudaMemcpy that wrote a call's input (legacy stream).
    cuda_check(cudaStreamCreate(&stream_), "cudaStreamCreate");
  }
  ~Placement() {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Placement(const Placement&) = delete;
  Placement& operator=(const Placement&) = delete;

  bool device() const { return device_; }
  cudaStream_t stream() const { return stream_; }  // nullptr in host memory, as before
  // Waits for every call issued on the stream; results may be read after it.
  void synchronize() const {
    if (device_) cuda_check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  }

  static void cuda_check(cudaError_t err, const char* call) {
    if (err != cudaSuccess) {
      throw ScenarioFailure(
          format("%s: %s (%s)", call, cudaGetErrorName(err), cudaGetErrorString(err)));
    }
  }

 private:
  bool device_;
  cudaStream_t stream_ = nullptr;
};

// Memory a call reads or writes. The scenario writes and checks host(); NCCL gets nccl(): the
// same bytes in host memory, or a device allocation of the same size that upload() and
// download() copy to and from. Both sides are 64-byte aligned, as device allocations are (memory
// a caller lends must be too).
class Buffer {
 public:
  Buffer(const Placement& placement, size_t bytes) : bytes_(bytes), host_(allocate_host(bytes)) {
    if (placement.device()) {
      const cudaError_t err = cudaMalloc(&device_, rounded(bytes));
      if (err != cudaSuccess) std::free(host_);
      Placement::cuda_check(err, "cudaMalloc");
    }
  }
  // The same over `memory`, which the caller owns and frees after this buffer is gone (a shard
  // inside a larger allocation, arena.h): the device side with --device 1, else the host side.
  Buffer(const Placement& placement, size_t bytes, void* memory) : bytes_(bytes) {
    if (placement.device()) {
      host_ = allocate_host(bytes);
      device_ = memory;
      owns_device_ = false;
    } else {
      host_ = static_cast<unsigned char*>(memory);
      owns_host_ = false;
    }
  }
  Buffer(Buffer&& other) noexcept
      : bytes_(other.bytes_),
        host_(std::exchange(other.host_, nullptr)),
        device_(std::exchange(other.device_, nullptr)),
        owns_host_(other.owns_host_),
        owns_device_(other.owns_device_) {}
  Buffer& operator=(Buffer&& other) noexcept {
    std::swap(bytes_, other.bytes_);
    std::swap(host_, other.host_);
    std::swap(device_, other.device_);
    std::swap(owns_host_, other.owns_host_);
    std::swap(owns_device_, other.owns_device_);
    return *this;
  }
  ~Buffer() {
    if (owns_host_) std::free(host_);
    if (owns_device_ && device_ != nullptr) cudaFree(device_);
  }

  unsigned char* host() const { return host_; }
  void* nccl() const { return device_ != nullptr ? device_ : host_; }
  size_t bytes() const { return bytes_; }

  // Bytes [offset, offset + n) of the host side to the device side (before the call).
  void upload(size_t offset, size_t n) const {
    if (device_ == nullptr || n == 0) return;
    check_range(offset, n);
    Placement::cuda_check(cudaMemcpy(static_cast<unsigned char*>(device_) + offset, host_ + offset,
                                     n, cudaMemcpyHostToDevice),
                          "cudaMemcpy to the device");
  }
  // Bytes [offset, offset + n) of the device side to the host side (after the stream's sync).
  void download(size_t offset, size_t n) const {
    if (device_ == nullptr || n == 0) return;
    check_range(offset, n);
    Placement::cuda_check(cudaMemcpy(host_ + offset, static_cast<unsigned char*>(device_) + offset,
                                     n, cudaMemcpyDeviceToHost),
                          "cudaMemcpy from the device");
  }

 private:
  static size_t rounded(size_t bytes) { return bytes == 0 ? 64 : (bytes + 63) / 64 * 64; }
  static unsigned char* allocate_host(size_t bytes) {
    auto* host = static_cast<unsigned char*>(std::aligned_alloc(64, rounded(bytes)));
    if (host == nullptr) throw ScenarioFailure(format("cannot allocate %zu bytes", bytes));
    std::memset(host, 0, rounded(bytes));
    return host;
  }
  void check_range(size_t offset, size_t n) const {
    if (offset > bytes_ || n > bytes_ - offset) {
      throw ScenarioFailure(
          format("bytes %zu..%zu are outside a buffer of %zu", offset, offset + n, bytes_));
    }
  }

  size_t bytes_;
  unsigned char* host_ = nullptr;
  void* device_ = nullptr;
  bool owns_host_ = true;
  bool owns_device_ = true;
};

int run_ops(const ScenarioOptions& options);
int run_fsdp(const ScenarioOptions& options);
int run_split(const ScenarioOptions& options);
int run_initall(const ScenarioOptions& options);
int run_agree(const ScenarioOptions& options);
int run_groupskew(const ScenarioOptions& options);
int run_weights(const ScenarioOptions& options);
int run_perf(const ScenarioOptions& options);

}  // namespace workload
