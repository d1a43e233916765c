#include "tests/support/standin/device_memory.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <link.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "tests/support/standin/comm.h"
#include "tests/support/standin/elements.h"
#include "tests/support/standin/group.h"
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

// Whatever mode the thread's CUDA graph capture is in, relaxed for as long as this lives: the
// stand-in's own calls during a capture (cudaMallocHost, the user object) are not stream work,
// and in the global mode (torch.cuda.graph's) such a call would invalidate the capture.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { exchanged_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess; }
  ~RelaxedCaptureMode() {
    if (exchanged_) cudaThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
  bool exchanged_ = false;
};

bool is_device_memory(const void* p) {
  if (p == nullptr || !cuda_driver_loaded()) return false;
  const RelaxedCaptureMode relaxed;  // asked at captured calls too
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

// Pinned: STANDIN_PINNED_STAGING decides (pageable when pinning fails); or always, as a CUDA
// graph's copies need (a failure to pin fails the call).
enum class Pinning { AsSet, Required };

// Host memory that mirrors a device range for one operation: fresh pageable memory, or with
// STANDIN_PINNED_STAGING=1 (and always for a CUDA graph) a pinned block taken from the process's
// pool and given back when the operation (or the graph) ends. Blocks come in powers of two
// (64 KiB and up), so the pool holds at most twice what the largest operations in flight need.
// Giving a block back calls no CUDA function, so a graph's user object may do it.
class HostStaging {
 public:
  HostStaging(size_t bytes, Pinning pinning) : bytes_(bytes) {
    if (pinning == Pinning::AsSet && !Settings::get().pinned_staging) {
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
    cudaError_t err;
    {
      const RelaxedCaptureMode relaxed;
      err = cudaMallocHost(&pinned, block);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      if (pinning == Pinning::Required) {
        throw Failure(ncclUnhandledCudaError,
                      cuda_failure("cudaMallocHost of a CUDA graph's staging", err));
      }
      pageable_.resize(bytes);  // pageable, then: slower, as right
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

// The staging of an operation's device ranges: the send buffer (`in`) and the receive buffer
// (`out`). When the two overlap (the in-place forms) one host area stands for both at the same
// relative offsets, so the host protocol sees exactly the aliasing the program made.
class StagingAreas {
 public:
  StagingAreas(Span in, Span out, Pinning pinning) {
    if (in.device && out.device && overlap(in, out)) {
      const std::byte* lo = std::min(in.at, out.at);
      const std::byte* hi = std::max(in.at + in.bytes, out.at + out.bytes);
      areas_.push_back({lo, std::make_unique<HostStaging>(static_cast<size_t>(hi - lo), pinning)});
    } else {
      for (const Span* s : {&in, &out}) {
        if (s->device) areas_.push_back({s->at, std::make_unique<HostStaging>(s->bytes, pinning)});
      }
    }
  }

  // Where the host operation finds the buffer at `p`: its staging, or `p` for host memory.
  void* host_of(const void* p, const Span& span) const {
    if (!span.device) return const_cast<void*>(p);
    const auto* at = static_cast<const std::byte*>(p);
    for (const Area& a : areas_) {
      if (at >= a.device && at < a.device + a.host->size()) return a.host->data() + (at - a.device);
    }
    return nullptr;  // unreachable: every device span has an area
  }

 private:
  struct Area {
    const std::byte* device;
    std::unique_ptr<HostStaging> host;
  };
  std::vector<Area> areas_;
};

// Wraps the host operation that runs on the staging, copying the device ranges in at launch and
// out when it completes.
class Staged final : public Operation {
 public:
  Staged(cudaStream_t stream, Span in, Span out)
      : stream_(stream), in_(in), out_(out), areas_(in, out, Pinning::AsSet) {}

  void* host_of(const void* p, const Span& span) const { return areas_.host_of(p, span); }

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
  StagingAreas areas_;
  std::unique_ptr<Operation> inner_;
  std::string copy_error_;  // the first failed copy; the operation then fails with it
};

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Failure(ncclUnhandledCudaError, cuda_failure("cudaStreamIsCapturing", err));
  }
  if (status == cudaStreamCaptureStatusInvalidated) {
    throw Failure(ncclInvalidUsage, "the stream's CUDA graph capture was invalidated earlier");
  }
  return status == cudaStreamCaptureStatusActive;
}

// One operation as a CUDA graph holds it: its staging (pinned, for as long as the graph lives)
// and how to make the host operation on it afresh at each replay (an Operation runs once).
struct GraphOperation {
  GraphOperation(ncclComm* c, cudaStream_t s, Span i, Span o)
      : comm(c), stream(s), in(i), out(o), areas(i, o, Pinning::Required) {}

  ncclComm* comm;
  cudaStream_t stream;
  Span in, out;
  StagingAreas areas;
  std::function<std::unique_ptr<Operation>()> make;
  std::string what;  // "AllGather(float32, count 256)", for messages
};

// A call on a stream capturing a CUDA graph: nothing runs, and it takes no place in the
// communicator's order, at the call; its group's end records it into the graph
// (record_captured), and each replay runs it.
class CapturedOperation final : public Operation {
 public:
  explicit CapturedOperation(std::unique_ptr<GraphOperation> op) : op_(std::move(op)) {}

  std::unique_ptr<GraphOperation> take() { return std::move(op_); }

  // Never run by a group: record_captured takes it first.
  void launch() override {}
  bool progress() override { return false; }
  Segment* awaited() const override { return op_->comm->segment.get(); }
  int rank() const override { return op_->comm->rank; }
  std::string describe() const override { return op_->what + " (captured into a CUDA graph)"; }
  std::string why_waiting() const override { return "until the graph is replayed"; }
  void give_up(ncclResult_t code, const std::string& message) override { finish(code, message); }

 private:
  std::unique_ptr<GraphOperation> op_;
};

// What one host node of a graph runs: the captured operations of one group on one stream. Owned
// by the graph (a CUDA user object), so it lives as long as any replay can run it, and is
// deleted (its pinned blocks back to the pool, no CUDA call) once the graph is destroyed and
// its last replay done.
struct GraphWork {
  std::vector<std::unique_ptr<GraphOperation>> ops;
  std::vector<ncclComm*> comms;  // the distinct communicators of `ops`, by address
};

// At each replay, on CUDA's host-function thread, when the stream reaches the node: the
// operations take their places in their communicators' orders now, as NCCL's kernels do when
// they run, and run with the peers on the staging the graph's copies just filled. The program's
// threads touch a communicator only in stream order with its replays (NCCL's rule), so nothing
// else uses it meanwhile; the lock keeps apart the replays of several graphs on one
// communicator, should CUDA run their host nodes at once. It calls no CUDA function (a host
// node must not). A failure is said on stderr and breaks the communicators, so the program's
// next call on them, and ncclCommGetAsyncError, report it: the graph's copies put back what the
// staging holds, which is then not the collective's result.
void CUDART_CB replay(void* data) {
  auto& work = *static_cast<GraphWork*>(data);
  std::vector<std::unique_lock<std::mutex>> locks;
  for (ncclComm* comm : work.comms) locks.emplace_back(comm->replay_mutex);
  ncclResult_t result = ncclSuccess;
  std::string error;
  try {
    std::vector<std::unique_ptr<Operation>> ops;
    for (const auto& op : work.ops) ops.push_back(op->make());
    result = run_operations(ops);
    if (result != ncclSuccess) error = last_error();
  } catch (const Failure& f) {
    result = f.code();
    error = f.what();
  } catch (const std::exception& e) {
    result = ncclInternalError;
    error = e.what();
  }
  if (result == ncclSuccess) return;
  const GraphOperation& first = *work.ops.front();
  report("rank %d: a replay of a CUDA graph: %s%s returned %d: %s; the communicator is broken",
         first.comm->rank, first.what.c_str(), work.ops.size() > 1 ? " and its group" : "",
         static_cast<int>(result), error.c_str());
  for (ncclComm* comm : work.comms) {
    if (comm->broken.empty()) comm->broken = "a replay of a CUDA graph failed: " + error;
  }
}

void CUDART_CB delete_graph_work(void* data) { delete static_cast<GraphWork*>(data); }

void cuda_check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  throw Failure(ncclUnhandledCudaError, cuda_failure(what, err));
}

// Into the graph `stream` is capturing: the send data of `ops` copied to their staging, one host
// node that runs them (`replay`), their results copied back; the graph owns what the node uses.
void record_on_stream(cudaStream_t stream, std::vector<std::unique_ptr<GraphOperation>> ops) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = nullptr;
  cuda_check(cudaStreamGetCaptureInfo(stream, &status, nullptr, &graph),
             "cudaStreamGetCaptureInfo");
  if (status != cudaStreamCaptureStatusActive || graph == nullptr) {
    throw Failure(ncclInvalidUsage, "the stream's CUDA graph capture ended or was invalidated");
  }
  auto work = std::make_unique<GraphWork>();
  work->ops = std::move(ops);
  for (const auto& op : work->ops) work->comms.push_back(op->comm);
  std::sort(work->comms.begin(), work->comms.end());
  work->comms.erase(std::unique(work->comms.begin(), work->comms.end()), work->comms.end());
  cudaUserObject_t owner = nullptr;
  {
    const RelaxedCaptureMode relaxed;
    cuda_check(cudaUserObjectCreate(&owner, work.get(), delete_graph_work, 1,
                                    cudaUserObjectNoDestructorSync),
               "cudaUserObjectCreate");
    GraphWork* owned = work.release();  // the user object's now: deleted with its last reference
    const cudaError_t err = cudaGraphRetainUserObject(graph, owner, 1, cudaGraphUserObjectMove);
    if (err != cudaSuccess) {
      cudaUserObjectRelease(owner, 1);
      cuda_check(err, "cudaGraphRetainUserObject");
    }
    GraphWork& w = *owned;
    for (const auto& op : w.ops) {
      if (op->in.device)
        cuda_check(cudaMemcpyAsync(op->areas.host_of(op->in.at, op->in), op->in.at, op->in.bytes,
                                   cudaMemcpyDeviceToHost, stream),
                   "capturing the copy of the send buffer from the device");
    }
    cuda_check(cudaLaunchHostFunc(stream, replay, owned),
               "capturing the host node (cudaLaunchHostFunc)");
    for (const auto& op : w.ops) {
      if (op->out.device)
        cuda_check(cudaMemcpyAsync(const_cast<std::byte*>(op->out.at),
                                   op->areas.host_of(op->out.at, op->out), op->out.bytes,
                                   cudaMemcpyHostToDevice, stream),
                   "capturing the copy of the result to the device");
    }
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
  if (capturing(stream)) {
    auto op = std::make_unique<GraphOperation>(comm, stream, in, out);
    CollectiveArgs on_host = args;
    on_host.sendbuf = op->areas.host_of(args.sendbuf, in);
    on_host.recvbuf = op->areas.host_of(args.recvbuf, out);
    op->make = [comm, on_host] { return make_collective(comm, on_host); };
    op->what =
        format("%s(%s, count %zu)", op_kind_name(args.kind), datatype_name(args.dtype), args.count);
    return std::make_unique<CapturedOperation>(std::move(op));
  }
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
  if (capturing(stream)) {
    auto op = std::make_unique<GraphOperation>(comm, stream, sending ? span : Span{},
                                               sending ? Span{} : span);
    void* host = op->areas.host_of(buffer, span);
    op->make = [=]() -> std::unique_ptr<Operation> {
      return sending ? make_send(comm, host, count, dtype, peer)
                     : make_recv(comm, host, count, dtype, peer);
    };
    op->what = format("%s(%s, count %zu, peer %d)", sending ? "Send" : "Recv", datatype_name(dtype),
                      count, peer);
    return std::make_unique<CapturedOperation>(std::move(op));
  }
  auto staged = std::make_unique<Staged>(stream, sending ? span : Span{}, sending ? Span{} : span);
  void* host = staged->host_of(buffer, span);
  staged->run_on_staging(sending ? make_send(comm, host, count, dtype, peer)
                                 : make_recv(comm, host, count, dtype, peer));
  return staged;
}

bool is_captured(const Operation& op) { return dynamic_cast<const CapturedOperation*>(&op); }

void record_captured(std::vector<std::unique_ptr<Operation>> ops) {
  // By stream, in the order each first appears; each stream's in call order.
  std::vector<std::pair<cudaStream_t, std::vector<std::unique_ptr<GraphOperation>>>> by_stream;
  for (auto& op : ops) {
    std::unique_ptr<GraphOperation> graph_op = static_cast<CapturedOperation&>(*op).take();
    auto it = std::find_if(by_stream.begin(), by_stream.end(),
                           [&](const auto& entry) { return entry.first == graph_op->stream; });
    if (it == by_stream.end()) {
      by_stream.emplace_back();
      by_stream.back().first = graph_op->stream;
      it = std::prev(by_stream.end());
    }
    it->second.push_back(std::move(graph_op));
  }
  for (auto& [stream, stream_ops] : by_stream) record_on_stream(stream, std::move(stream_ops));
}

}  // namespace standin
