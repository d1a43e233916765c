// The CUDA backend of the transport: device windows shared through CUDA IPC, copy-engine reads
// (cudaMemcpyBatchAsync) on the caller's stream, and the handshake of ce_transport.h done by
// stream memory operations (cuStreamBatchMemOp write/wait of 64-bit sequence numbers) on flag
// words in the windows. Everything is enqueued on the caller's stream: the host never waits, no
// kernel is launched, no SM is used.
//
// Why cudaMalloc + CUDA IPC handles rather than VMM with POSIX file descriptors: an fd reaches
// another process only over a Unix socket (or pidfd_getfd, which needs ptrace rights); an IPC
// handle is 64 plain bytes that travel in the publish round through the communicator itself, so
// no socket is ever opened. A handle cannot be opened by the process that exported it, which is
// no loss: a rank reads its own window through its own pointer. A window is one allocation, so
// one mapping per peer: a communicator costs nranks - 1 mappings per process, far below drivers'
// limits.
//
// Layout: the slots (or the bound region) start at offset 0 of the allocation, the flags follow
// them, and the allocation is rounded up to 2 MiB. Measured on an H200: copies out of a region
// that starts 512 bytes into its allocation ran at 78-80% of the same copies from offset 0 for
// 256 MiB shards. Flags: two 64-bit words, ready and done, each on its own 256-byte line. A rank
// writes only its own; peers wait on them through their IPC mappings.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ce_transport/backends.h"
#include "ce_transport/faults.h"
#include "ce_transport/cuda_driver.h"
#include "ce_transport/process.h"
#include "shim/shim.h"

namespace magi::ce {
namespace {

constexpr size_t kFlagLine = 256;
constexpr size_t kReadyOffset = 0;  // from the flags' start
constexpr size_t kDoneOffset = kFlagLine;
constexpr size_t kFlagBytes = 2 * kFlagLine;
constexpr size_t kSlotAlign = 256;
constexpr size_t kAllocationGranule = size_t{2} << 20;

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    cudaGetLastError();  // the runtime keeps the last error; do not leave ours to the program
    throw Error(ErrorKind::Cuda, std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                                     cudaGetErrorString(err) + ")");
  }
}

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

struct CudaBlob {
  static constexpr uint64_t kMagic = 0x314443454947414d;  // "MAGIECD1" in memory order
  uint64_t magic;
  uint64_t comm_identity;
  uint64_t window_bytes;
  uint64_t slot_bytes;
  uint64_t bound;
  int32_t rank;
  int32_t nranks;
  int32_t device;
  int32_t reserved;
  int64_t pid;
  cudaIpcMemHandle_t handle;
};
static_assert(sizeof(CudaBlob) <= HandleBlob::kBytes);

using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

// The driver's stream memory operations, found once the program has loaded the driver.
BatchMemOp batch_mem_op() {
  static BatchMemOp fn = reinterpret_cast<BatchMemOp>(cuda_driver_function("cuStreamBatchMemOp", 12000));
  if (fn == nullptr) throw Error(ErrorKind::Cuda, "the driver offers no cuStreamBatchMemOp");
  return fn;
}

CUstreamBatchMemOpParams write_op(const uint8_t* address, uint64_t value) {
  CUstreamBatchMemOpParams op{};
  op.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
  op.writeValue.address = reinterpret_cast<CUdeviceptr>(address);
  op.writeValue.value64 = value;
  // With the memory barrier that precedes it by default (a batch refuses the flag that drops it).
  op.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  return op;
}

CUstreamBatchMemOpParams wait_op(const uint8_t* address, uint64_t at_least) {
  CUstreamBatchMemOpParams op{};
  op.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
  op.waitValue.address = reinterpret_cast<CUdeviceptr>(address);
  op.waitValue.value64 = at_least;
  op.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  return op;
}

class CudaTransport final : public Transport {
 public:
  CudaTransport(int rank, int nranks, uint64_t identity, int device)
      : rank_(rank), nranks_(nranks), identity_(identity), device_(device) {}
  ~CudaTransport() override {
    try {
      release();
    } catch (...) {
    }
  }

  void prepare(const WindowPlan& plan, HandleBlob& out) override {
    release();
    inject_fault(Options::Fault::Where::Prepare, rank_, "preparing the window");
    use_device();
    slot_bytes_ = plan.slot_bytes;
    stride_ = round_up(std::max<size_t>(plan.slot_bytes, 1), kSlotAlign);
    bound_ = plan.bound;
    verify_first_ = plan.verify_first;
    verify_every_ = plan.verify_every;
    flags_at_ = (bound_ ? 1 : 2) * stride_;
    bytes_ = round_up(flags_at_ + kFlagBytes, kAllocationGranule);
    cuda_check(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    cuda_check(cudaMalloc(&base_, bytes_), "cudaMalloc (window)");
    cuda_check(cudaMemsetAsync(base(0), 0, kFlagBytes, own_stream_), "cudaMemsetAsync (flags)");
    if (bound_) {
      // The shards must hold what the program last wrote: wait for all its work once, here,
      // at the plan's start, never on the call path.
      cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (binding)");
      for (const BindOp& b : plan.bind) {
        if (b.bytes > slot_bytes_ || b.slot_offset > slot_bytes_ - b.bytes)
          throw Error(ErrorKind::Usage, "a binding overflows the bound region");
        if (b.bytes == 0) continue;
        cuda_check(cudaMemcpyAsync(region() + b.slot_offset, b.sendbuf, b.bytes, cudaMemcpyDefault,
                                   own_stream_), "cudaMemcpyAsync (binding)");
      }
    }
    cuda_check(cudaStreamSynchronize(own_stream_), "cudaStreamSynchronize (window)");
    CudaBlob blob{};
    blob.magic = CudaBlob::kMagic;
    blob.comm_identity = identity_;
    blob.window_bytes = bytes_;
    blob.slot_bytes = slot_bytes_;
    blob.bound = bound_ ? 1 : 0;
    blob.rank = rank_;
    blob.nranks = nranks_;
    blob.device = device_;
    blob.pid = getpid();
    cuda_check(cudaIpcGetMemHandle(&blob.handle, base_), "cudaIpcGetMemHandle");
    out = HandleBlob{};
    std::memcpy(out.bytes, &blob, sizeof(blob));
  }

  void attach(std::span<const HandleBlob> blobs) override {
    if (base_ == nullptr) throw Error(ErrorKind::Usage, "attach before prepare");
    if (blobs.size() != static_cast<size_t>(nranks_)) throw Error(ErrorKind::Usage, "one handle blob per rank");
    inject_fault(Options::Fault::Where::Attach, rank_, "opening the peers' windows");
    use_device();
    if (nranks_ > 1) batch_mem_op();  // refuse now, not on the first gather
    peers_.assign(static_cast<size_t>(nranks_), nullptr);
    peer_pids_.assign(static_cast<size_t>(nranks_), 0);
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) continue;
      CudaBlob blob{};
      std::memcpy(&blob, blobs[static_cast<size_t>(r)].bytes, sizeof(blob));
      if (blob.magic != CudaBlob::kMagic || blob.rank != r || blob.nranks != nranks_ ||
          blob.comm_identity != identity_ || blob.window_bytes != bytes_ ||
          blob.slot_bytes != slot_bytes_ || (blob.bound != 0) != bound_)
        throw Error(ErrorKind::Usage, "rank " + std::to_string(r) + "'s window does not match this plan");
      void* mapped = nullptr;
      cuda_check(cudaIpcOpenMemHandle(&mapped, blob.handle, cudaIpcMemLazyEnablePeerAccess),
                 "cudaIpcOpenMemHandle");
      peers_[static_cast<size_t>(r)] = static_cast<uint8_t*>(mapped);
      peer_pids_[static_cast<size_t>(r)] = static_cast<pid_t>(blob.pid);
    }
    attached_ = true;
  }

  Served gather(std::span<const GatherOp> bucket, void* stream_handle) override {
    if (!attached_) throw Error(ErrorKind::Usage, "gather before attach");
    use_device();
    const auto stream = static_cast<cudaStream_t>(stream_handle);
    for (const GatherOp& op : bucket)
      if (op.bytes > slot_bytes_ || op.slot_offset > slot_bytes_ - op.bytes)
        throw Error(ErrorKind::Usage, "a gather overflows its slot");
    const uint64_t n = ++sequence_;
    copies_.clear();
    if (bound_) {
      verify(bucket, stream);
      add_reads(bucket, [&](int r) { return peers_[static_cast<size_t>(r)]; });
      issue_copies(stream);
      mem_ops_.assign(1, write_op(base(kDoneOffset), n));  // release() waits for peers' reads
      issue_mem_ops(stream);
      return Served::Moved;
    }
    const size_t slot = (n % 2) * stride_;
    // 1. Slot n % 2 was last read in bucket n - 2: every peer must be done with it.
    mem_ops_.clear();
    if (n > 2) for_each_peer([&](int r) { mem_ops_.push_back(wait_op(peer(r, kDoneOffset), n - 2)); });
    issue_mem_ops(stream);
    // 2. Stage this rank's shards.
    for (const GatherOp& op : bucket)
      if (op.bytes != 0) add_copy(static_cast<uint8_t*>(base_) + slot + op.slot_offset, op.sendbuf, op.bytes);
    issue_copies(stream);
    // 3. Staged; wait until every peer has staged too.
    mem_ops_.assign(1, write_op(base(kReadyOffset), n));
    for_each_peer([&](int r) { mem_ops_.push_back(wait_op(peer(r, kReadyOffset), n)); });
    issue_mem_ops(stream);
    // 4. Read every peer's slot, and this rank's shard from its send buffer.
    copies_.clear();
    add_reads(bucket, [&](int r) { return peers_[static_cast<size_t>(r)] + slot; });
    issue_copies(stream);
    // 5. Done reading: peers may reuse their slot n % 2 (in bucket n + 2).
    mem_ops_.assign(1, write_op(base(kDoneOffset), n));
    issue_mem_ops(stream);
    return Served::Moved;
  }

  void release() override {
    if (base_ == nullptr) return;
    use_device();
    // Peers may still be reading this window on their streams: free it only once each has said
    // it is done with the last bucket, or has gone. A peer that says neither within the limit
    // keeps the window alive (leaked, and said so) rather than read freed memory.
    bool safe = true;
    if (attached_ && sequence_ > 0) safe = wait_peers_done(sequence_);
    cudaDeviceSynchronize();  // this process's copies from and into the window
    for (uint8_t* p : peers_)
      if (p != nullptr) cudaIpcCloseMemHandle(p);
    peers_.clear();
    if (safe) {
      cudaFree(base_);
    } else {
      MAGI_WARN(Transport, "a peer never finished reading this rank's window; %zu bytes left allocated", bytes_);
    }
    if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
    if (host_check_ != nullptr) cudaFreeHost(host_check_);
    cudaGetLastError();
    base_ = nullptr;
    own_stream_ = nullptr;
    host_check_ = nullptr;
    host_check_bytes_ = 0;
    attached_ = false;
    sequence_ = 0;
    verified_calls_.clear();
  }

  size_t window_bytes() const override { return base_ != nullptr ? bytes_ : 0; }

  std::vector<size_t> take_stale_bindings() override { return std::exchange(stale_, {}); }

 private:
  // Our CUDA runtime is not the program's: it follows the communicator's device explicitly.
  void use_device() {
    if (device_ < 0) return;
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != device_)
      cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  }

  uint8_t* region() const { return static_cast<uint8_t*>(base_); }
  // Flag words, by their offset from the flags' start.
  uint8_t* base(size_t offset) const { return static_cast<uint8_t*>(base_) + flags_at_ + offset; }
  const uint8_t* peer(int r, size_t offset) const {
    return peers_[static_cast<size_t>(r)] + flags_at_ + offset;
  }

  template <class Visit>
  void for_each_peer(Visit visit) const {
    for (int r = 0; r < nranks_; ++r)
      if (r != rank_) visit(r);
  }

  void add_copy(void* dst, const void* src, size_t bytes) {
    copies_.push_back({dst, src, bytes});
  }

  template <class PeerBase>
  void add_reads(std::span<const GatherOp> bucket, PeerBase peer_base) {
    for (const GatherOp& op : bucket) {
      if (op.bytes == 0) continue;
      auto* recv = static_cast<uint8_t*>(op.recvbuf);
      for (int r = 0; r < nranks_; ++r) {
        uint8_t* into = recv + static_cast<size_t>(r) * op.bytes;
        if (r == rank_) {
          if (into != op.sendbuf) add_copy(into, op.sendbuf, op.bytes);  // else in place
          continue;
        }
        add_copy(into, peer_base(r) + op.slot_offset, op.bytes);
      }
    }
  }

  // One cudaMemcpyBatchAsync: the driver spreads the copies over the copy engines. The legacy
  // default stream does not take batches; there each copy goes on its own.
  void issue_copies(cudaStream_t stream) {
    if (copies_.empty()) return;
    if (stream == nullptr || stream == cudaStreamLegacy) {
      for (const Copy& c : copies_)
        cuda_check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
      return;
    }
    dsts_.clear();
    srcs_.clear();
    sizes_.clear();
    for (const Copy& c : copies_) {
      dsts_.push_back(c.dst);
      srcs_.push_back(c.src);
      sizes_.push_back(c.bytes);
    }
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    attributes.srcLocHint.type = cudaMemLocationTypeDevice;
    attributes.srcLocHint.id = device_ < 0 ? 0 : device_;
    attributes.dstLocHint = attributes.srcLocHint;
    size_t first = 0;
    const cudaError_t batched = cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(),
                                                     copies_.size(), &attributes, &first, 1, stream);
    if (batched == cudaSuccess) return;
    // The peers are already waiting on this bucket's flags: a refused batch (not a broken
    // context) is retried copy by copy rather than leaving them without their bytes.
    cudaGetLastError();
    MAGI_WARN(Transport, "cudaMemcpyBatchAsync refused a bucket (%s); copying one by one",
              cudaGetErrorName(batched));
    for (const Copy& c : copies_)
      cuda_check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync");
  }

  void issue_mem_ops(cudaStream_t stream) {
    if (mem_ops_.empty()) return;
    const CUresult r = batch_mem_op()(reinterpret_cast<CUstream>(stream),
                                      static_cast<unsigned>(mem_ops_.size()), mem_ops_.data(), 0);
    if (r != CUDA_SUCCESS)
      throw Error(ErrorKind::Cuda, "cuStreamBatchMemOp failed (" + std::to_string(static_cast<int>(r)) + ")");
  }

  // Static weights: the rank's shard against its binding, on the first calls and then now and
  // then. Off the steady path: it waits for the stream once per check.
  void verify(std::span<const GatherOp> bucket, cudaStream_t stream) {
    for (const GatherOp& op : bucket) {
      uint64_t& calls = verified_calls_[op.slot_offset];
      ++calls;
      const bool due = calls <= verify_first_ || (verify_every_ != 0 && calls % verify_every_ == 0);
      if (!due || op.bytes == 0) continue;
      if (host_check_bytes_ < 2 * op.bytes) {
        if (host_check_ != nullptr) cudaFreeHost(host_check_);
        host_check_ = nullptr;
        cuda_check(cudaMallocHost(&host_check_, 2 * op.bytes), "cudaMallocHost (verification)");
        host_check_bytes_ = 2 * op.bytes;
      }
      auto* mine = static_cast<uint8_t*>(host_check_);
      cuda_check(cudaMemcpyAsync(mine, op.sendbuf, op.bytes, cudaMemcpyDefault, stream), "cudaMemcpyAsync (verify)");
      cuda_check(cudaMemcpyAsync(mine + op.bytes, region() + op.slot_offset, op.bytes, cudaMemcpyDefault, stream),
                 "cudaMemcpyAsync (verify)");
      cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize (verify)");
      if (std::memcmp(mine, mine + op.bytes, op.bytes) != 0) {
        cuda_check(cudaMemcpyAsync(region() + op.slot_offset, op.sendbuf, op.bytes, cudaMemcpyDefault, stream),
                   "cudaMemcpyAsync (re-bind)");
        stale_.push_back(op.slot_offset);
      }
    }
  }

  bool wait_peers_done(uint64_t target) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_ || peers_[static_cast<size_t>(r)] == nullptr) continue;
      for (;;) {
        uint64_t done = 0;
        if (cudaMemcpy(&done, peer(r, kDoneOffset), sizeof(done), cudaMemcpyDefault) != cudaSuccess) {
          cudaGetLastError();
          return false;
        }
        if (done >= target || !process_alive(peer_pids_[static_cast<size_t>(r)])) break;
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    }
    return true;
  }

  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };

  const int rank_;
  const int nranks_;
  const uint64_t identity_;
  const int device_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t flags_at_ = 0;  // offset of the flag words in the allocation
  size_t slot_bytes_ = 0;
  size_t stride_ = 0;
  bool bound_ = false;
  uint64_t verify_first_ = 0;
  uint64_t verify_every_ = 0;
  cudaStream_t own_stream_ = nullptr;
  std::vector<uint8_t*> peers_;
  std::vector<pid_t> peer_pids_;
  bool attached_ = false;
  uint64_t sequence_ = 0;
  std::vector<Copy> copies_;
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
  std::vector<CUstreamBatchMemOpParams> mem_ops_;
  std::map<size_t, uint64_t> verified_calls_;
  std::vector<size_t> stale_;
  void* host_check_ = nullptr;
  size_t host_check_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Transport> make_cuda_transport(int rank, int nranks, uint64_t comm_identity, int device) {
  if (nranks < 1 || rank < 0 || rank >= nranks)
    throw Error(ErrorKind::Usage, "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  if (!cuda_driver_loaded()) throw Error(ErrorKind::System, "the CUDA driver is not loaded in this process");
  return std::make_unique<CudaTransport>(rank, nranks, comm_identity, device);
}

std::unique_ptr<Transport> make_transport(Backend backend, int rank, int nranks, uint64_t comm_identity,
                                          int device) {
  if (backend == Backend::Host) return make_host_transport(rank, nranks, comm_identity);
  return make_cuda_transport(rank, nranks, comm_identity, device);
}

}  // namespace magi::ce
