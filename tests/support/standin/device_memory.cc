#include "tests/support/standin/device_memory.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "tests/support/standin/comm.h"
#include "tests/support/standin/elements.h"
#include "tests/support/standin/report.h"
#include "tests/support/standin/settings.h"

namespace standin {

namespace {

// How many objects the loader has loaded so far (no system call; 0 if it does not say).
uint64_t loader_adds() {
  uint64_t adds = 0;
  ::dl_iterate_phdr(
      [](dl_phdr_info* info, size_t size, void* out) {
        if (size >= offsetof(dl_phdr_info, dlpi_adds) + sizeof(info->dlpi_adds))
          *static_cast<uint64_t*>(out) = info->dlpi_adds;
        return 1;
      },
      &adds);
  return adds;
}

}  // namespace

bool cuda_driver_loaded() {
  // Once loaded, the driver stays for the life of the process: ask the loader until then only,
  // and only when it loaded something since the last answer (dlopen(RTLD_NOLOAD) of an absent
  // library searches the library path: tens of µs per call).
  static std::atomic<bool> loaded{false};
  static std::atomic<uint64_t> absent_at_adds{0};
  if (loaded.load(std::memory_order_relaxed)) return true;
  const uint64_t adds = loader_adds();
  if (adds != 0 && adds == absent_at_adds.load(std::memory_order_relaxed)) return false;
  void* driver = ::dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
  if (driver == nullptr) {
    absent_at_adds.store(adds, std::memory_order_relaxed);
    return false;
  }
  ::dlclose(driver);  // drops only the reference RTLD_NOLOAD just took
  loaded.store(true, std::memory_order_relaxed);
  return true;
}

int current_cuda_device(int fallback) {
  if (!cuda_driver_loaded()) return fallback;
  int device = fallback;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return fallback;
  }
  return device;
}

namespace {

bool is_device_memory(const void* p) {
  if (p == nullptr || !cuda_driver_loaded()) return false;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
    cudaGetLastError();  // a pointer CUDA does not know is host memory; leave no error behind
    return false;
  }
  return attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
}

// A buffer the operation uses, as bytes; `device` is false for host memory.
struct Span {
  const std::byte* at = nullptr;
  size_t bytes = 0;
  bool device = false;
};

Span span_of(const void* p, size_t bytes, bool used) {
  if (!used || bytes == 0) return {};  // count 0: the pointer may be anything, even NULL
  return {static_cast<const std::byte*>(p), bytes, is_device_memory(p)};
}

bool overlap(const Span& a, const Span& b) {
  const auto a0 = reinterpret_cast<uintptr_t>(a.at), b0 = reinterpret_cast<uintptr_t>(b.at);
  return a0 < b0 + b.bytes && b0 < a0 + a.bytes;
}

std::string cuda_failure(const char* what, cudaError_t err) {
  return format("%s: %s (%s)", what, cudaGetErrorName(err), cudaGetErrorString(err));
}

// Host memory that mirrors a device range for one operation: fresh pageable memory, or with
// STANDIN_PINNED_STAGING=1 a pinned block taken from the process's pool and given back when the
// operation ends. Blocks come in powers of two (64 KiB and up), so the pool holds at most twice
// what the largest operations in flight need.
class HostStaging {
 public:
  explicit HostStaging(size_t bytes) : bytes_(bytes) {
    if (!Settings::get().pinned_staging) {
      pageable_.resize(bytes);
      at_ = pageable_.data();
      return;
    }
    const size_t block = std::bit_ceil(std::max<size_t>(bytes, size_t{64} << 10));
    {
      std::lock_guard<std::mutex> lock(pool_mutex());
      auto& pool = free_blocks();
      if (auto it = pool.find(block); it != pool.end()) {
        block_ = block;
        at_ = it->second;
        pool.erase(it);
        return;
      }
    }
    void* pinned = nullptr;
    if (cudaMallocHost(&pinned, block) != cudaSuccess) {
      cudaGetLastError();  // pageable, then: slower, as right
      pageable_.resize(bytes);
      at_ = pageable_.data();
      return;
    }
    block_ = block;
    at_ = static_cast<std::byte*>(pinned);
  }
  ~HostStaging() {
    if (block_ == 0) return;
    std::lock_guard<std::mutex> lock(pool_mutex());
    free_blocks().emplace(block_, at_);
  }
  HostStaging(const HostStaging&) = delete;
  HostStaging& operator=(const HostStaging&) = delete;

  std::byte* data() const { return at_; }
  size_t size() const { return bytes_; }

 private:
  // Never destroyed: an operation may end while the process exits.
  static std::mutex& pool_mutex() {
    static auto* mutex = new std::mutex;
    return *mutex;
  }
  static std::multimap<size_t, std::byte*>& free_blocks() {
    static auto* blocks = new std::multimap<size_t, std::byte*>;
    return *blocks;
  }

  size_t bytes_;
  size_t block_ = 0;  // a pooled block's size; 0: pageable
  std::byte* at_ = nullptr;
  std::vector<std::byte> pageable_;
};

// Wraps the host operation that runs on the staging. The staging mirrors the device ranges of
// the send buffer (`in`) and the receive buffer (`out`); when the two overlap (the in-place
// forms) one host area stands for both at the same relative offsets, so the host protocol sees
// exactly the aliasing the program made.
class Staged final : public Operation {
 public:
  Staged(cudaStream_t stream, Span in, Span out) : stream_(stream), in_(in), out_(out) {
    if (in_.device && out_.device && overlap(in_, out_)) {
      const std::byte* lo = std::min(in_.at, out_.at);
      const std::byte* hi = std::max(in_.at + in_.bytes, out_.at + out_.bytes);
      areas_.push_back({lo, std::make_unique<HostStaging>(static_cast<size_t>(hi - lo))});
    } else {
      for (const Span* s : {&in_, &out_}) {
        if (s->device) areas_.push_back({s->at, std::make_unique<HostStaging>(s->bytes)});
      }
    }
  }

  // Where the host operation finds the buffer at `p`: its staging, or `p` for host memory.
  void* host_of(const void* p, const Span& span) {
    if (!span.device) return const_cast<void*>(p);
    const auto* at = static_cast<const std::byte*>(p);
    for (Area& a : areas_) {
      if (at >= a.device && at < a.device + a.host->size()) return a.host->data() + (at - a.device);
    }
    return nullptr;  // unreachable: every device span has an area
  }

  void run_on_staging(std::unique_ptr<Operation> inner) { inner_ = std::move(inner); }
  uint64_t traffic_bytes() const override { return inner_ ? inner_->traffic_bytes() : 0; }

  // The send data is read when the group runs, as NCCL reads it when its kernel runs: after the
  // program's earlier work on the stream.
  void launch() override {
    if (in_.device) copy(host_of(in_.at, in_), in_.at, in_.bytes, cudaMemcpyDeviceToHost);
    inner_->launch();  // also after a failed copy: the peers expect this rank in the protocol
  }

  bool progress() override {
    const bool moved = inner_->progress();
    if (!inner_->done()) return moved;
    if (inner_->result() != ncclSuccess) {
      finish(inner_->result(), inner_->error());
    } else {
      if (out_.device)
        copy(const_cast<std::byte*>(out_.at), host_of(out_.at, out_), out_.bytes,
             cudaMemcpyHostToDevice);
      if (copy_error_.empty()) {
        finish(ncclSuccess);
      } else {
        finish(ncclUnhandledCudaError, copy_error_);
      }
    }
    return true;
  }

  Segment* awaited() const override { return inner_->awaited(); }
  int rank() const override { return inner_->rank(); }
  std::string describe() const override { return inner_->describe(); }
  std::string why_waiting() const override { return inner_->why_waiting(); }
  int awaited_rank() const override { return inner_->awaited_rank(); }
  void give_up(ncclResult_t code, const std::string& message) override {
    inner_->give_up(code, message);
    finish(code, message);
  }

 private:
  struct Area {
    const std::byte* device;
    std::unique_ptr<HostStaging> host;
  };

  // On the call's stream, so it is ordered after the program's earlier work there; the stream
  // is synchronized before anyone reads the destination, so the call completes before it
  // returns (host side) and the program's next work sees the result (device side).
  void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (!copy_error_.empty()) return;
    cudaError_t err = cudaMemcpyAsync(dst, src, bytes, kind, stream_);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream_);
    if (err == cudaSuccess) return;
    cudaGetLastError();
    copy_error_ = format(
        "rank %d: %s", inner_->rank(),
        cuda_failure(kind == cudaMemcpyDeviceToHost ? "copying the send buffer from the device"
                                                    : "copying the result to the device",
                     err)
            .c_str());
  }

  cudaStream_t stream_;
  Span in_, out_;
  std::vector<Area> areas_;
  std::unique_ptr<Operation> inner_;
  std::string copy_error_;  // the first failed copy; the operation then fails with it
};

void refuse_graph_capture(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Failure(ncclUnhandledCudaError, cuda_failure("cudaStreamIsCapturing", err));
  }
  if (status != cudaStreamCaptureStatusNone) {
    throw Failure(ncclInvalidUsage,
                  "device buffers on a stream capturing a CUDA graph are not supported by the "
                  "stand-in (it copies synchronously)");
  }
}

}  // namespace

std::unique_ptr<Operation> collective_on_any_memory(ncclComm* comm, const CollectiveArgs& args,
                                                    bool sends, bool receives,
                                                    cudaStream_t stream) {
  const size_t element = datatype_bytes(args.dtype);
  const size_t n = static_cast<size_t>(comm->nranks);
  const bool send_blocks = args.kind == OpKind::ReduceScatter || args.kind == OpKind::AlltoAll ||
                           args.kind == OpKind::Scatter;
  const bool recv_blocks = args.kind == OpKind::AllGather || args.kind == OpKind::AlltoAll ||
                           args.kind == OpKind::Gather;
  const Span in = span_of(args.sendbuf, args.count * (send_blocks ? n : 1) * element, sends);
  const Span out = span_of(args.recvbuf, args.count * (recv_blocks ? n : 1) * element, receives);
  if (!in.device && !out.device) return make_collective(comm, args);
  refuse_graph_capture(stream);
  auto staged = std::make_unique<Staged>(stream, in, out);
  CollectiveArgs on_host = args;
  on_host.sendbuf = staged->host_of(args.sendbuf, in);
  on_host.recvbuf = staged->host_of(args.recvbuf, out);
  staged->run_on_staging(make_collective(comm, on_host));
  return staged;
}

std::unique_ptr<Operation> transfer_on_any_memory(ncclComm* comm, bool sending, void* buffer,
                                                  size_t count, ncclDataType_t dtype, int peer,
                                                  cudaStream_t stream) {
  const Span span = span_of(buffer, count * datatype_bytes(dtype), true);
  if (!span.device) {
    return sending ? make_send(comm, buffer, count, dtype, peer)
                   : make_recv(comm, buffer, count, dtype, peer);
  }
  refuse_graph_capture(stream);
  auto staged = std::make_unique<Staged>(stream, sending ? span : Span{}, sending ? Span{} : span);
  void* host = staged->host_of(buffer, span);
  staged->run_on_staging(sending ? make_send(comm, host, count, dtype, peer)
                                 : make_recv(comm, host, count, dtype, peer));
  return staged;
}

}  // namespace standin
