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
// 256 MiB shards.
//
// Flags (laid out by protocol.h's FlagLayout, shared with the host backend; this one uses the
// words through own(), never the failed ones): a window holds, for each peer, a ready and a done
// word (64-bit, each on its own 256-byte line) that only that peer writes, through its mapping,
// and one word this rank writes when its own part of a bucket has run. A rank waits only on words
// in its own window: polling stays local, and an abort can release this rank's waits by writing
// them itself without touching what its peers wait on. Measured on an H200 (2026-11): a peer's
// mapping stays readable after the peer dies, and cudaFree, cudaIpcCloseMemHandle and even
// cudaMalloc block while any stream of the device waits on a word that nobody will write.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/backends.h"
#include "ce_transport/exports.h"
#include "ce_transport/process.h"
#include "ce_transport/protocol.h"
#include "ce_transport/sample_plan.h"
#include "ce_transport/source_log.h"
#include "ce_transport/verify_schedule.h"

namespace magi::ce {
namespace {

constexpr size_t kFlagLine = 256;
constexpr size_t kSlotAlign = 256;
constexpr size_t kAllocationGranule = size_t{2} << 20;
// A binding's check in pinned host memory: anchor and sweep sets (sample_plan.h), of the shard
// and of the binding, one set's room each.
constexpr size_t kCheckSet = SamplePlan::kMaxSetBytes;
constexpr size_t kCheckBytes = 4 * kCheckSet;
// What an abandoned wait is released with. Stream waits compare cyclically ((int64_t)(word -
// target) >= 0): the value must be far ahead of any sequence number, yet not wrap past them.
constexpr uint64_t kReleased = uint64_t{1} << 62;
// How long release() waits for peers to finish reading this window, and abandon() for a bucket
// still in flight to end by itself, before giving up on them.
constexpr auto kSettleLimit = std::chrono::seconds(10);
constexpr auto kAbortGrace = std::chrono::seconds(1);

// What the CUDA backend adds to the protocol's blob header: the window's IPC handle.
struct CudaMedium {
  int32_t device;
  int32_t reserved;
  cudaIpcMemHandle_t handle;
};

// A shard about to be bound must still lie inside one live allocation: the program may have
// freed it since the round that chose it, and a copy from unmapped memory would break the
// context for good (an illegal address is sticky), where a refusal only keeps it on NCCL.
void check_bindable(const BindOp& b) {
  const auto range = MAGI_CUDA_DRIVER_FN(cuMemGetAddressRange);
  CUdeviceptr base = 0;
  size_t size = 0;
  const auto at = reinterpret_cast<CUdeviceptr>(b.sendbuf);
  if (range(&base, &size, at) != CUDA_SUCCESS || at + b.bytes > base + size)
    throw Error(ErrorKind::System, "binding a shard: its send buffer is no longer allocated");
}

// The peers' exported allocations this process has mapped. Process-wide: CUDA maps a handle at
// most once per process ("already mapped" the second time), and two communicators may read the
// same peer allocation. Counted; unmapped when the last reader lets go.
class ImportedAllocations {
 public:
  static ImportedAllocations& get() {
    static ImportedAllocations* imports = new ImportedAllocations;  // outlives atexit handlers
    return *imports;
  }
  uint8_t* open(const ExportRecord& record) {
    Key key;
    std::memcpy(key.data(), record.handle, key.size());
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = open_.find(key);
    if (it != open_.end()) {
      ++it->second.readers;
      return it->second.base;
    }
    cudaIpcMemHandle_t handle{};
    std::memcpy(&handle, record.handle, sizeof(handle));
    void* mapped = nullptr;
    cuda_check(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess),
               "cudaIpcOpenMemHandle (a peer's exported shards)");
    open_.emplace(key, Entry{static_cast<uint8_t*>(mapped), 1});
    return static_cast<uint8_t*>(mapped);
  }
  void close(uint8_t* base) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = open_.begin(); it != open_.end(); ++it) {
      if (it->second.base != base) continue;
      if (--it->second.readers == 0) {
        cudaIpcCloseMemHandle(base);
        cudaGetLastError();
        open_.erase(it);
      }
      return;
    }
  }

 private:
  using Key = std::array<uint8_t, sizeof(ExportRecord::handle)>;
  struct Entry {
    uint8_t* base;
    size_t readers;
  };
  std::mutex mutex_;
  std::map<Key, Entry> open_;
};

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
  CudaTransport(int rank, int nranks, uint64_t identity, int device, const Options::Fault& fault)
      : rank_(rank),
        nranks_(nranks),
        identity_(identity),
        device_(device),
        flags_{kFlagLine, nranks},
        faults_(fault, rank) {}
  ~CudaTransport() override {
    try {
      release();
    } catch (...) {}
  }

  void prepare(const WindowPlan& plan, HandleBlob& out) override {
    std::lock_guard<std::mutex> lock(lifetime_);
    release_locked();
    faults_.at_prepare();
    use_device();
    slot_bytes_ = plan.slot_bytes;
    bound_ = plan.bound;
    zero_copy_ = plan.bound && plan.zero_copy;
    if (bound_) {
      sources_ = exports::bound_sources(plan, Backend::Cuda);
      bind_ = plan.bind;
      bind_index_.reset(plan.bind);
      references_.reset(plan.bind.size());
    }
    stride_ =
        round_up(std::max<size_t>(bound_ ? sources_.region_bytes : plan.slot_bytes, 1), kSlotAlign);
    verify_.reset(plan.verify_first, plan.verify_every);
    flags_at_ = (bound_ ? 1 : 2) * stride_;
    flag_bytes_ = flags_.bytes_through_own();
    bytes_ = round_up(flags_at_ + flag_bytes_, kAllocationGranule);
    abandoned_.store(false);
    settled_at_ = kNotSettled;
    cuda_check(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags");
    cuda_check(cudaMallocHost(&flags_host_, flag_bytes_), "cudaMallocHost (flags)");
    if (bound_) cuda_check(cudaMallocHost(&host_check_, kCheckBytes), "cudaMallocHost (check)");
    cuda_check(cudaMalloc(&base_, bytes_), "cudaMalloc (window)");
    cuda_check(cudaMemsetAsync(flag(0), 0, flag_bytes_, own_stream_), "cudaMemsetAsync (flags)");
    if (bound_) {
      // The shards must hold what the program last wrote: wait for all its work once, here,
      // at the plan's start, never on the call path.
      cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (binding)");
      for (size_t i = 0; i < plan.bind.size(); ++i) {
        const BindOp& b = plan.bind[i];
        if (b.bytes > slot_bytes_ || b.slot_offset > slot_bytes_ - b.bytes)
          throw Error(ErrorKind::Usage, "a binding overflows the bound region");
        const ShardSource& source = sources_.table.sources[i];
        if (b.bytes == 0 || source.allocation != ShardSource::kInWindow) continue;
        check_bindable(b);
        cuda_check(cudaMemcpyAsync(region() + source.offset, b.sendbuf, b.bytes, cudaMemcpyDefault,
                                   own_stream_),
                   "cudaMemcpyAsync (binding)");
      }
    }
    cuda_check(cudaStreamSynchronize(own_stream_), "cudaStreamSynchronize (window)");
    shape_ = {
        Backend::Cuda, identity_, nranks_, bytes_, zero_copy_ ? sources_.region_bytes : slot_bytes_,
        bound_,        zero_copy_};
    CudaMedium medium{};
    medium.device = device_;
    cuda_check(cudaIpcGetMemHandle(&medium.handle, base_), "cudaIpcGetMemHandle");
    if (bound_) log_.create(rank_, nranks_);
    protocol::write_blob(shape_, rank_, bound_ ? log_.name() : std::string(), medium, out);
  }

  const SourceTable& sources() const override {
    static const SourceTable kNone;
    return zero_copy_ ? sources_.table : kNone;
  }

  void attach(std::span<const HandleBlob> blobs, std::span<const SourceTable> tables) override {
    if (base_ == nullptr) throw Error(ErrorKind::Usage, "attach before prepare");
    if (blobs.size() != static_cast<size_t>(nranks_))
      throw Error(ErrorKind::Usage, "one handle blob per rank");
    if (zero_copy_ && tables.size() != static_cast<size_t>(nranks_))
      throw Error(ErrorKind::Usage, "a zero-copy window needs every rank's source table");
    faults_.at_attach();
    std::lock_guard<std::mutex> lock(lifetime_);
    use_device();
    if (nranks_ > 1)
      MAGI_CUDA_DRIVER_FN(cuStreamBatchMemOp);  // refuse now, not on the first gather
    peers_.assign(static_cast<size_t>(nranks_), nullptr);
    peer_pids_.assign(static_cast<size_t>(nranks_), 0);
    peer_flags_at_.assign(static_cast<size_t>(nranks_), flags_at_);
    peer_window_bytes_.assign(static_cast<size_t>(nranks_), bytes_);
    std::vector<std::string> logs(static_cast<size_t>(nranks_));
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) continue;
      protocol::BlobHeader header{};
      const auto medium =
          protocol::read_blob<CudaMedium>(blobs[static_cast<size_t>(r)], r, shape_, header);
      void* mapped = nullptr;
      cuda_check(cudaIpcOpenMemHandle(&mapped, medium.handle, cudaIpcMemLazyEnablePeerAccess),
                 "cudaIpcOpenMemHandle");
      peers_[static_cast<size_t>(r)] = static_cast<uint8_t*>(mapped);
      peer_pids_[static_cast<size_t>(r)] = static_cast<pid_t>(header.pid);
      logs[static_cast<size_t>(r)] = protocol::source_log_of(header);
      if (zero_copy_) {  // its window holds its own region, then its flags (prepare's layout)
        const size_t flags_at = round_up(std::max<size_t>(header.slot_bytes, 1), kSlotAlign);
        if (flags_at + flag_bytes_ > header.window_bytes)
          throw Error(ErrorKind::Usage,
                      "rank " + std::to_string(r) + "'s window has no room for its flags");
        peer_flags_at_[static_cast<size_t>(r)] = flags_at;
        peer_window_bytes_[static_cast<size_t>(r)] = header.window_bytes;
      }
    }
    if (bound_) {
      // Each peer's shards: in its window's region (before its flags), or in its exported
      // allocations, mapped once per process (ImportedAllocations).
      std::vector<exports::Span> regions(static_cast<size_t>(nranks_));
      for (int r = 0; r < nranks_; ++r)
        if (r != rank_)
          regions[static_cast<size_t>(r)] = {peers_[static_cast<size_t>(r)],
                                             peer_flags_at_[static_cast<size_t>(r)]};
      peer_sources_ = exports::locate_peer_sources(
          rank_, bind_, zero_copy_ ? tables : std::span<const SourceTable>{}, regions,
          [&](const ExportRecord& record) {
            imports_.push_back(ImportedAllocations::get().open(record));
            return exports::Span{imports_.back(), record.bytes};
          });
      log_.open_peers(logs);
    }
    attached_ = true;
  }

  Served gather(std::span<const GatherOp> bucket, void* stream_handle,
                Timing timing = Timing::Untimed) override {
    if (!attached_) throw Error(ErrorKind::Usage, "gather before attach");
    if (abandoned_.load())
      throw Error(ErrorKind::Usage, "gather after the communicator was aborted");
    faults_.at_bucket_start();
    use_device();
    const auto stream = static_cast<cudaStream_t>(stream_handle);
    for (const GatherOp& op : bucket)
      if (op.bytes > slot_bytes_ || op.slot_offset > slot_bytes_ - op.bytes)
        throw Error(ErrorKind::Usage, "a gather overflows its slot");
    const uint64_t n = sequence_.load() + 1;
    sequence_.store(n);
    copies_.clear();
    if (bound_) {
      finish_check(stream);
      add_reads(bucket, [&](int r, const GatherOp& op) {  // where that peer keeps its shard
        return peer_sources_[static_cast<size_t>(r) * bind_.size() + bound_index(op)];
      });
      issue_copies(stream);
      for (const GatherOp& op : bucket)
        if (op.own_offset != GatherOp::kOwn && op.own_offset != op.slot_offset)
          log_.deviate(n, op.own_offset, op.slot_offset);
      log_.publish(n);
      // After the reads, so the gather is not delayed by it; before the bucket's end marks, so a
      // release that sees this bucket finished knows the check's copies have run too.
      start_check(bucket, stream, timing);
      finish_bucket(n, stream);
      return Served::Moved;
    }
    // MAGI_INJECT_FAULT=gather:RANK fails here, before anything of the bucket is queued: its
    // peers cannot learn of it within the bucket (ce_transport.h), so it throws, as a CUDA error
    // at step 1 would.
    if (faults_.fails_bucket())
      throw Error(ErrorKind::Cuda,
                  "bucket " + std::to_string(n) + ": injected by MAGI_INJECT_FAULT");
    const size_t slot = (n % 2) * stride_;
    // 1. Slot n % 2 was last read in bucket n - 2: every peer must be done with it.
    mem_ops_.clear();
    if (n > 2)
      for_each_peer([&](int r) { mem_ops_.push_back(wait_op(flag(flags_.done(r)), n - 2)); });
    issue_mem_ops(stream);
    // 2. Stage this rank's shards.
    for (const GatherOp& op : bucket)
      if (op.bytes != 0)
        add_copy(static_cast<uint8_t*>(base_) + slot + op.slot_offset, op.sendbuf, op.bytes);
    issue_copies(stream);
    // 3. Staged: say so in every peer's window, and wait until every peer has said so in ours.
    mem_ops_.clear();
    for_each_peer(
        [&](int r) { mem_ops_.push_back(write_op(peer_flag(r, flags_.ready(rank_)), n)); });
    for_each_peer([&](int r) { mem_ops_.push_back(wait_op(flag(flags_.ready(r)), n)); });
    issue_mem_ops(stream);
    // 4. Read every peer's slot, and this rank's shard from its send buffer.
    copies_.clear();
    add_reads(bucket, [&](int r, const GatherOp& op) {
      return peers_[static_cast<size_t>(r)] + slot + op.slot_offset;
    });
    issue_copies(stream);
    // 5. Done reading: peers may reuse their slot n % 2 (in bucket n + 2).
    finish_bucket(n, stream);
    return Served::Moved;
  }

  void abandon() override {
    std::lock_guard<std::mutex> lock(lifetime_);
    abandoned_.store(true);
    if (base_ == nullptr || !attached_) return;
    use_device();
    // A healthy abort (the program's shutdown) finds every bucket run or about to be; anything
    // else is released at once (a dead peer) or after a short grace (a peer that stalls).
    const uint64_t target = sequence_.load();
    std::string unfinished;  // not said: an abort that finds a bucket in flight says so at release
    if (settle(target, kAbortGrace, unfinished) == Settled::Finished) {
      settled_at_ = target;
    } else {
      release_waits();
    }
  }

  void release() override {
    std::lock_guard<std::mutex> lock(lifetime_);
    release_locked();
  }

  size_t window_bytes() const override { return base_ != nullptr ? bytes_ : 0; }

  WindowMemory memory() const override {
    WindowMemory m = sources_.memory;
    m.window_bytes = window_bytes();
    m.peer_mappings = imports_.size();
    return m;
  }

  std::vector<size_t> take_stale_bindings() override { return std::exchange(stale_, {}); }
  uint64_t checked_bytes() const override { return checked_bytes_; }
  std::string take_disagreement() override { return log_.check(); }

 private:
  void release_locked() {
    if (base_ == nullptr) {  // never prepared, or prepare failed part way
      if (own_stream_ != nullptr) cudaStreamDestroy(own_stream_);
      if (flags_host_ != nullptr) cudaFreeHost(flags_host_);
      if (host_check_ != nullptr) cudaFreeHost(host_check_);
      own_stream_ = nullptr;
      flags_host_ = nullptr;
      host_check_ = nullptr;
      cudaGetLastError();
      return;
    }
    use_device();
    const uint64_t target = sequence_.load();
    Settled settled = Settled::Finished;
    std::string unfinished;
    if (attached_ && target > 0) {
      if (abandoned_.load()) {
        settled = settled_at_ == target ? Settled::Finished : Settled::Abandoned;
      } else {
        settled = settle(target, kSettleLimit, unfinished);
      }
    } else {
      // Nothing was gathered: only this rank's own setup (flags, binding) may still be queued.
      if (cudaStreamSynchronize(own_stream_) != cudaSuccess) settled = Settled::Unreadable;
    }
    if (settled == Settled::Finished) {
      for (uint8_t* p : peers_)
        if (p != nullptr) cudaIpcCloseMemHandle(p);
      for (uint8_t* p : imports_) ImportedAllocations::get().close(p);
      cudaFree(base_);
      cudaFreeHost(flags_host_);
      if (host_check_ != nullptr) cudaFreeHost(host_check_);
    } else {
      // This rank's stream must not wait for ever on peers that will never come; freeing would
      // wait for the whole device (see the top of this file). The process's end returns it all.
      release_waits();
      MAGI_WARN(Transport,
                "window of %zu bytes left allocated, with its %d peer mappings and %zu mapped "
                "peer allocations: %s",
                bytes_, nranks_ - 1, imports_.size(), settled_name(settled, unfinished).c_str());
    }
    cudaStreamDestroy(own_stream_);  // returns at once; the stream goes when its work has run
    cudaGetLastError();
    base_ = nullptr;
    own_stream_ = nullptr;
    flags_host_ = nullptr;
    host_check_ = nullptr;
    checked_bytes_ = 0;
    log_.close();
    peers_.clear();
    imports_.clear();
    peer_sources_.clear();
    sources_ = {};
    bind_.clear();
    zero_copy_ = false;
    attached_ = false;
    sequence_.store(0);
    verify_.reset(0, 0);
    if (check_.copied != nullptr) cudaEventDestroy(check_.copied);  // freed once it has passed
    check_ = {};
  }

  // Our CUDA runtime is not the program's: it follows the communicator's device explicitly.
  void use_device() {
    if (device_ < 0) return;
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != device_)
      cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  }

  uint8_t* region() const { return static_cast<uint8_t*>(base_); }
  // Flag words, by their offset from the flags' start (flags_): in this rank's window, and in
  // peer r's.
  uint8_t* flag(size_t offset) const { return static_cast<uint8_t*>(base_) + flags_at_ + offset; }
  uint8_t* peer_flag(int r, size_t offset) const {
    return peers_[static_cast<size_t>(r)] + peer_flags_at_[static_cast<size_t>(r)] + offset;
  }

  // The bind index of a bound gather (its slot offset must be one the plan bound).
  size_t bound_index(const GatherOp& op) const {
    const int64_t index = bind_index_.find(op.slot_offset);
    if (index < 0)
      throw Error(ErrorKind::Usage, "a gather at slot offset " + std::to_string(op.slot_offset) +
                                        " that the plan did not bind");
    return static_cast<size_t>(index);
  }

  // Bucket n has run on this rank: its reads are done (peers may reuse what it read) and its
  // own part is over (release() may free what it used).
  void finish_bucket(uint64_t n, cudaStream_t stream) {
    mem_ops_.clear();
    for_each_peer(
        [&](int r) { mem_ops_.push_back(write_op(peer_flag(r, flags_.done(rank_)), n)); });
    mem_ops_.push_back(write_op(flag(flags_.own()), n));
    issue_mem_ops(stream);
  }

  template <class Visit>
  void for_each_peer(Visit visit) const {
    for (int r = 0; r < nranks_; ++r)
      if (r != rank_) visit(r);
  }

  void add_copy(void* dst, const void* src, size_t bytes) { copies_.push_back({dst, src, bytes}); }

  // A bucket's reads: every peer's part of each gather from `peer_part(r, op)`, this rank's own
  // from its send buffer.
  template <class PeerPart>
  void add_reads(std::span<const GatherOp> bucket, PeerPart peer_part) {
    for (const GatherOp& op : bucket) {
      if (op.bytes == 0) continue;
      auto* recv = static_cast<uint8_t*>(op.recvbuf);
      for (int r = 0; r < nranks_; ++r) {
        uint8_t* into = recv + static_cast<size_t>(r) * op.bytes;
        if (r == rank_) {
          if (into != op.sendbuf) add_copy(into, op.sendbuf, op.bytes);  // else in place
          continue;
        }
        add_copy(into, peer_part(r, op), op.bytes);
      }
    }
  }

  // One cudaMemcpyBatchAsync: the driver spreads the copies over the copy engines. The legacy
  // default stream does not take batches; there each copy goes on its own.
  void issue_copies(cudaStream_t stream) {
    if (copies_.empty()) return;
    if (stream == nullptr || stream == cudaStreamLegacy) {
      for (const Copy& c : copies_)
        cuda_check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream),
                   "cudaMemcpyAsync");
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
    const cudaError_t batched = cudaMemcpyBatchAsync(
        dsts_.data(), srcs_.data(), sizes_.data(), copies_.size(), &attributes, &first, 1, stream);
    if (batched == cudaSuccess) return;
    // The peers are already waiting on this bucket's flags: a refused batch (not a broken
    // context) is retried copy by copy rather than leaving them without their bytes.
    cudaGetLastError();
    MAGI_WARN(Transport, "cudaMemcpyBatchAsync refused a bucket (%s); copying one by one",
              cudaGetErrorName(batched));
    for (const Copy& c : copies_)
      cuda_check(cudaMemcpyAsync(c.dst, c.src, c.bytes, cudaMemcpyDefault, stream),
                 "cudaMemcpyAsync");
  }

  void issue_mem_ops(cudaStream_t stream) {
    if (mem_ops_.empty()) return;
    cuda_check(MAGI_CUDA_DRIVER_FN(cuStreamBatchMemOp)(reinterpret_cast<CUstream>(stream),
                                                       static_cast<unsigned>(mem_ops_.size()),
                                                       mem_ops_.data(), 0),
               "cuStreamBatchMemOp");
  }

  // Static weights: the rank's shard checked when verify_ says (never on a timed call), on the
  // lines sample_plan.h picks. A bound shard is compared with its binding; an exported one has
  // none, so the memory its peers read (the agreed source, while its allocation is the one
  // exported: a freed one is pinned by the peers' mappings, exports.h) and the buffer this call
  // sends (when another) are compared with what the first look at each set saw. The program's
  // stream is never waited for: the lines are copied to the host on it, stream-ordered (the
  // shard as this call saw it, and never after the program freed it), and compared at a later
  // call once those copies have run. One check at a time; another that falls due meanwhile is
  // owed to a later call.
  void start_check(std::span<const GatherOp> bucket, cudaStream_t stream, Timing timing) {
    for (const GatherOp& op : bucket) {
      if (op.verify_now) verify_.owe(op.slot_offset);
      if (!verify_.on_call(op.slot_offset, timing) || op.bytes == 0) continue;
      if (check_.pending) {
        verify_.owe(op.slot_offset);
        continue;
      }
      if (check_.copied == nullptr)
        cuda_check(cudaEventCreateWithFlags(&check_.copied, cudaEventDisableTiming),
                   "cudaEventCreate (verify)");
      const size_t index = bound_index(op);
      const ShardSource& source = sources_.table.sources[index];
      const SamplePlan plan(op.bytes);
      check_.anchor = plan.anchor();
      check_.sweep = plan.sweep(verify_.begin_check(op.slot_offset));
      if (check_.sweep.first == 0) check_.sweep = {};  // the anchor itself: compared once
      check_.index = index;
      check_.in_place = source.allocation != ShardSource::kInWindow;
      auto* host = static_cast<uint8_t*>(host_check_);
      const auto* shard = static_cast<const uint8_t*>(op.sendbuf);
      // Sets 0 and 2 (anchor, sweep): the reference side; 1 and 3: the shard this call sends.
      const uint8_t* reference = nullptr;
      if (!check_.in_place) {
        reference = region() + source.offset;
      } else {
        const auto* agreed = static_cast<const uint8_t*>(bind_[index].sendbuf);
        const bool alive =
            identify_buffer(Backend::Cuda,
                            reinterpret_cast<const void*>(sources_.export_bases[source.allocation]))
                .allocation_id == sources_.identities[source.allocation];
        if (alive) reference = agreed;
        if (shard == agreed) shard = alive ? nullptr : agreed;  // one look is enough
      }
      check_.reference_copied = reference != nullptr;
      check_.shard_copied = shard != nullptr;
      if (reference != nullptr) {
        copy_lines(host, reference, check_.anchor, stream);
        copy_lines(host + 2 * kCheckSet, reference, check_.sweep, stream);
      }
      if (shard != nullptr) {
        copy_lines(host + kCheckSet, shard, check_.anchor, stream);
        copy_lines(host + 3 * kCheckSet, shard, check_.sweep, stream);
      }
      cuda_check(cudaEventRecord(check_.copied, stream), "cudaEventRecord (verify)");
      check_.pending = true;
      check_.op = op;
      // The shard's bytes looked at: a binding's copy is not counted (checked_bytes()); an
      // exported shard's agreed source and re-homed buffer are both the shard.
      const size_t looks =
          check_.in_place ? (reference != nullptr ? 1 : 0) + (shard != nullptr ? 1 : 0) : 1;
      checked_bytes_ += (check_.anchor.bytes() + check_.sweep.bytes()) * looks;
    }
  }

  // The lines of `set` from `from` into `into`, packed: the full lines in one strided copy (one
  // copy-engine operation), a short last line in a second. The source pitch, S, is about B / 256
  // (B >= 64 KiB): under the devices' maximum pitch (cudaDevAttrMaxPitch, 2^31 - 1 on current GPUs)
  // for any shard that fits in one.
  static void copy_lines(uint8_t* into, const uint8_t* from, const SampleSet& set,
                         cudaStream_t stream) {
    if (set.rows != 0)
      cuda_check(cudaMemcpy2DAsync(into, SampleSet::kLine, from + set.first, set.stride,
                                   SampleSet::kLine, set.rows, cudaMemcpyDefault, stream),
                 "cudaMemcpy2DAsync (verify)");
    if (set.tail_bytes != 0)
      cuda_check(cudaMemcpyAsync(into + set.rows * SampleSet::kLine, from + set.offset(set.rows),
                                 set.tail_bytes, cudaMemcpyDefault, stream),
                 "cudaMemcpyAsync (verify)");
  }

  // The check in flight, if its copies have run: a bound shard that changed is re-bound whole
  // on this call's stream (ahead of its reads); a change is reported by take_stale_bindings().
  void finish_check(cudaStream_t stream) {
    if (!check_.pending) return;
    const cudaError_t state = cudaEventQuery(check_.copied);
    if (state == cudaErrorNotReady) {
      cudaGetLastError();
      return;
    }
    check_.pending = false;
    cuda_check(state, "cudaEventQuery (verify)");
    const GatherOp& op = check_.op;
    const auto* host = static_cast<const uint8_t*>(host_check_);
    const bool elsewhere = exports::sent_elsewhere(op, bind_[check_.index]);
    if (!check_.in_place) {
      if (std::memcmp(host, host + kCheckSet, check_.anchor.bytes()) != 0 ||
          std::memcmp(host + 2 * kCheckSet, host + 3 * kCheckSet, check_.sweep.bytes()) != 0) {
        // Sent from elsewhere: the peers read bytes that call did not send (exports.h).
        if (elsewhere)
          log_.mark_broken(sequence_.load(), bind_[check_.index].slot_offset);
        else
          cuda_check(cudaMemcpyAsync(region() + sources_.table.sources[check_.index].offset,
                                     op.sendbuf, op.bytes, cudaMemcpyDefault, stream),
                     "cudaMemcpyAsync (re-bind)");
        stale_.push_back(op.slot_offset);
      }
      return;
    }
    bool same = true;
    auto look = [&](const uint8_t* packed, const SampleSet& set, bool learn) {
      if (set.lines() == 0 || (!learn && !references_.has(check_.index, set.first))) return;
      if (!references_.matches(check_.index, set.first, exports::hash_packed(packed, set)))
        same = false;
    };
    // The agreed source sets the references; a re-homed shard is only compared with them.
    if (check_.reference_copied) {
      look(host, check_.anchor, true);
      look(host + 2 * kCheckSet, check_.sweep, true);
    }
    if (check_.shard_copied) {
      look(host + kCheckSet, check_.anchor, false);
      look(host + 3 * kCheckSet, check_.sweep, false);
    }
    // Sent from elsewhere (or the exported allocation is gone), and the bytes differ: the
    // allocator gave the block the peers read to another tensor, or the call's shard is not the
    // one they read. The promise may have held; the peers must still hear of it.
    if (!same && (elsewhere || !check_.reference_copied))
      log_.mark_broken(sequence_.load(), bind_[check_.index].slot_offset);
    if (!same) stale_.push_back(op.slot_offset);
  }

  // Why a window could not be freed; `ranks` names the peers concerned, where there are any.
  enum class Settled : uint8_t {
    Finished,
    PeerDied,
    OwnStreamBehind,
    PeersBehind,
    Abandoned,
    Unreadable
  };
  static std::string settled_name(Settled s, const std::string& ranks) {
    switch (s) {
      case Settled::Finished: return "finished";
      case Settled::PeerDied: return "rank " + ranks + " died before it finished reading it";
      case Settled::OwnStreamBehind:
        return "this rank's stream had not run its last moved gather within " +
               std::to_string(kSettleLimit.count()) + " s (work queued before it" +
               (ranks.empty() ? std::string(")") : ", or a wait on rank(s) " + ranks + ")");
      case Settled::PeersBehind:
        return "rank(s) " + ranks + " had not finished reading it within " +
               std::to_string(kSettleLimit.count()) + " s";
      case Settled::Abandoned: return "the communicator was aborted with a bucket in flight";
      case Settled::Unreadable: return "its flags could not be read";
    }
    return "?";
  }

  // This rank's flag words as they are now, read on its own stream (never the program's, which
  // may be the one stuck).
  bool read_flags() {
    if (cudaMemcpyAsync(flags_host_, flag(0), flag_bytes_, cudaMemcpyDeviceToHost, own_stream_) !=
            cudaSuccess ||
        cudaStreamSynchronize(own_stream_) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  }
  uint64_t read_word(size_t offset) const {
    uint64_t v = 0;
    std::memcpy(&v, static_cast<const uint8_t*>(flags_host_) + offset, sizeof(v));
    return v;
  }

  // Waits up to `limit` until buckets 1..target have run here and every peer has finished
  // reading this window. A peer whose process ended before finishing died mid-run: this rank
  // gives up on it at once (NCCL's kernels may be stuck on it too, and freeing would then hang).
  // `ranks` gets the peers that had not finished, for the warning.
  Settled settle(uint64_t target, std::chrono::steady_clock::duration limit, std::string& ranks) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (;;) {
      if (!read_flags()) return Settled::Unreadable;
      const bool own_done = read_word(flags_.own()) >= target;
      ranks.clear();
      for (int r = 0; r < nranks_; ++r) {
        if (r == rank_ || read_word(flags_.done(r)) >= target) continue;
        if (!process_alive(peer_pids_[static_cast<size_t>(r)])) {
          ranks = std::to_string(r);
          return Settled::PeerDied;
        }
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
      }
      if (own_done && ranks.empty()) return Settled::Finished;
      if (std::chrono::steady_clock::now() >= deadline)
        return own_done ? Settled::PeersBehind : Settled::OwnStreamBehind;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Every wait of this rank, queued or to come, passes: its own window's ready and done words.
  // Not mem_ops_: a call may be filling that on another thread.
  void release_waits() {
    std::vector<CUstreamBatchMemOpParams> ops;
    for_each_peer([&](int r) {
      ops.push_back(write_op(flag(flags_.ready(r)), kReleased));
      ops.push_back(write_op(flag(flags_.done(r)), kReleased));
    });
    if (ops.empty()) return;
    const CudaDriver* driver = cuda_driver();
    if (driver == nullptr || driver->cuStreamBatchMemOp_fn == nullptr ||
        driver->cuStreamBatchMemOp_fn(reinterpret_cast<CUstream>(own_stream_),
                                      static_cast<unsigned>(ops.size()), ops.data(),
                                      0) != CUDA_SUCCESS ||
        cudaStreamSynchronize(own_stream_) != cudaSuccess) {
      cudaGetLastError();
      MAGI_WARN(Transport,
                "could not release this rank's waits on its peers; its stream may stay blocked");
    }
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
  const protocol::FlagLayout flags_;  // where the flag words lie (after the slots)
  bool zero_copy_ = false;
  exports::SourcePlan sources_;               // bound: where each of this rank's shards is read
  std::vector<BindOp> bind_;                  // bound: the agreed sources, by bind index
  exports::BindIndex bind_index_;             // slot offset -> bind index
  std::vector<const uint8_t*> peer_sources_;  // [peer * shards + bind index]
  std::vector<uint8_t*> imports_;             // opened through ImportedAllocations
  exports::SampleReferences references_;      // exported shards: what the first looks saw
  SourceLog log_;                             // bound: what this rank read, for its peers
  std::vector<size_t> peer_flags_at_;         // by rank: where its flags lie in its window
  std::vector<size_t> peer_window_bytes_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t flags_at_ = 0;  // offset of the flag words in the allocation
  size_t slot_bytes_ = 0;
  size_t stride_ = 0;
  bool bound_ = false;
  protocol::WindowShape shape_;  // what every peer's blob must match
  const protocol::FaultPoints faults_;
  VerifySchedule verify_;  // bound: when each binding is checked
  struct Check {
    bool pending = false;  // its copies are queued; compared once `copied` has passed
    GatherOp op{};
    size_t index = 0;       // in the plan's bind
    bool in_place = false;  // an exported shard: compared with references_, not a binding
    bool reference_copied = false;
    bool shard_copied = false;
    SampleSet anchor;
    SampleSet sweep;  // empty when it was the anchor
    cudaEvent_t copied = nullptr;
  } check_;
  cudaStream_t own_stream_ = nullptr;
  std::vector<uint8_t*> peers_;
  std::vector<pid_t> peer_pids_;
  bool attached_ = false;
  std::atomic<uint64_t> sequence_{0};  // the last bucket queued; read by abandon() from any thread
  std::atomic<bool> abandoned_{false};
  static constexpr uint64_t kNotSettled = ~uint64_t{0};
  uint64_t settled_at_ = kNotSettled;  // abandon() found buckets 1..settled_at_ all finished
  std::mutex lifetime_;  // prepare, release and abandon, which may come from another thread
  void* flags_host_ = nullptr;
  size_t flag_bytes_ = 0;
  std::vector<Copy> copies_;
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
  std::vector<CUstreamBatchMemOpParams> mem_ops_;
  std::vector<size_t> stale_;
  void* host_check_ = nullptr;  // bound: kCheckBytes, pinned
  uint64_t checked_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Transport> make_cuda_transport(int rank, int nranks, uint64_t comm_identity,
                                               int device, const Options::Fault& fault) {
  if (nranks < 1 || rank < 0 || rank >= nranks)
    throw Error(ErrorKind::Usage, "rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  if (!cuda_driver_loaded())
    throw Error(ErrorKind::System, "the CUDA driver is not loaded in this process");
  return std::make_unique<CudaTransport>(rank, nranks, comm_identity, device, fault);
}

std::unique_ptr<Transport> make_transport(Backend backend, int rank, int nranks,
                                          uint64_t comm_identity, int device) {
  if (backend == Backend::Host) return make_host_transport(rank, nranks, comm_identity);
  return make_cuda_transport(rank, nranks, comm_identity, device);
}

}  // namespace magi::ce
