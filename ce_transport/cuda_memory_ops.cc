// Device memory for the window transport (memory_ops.h): windows shared through CUDA IPC,
// copy-engine reads (cudaMemcpyBatchAsync: cuda_copies.cc) on the caller's stream, and the flag
// words written and waited for by stream memory operations (cuda_stream_ops.cc). Everything is
// enqueued on the caller's stream: the host never waits, no kernel is launched, no SM is used.
// The peers' exported allocations are mapped in cuda_imports.cc, windows that graphs still read
// kept in cuda_graphs.cc; which words a step writes, and when a window may be freed, is the
// transport's (window_transport.cc, window_end.h): this file only executes.
//
// Why the window is cudaMalloc + CUDA IPC handles rather than VMM with POSIX file descriptors: an
// fd reaches another process only over a Unix socket (or pidfd_getfd, which needs ptrace
// rights); an IPC handle is 64 plain bytes that travel in the publish round through the
// communicator itself. Only the program's own cuMemCreate memory, which legacy IPC refuses, is
// read by descriptor (static weights: fd_channel.h, the descriptor channel's server started at
// the first such export of a plan). A handle cannot be opened by the process that exported it,
// which is no loss: a rank reads its own window through its own pointer. A window is one
// allocation, so one mapping per peer: a communicator costs nranks - 1 mappings per process, far
// below drivers' limits.
//
// Layout: the slots (or the bound region) start at offset 0 of the allocation, the flags follow
// them, and the allocation is rounded up to 2 MiB. Measured on an H200: copies out of a region
// that starts 512 bytes into its allocation ran at 78-80% of the same copies from offset 0 for
// 256 MiB shards.
//
// Flags (protocol.h's FlagLayout, on 256-byte lines): the ready and done words of every peer, the
// own word and the graph slots' latches; never the failed ones, which only synchronous memory
// can act on. A window is freed only once it has settled (window_end.h says why).
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "base/base.h"
#include "base/cuda_driver.h"
#include "ce_transport/backends.h"
#include "ce_transport/cuda_memory.h"
#include "ce_transport/cuda_thread.h"
#include "ce_transport/exports.h"
#include "ce_transport/fd_channel.h"
#include "ce_transport/memory_ops.h"

namespace magi::ce {
namespace {

constexpr size_t kFlagLine = 256;
constexpr size_t kAllocationGranule = size_t{2} << 20;

// What the CUDA medium holds: the window's IPC handle, and the GPU's UUID (all zero where it
// could not be read), which tells the ranks that share a GPU apart from the device number, since
// each process numbers the devices it sees.
struct CudaMedium {
  int32_t device;
  int32_t reserved;
  cudaIpcMemHandle_t handle;
  std::array<uint8_t, 16> gpu;
};
static_assert(sizeof(CudaMedium) <= protocol::kMediumBytes);

// The UUID of CUDA device `device`; all zero where the driver cannot tell it (the ranks then
// never count as sharing a GPU).
std::array<uint8_t, 16> gpu_uuid(int device) {
  std::array<uint8_t, 16> uuid{};
  const CudaDriver* driver = cuda_driver();
  CUdevice handle = 0;
  CUuuid id{};
  if (driver == nullptr || driver->cuDeviceGet_fn == nullptr ||
      driver->cuDeviceGetUuid_fn == nullptr ||
      driver->cuDeviceGet_fn(&handle, device) != CUDA_SUCCESS ||
      driver->cuDeviceGetUuid_fn(&id, handle) != CUDA_SUCCESS)
    return uuid;
  std::memcpy(uuid.data(), id.bytes, uuid.size());
  return uuid;
}

// A shard about to be bound must still lie inside one live allocation: the program may have
// freed it since the round that chose it, and a copy from unmapped memory would break the
// context for good (an illegal address is sticky), where a refusal only keeps it on NCCL.
void check_bindable(const Copy& shard) {
  const auto range = MAGI_CUDA_DRIVER_FN(cuMemGetAddressRange);
  CUdeviceptr base = 0;
  size_t size = 0;
  const auto at = reinterpret_cast<CUdeviceptr>(shard.src);
  if (range(&base, &size, at) != CUDA_SUCCESS || at + shard.bytes > base + size)
    throw Error(ErrorKind::System, "binding a shard: its send buffer is no longer allocated");
}

class CudaMemoryOps final : public MemoryOps {
 public:
  CudaMemoryOps(int rank, int nranks, uint64_t identity, int device)
      : rank_(rank),
        nranks_(nranks),
        identity_(identity),
        device_(device),
        flags_{kFlagLine, nranks} {}

  Backend backend() const override { return Backend::Cuda; }
  bool synchronous() const override { return false; }
  const protocol::FlagLayout& flags() const override { return flags_; }
  int relax_capture() override { return relax_capture_mode(); }
  void restore_capture(int saved) override { restore_capture_mode(saved); }
  bool paces_mappings() const override { return true; }
  // Our CUDA runtime is not the program's: it follows the communicator's device explicitly.
  void use() override {
    if (device_ < 0) return;
    int current = -1;
    if (cudaGetDevice(&current) != cudaSuccess || current != device_)
      cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  }
  // On a thread that never called CUDA (the set-up's), cudaGetDevice answers device 0 without
  // making a context current there, and the driver's calls (cuMemGetAddressRange for each
  // export) then fail: every shard was bound instead of read in place. cudaSetDevice makes the
  // device's context current.
  void use_on_any_thread() override {
    if (device_ >= 0) cuda_check(cudaSetDevice(device_), "cudaSetDevice");
  }

  WindowView allocate(size_t slot_bytes, bool bound, bool graph_slots,
                      std::span<const uint8_t> first_flags, size_t held_bytes) override {
    free_kept_for_graphs();
    stride_ = round_up(std::max<size_t>(slot_bytes, 1), kSlotAlignment);
    flags_at_ = (bound ? 1 : graph_slots ? 4 : 2) * stride_;
    flag_bytes_ = flags_.bytes_but_failed();
    const size_t held_at = round_up(flags_at_ + flag_bytes_, kSlotAlignment);
    bytes_ = round_up(held_at + held_bytes, kAllocationGranule);
    cuda_check(cudaStreamCreateWithFlags(&own_stream_, cudaStreamNonBlocking),
               "cudaStreamCreateWithFlags");
    cuda_check(cudaMallocHost(&flags_host_, flag_bytes_), "cudaMallocHost (flags)");
    if (bound || held_bytes != 0)
      cuda_check(cudaMallocHost(&host_check_, kCheckBytes), "cudaMallocHost (check)");
    cuda_check(cudaMalloc(&base_, bytes_), "cudaMalloc (window)");
    // Copied from the pinned buffer read_flags_now() reads into later; export_window() waits
    // for the copy.
    if (first_flags.size() < flag_bytes_)
      throw Error(ErrorKind::Internal, "a window's first flags are short of its flag words");
    std::memcpy(flags_host_, first_flags.data(), flag_bytes_);
    cuda_check(
        cudaMemcpyAsync(flag(0), flags_host_, flag_bytes_, cudaMemcpyHostToDevice, own_stream_),
        "cudaMemcpyAsync (flags)");
    return {region(), flags_at_, stride_, flag(0), held_bytes != 0 ? region() + held_at : nullptr};
  }
  size_t window_bytes() const override { return base_ != nullptr ? bytes_ : 0; }
  void bind(std::span<const Copy> shards) override {
    // Nothing to copy (every shard read in place): no wait, which a graph capture would refuse.
    if (shards.empty()) return;
    // The shards must hold what the program last wrote: wait for all its work once, here, at
    // the plan's start, never on the call path.
    cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize (binding)");
    for (const Copy& shard : shards) {
      check_bindable(shard);
      cuda_check(cudaMemcpyAsync(shard.dst, shard.src, shard.bytes, cudaMemcpyDefault, own_stream_),
                 "cudaMemcpyAsync (binding)");
    }
  }
  void export_window(Medium& medium) override {
    cuda_check(cudaStreamSynchronize(own_stream_), "cudaStreamSynchronize (window)");
    CudaMedium cuda{};
    cuda.device = device_;
    cuda_check(cudaIpcGetMemHandle(&cuda.handle, base_), "cudaIpcGetMemHandle");
    gpu_ = cuda.gpu = gpu_uuid(current_device());
    std::memcpy(medium.data(), &cuda, sizeof(cuda));
  }

  void begin_attach(std::span<const pid_t> /*pids*/) override {
    use_on_any_thread();
    if (nranks_ > 1)
      MAGI_CUDA_DRIVER_FN(cuStreamBatchMemOp);  // refuse now, not on the first gather
    peers_.assign(static_cast<size_t>(nranks_), nullptr);
  }
  WindowView map_peer(int rank, const protocol::BlobHeader& header, const Medium& medium) override {
    CudaMedium cuda;
    std::memcpy(&cuda, medium.data(), sizeof(cuda));
    void* mapped = nullptr;
    cuda_check(cudaIpcOpenMemHandle(&mapped, cuda.handle, cudaIpcMemLazyEnablePeerAccess),
               "cudaIpcOpenMemHandle");
    uint8_t* peer = peers_[static_cast<size_t>(rank)] = static_cast<uint8_t*>(mapped);
    size_t flags_at = flags_at_;
    if (header.zero_copy != 0) {  // its window holds its own region, then its flags (allocate)
      flags_at = round_up(std::max<size_t>(header.slot_bytes, 1), kSlotAlignment);
      if (flags_at + flag_bytes_ > header.window_bytes)
        throw Error(ErrorKind::Usage,
                    "rank " + std::to_string(rank) + "'s window has no room for its flags");
    }
    return {peer, flags_at, stride_, peer + flags_at};
  }

  bool shares_gpu_with(const Medium& peer) const override {
    CudaMedium cuda;
    std::memcpy(&cuda, peer.data(), sizeof(cuda));
    return gpu_ != std::array<uint8_t, 16>{} && cuda.gpu == gpu_;
  }

  exports::Exportable find_export(const void* ptr, size_t bytes) override {
    return exports::find_cuda_export(ptr, bytes);
  }
  // The pieces of a cuMemCreate export: their handles retained until end_offers(), a descriptor
  // made from them only when a peer asks (the channel's thread), so the process holds no
  // descriptor between requests; the payload, each piece's size.
  fd_channel::Offer descriptor_offer(const exports::Exportable& e) override {
    fd_channel::Offer offer;
    auto handles = std::make_shared<std::vector<CUmemGenericAllocationHandle>>();
    for (const auto& [start, size] : e.pieces) {
      CUmemGenericAllocationHandle h = 0;
      cuda_check(
          MAGI_CUDA_DRIVER_FN(cuMemRetainAllocationHandle)(&h, reinterpret_cast<void*>(start)),
          "cuMemRetainAllocationHandle (a shard to export)");
      retained_.push_back(h);
      handles->push_back(h);
      const uint64_t bytes = size;
      offer.payload.insert(offer.payload.end(), reinterpret_cast<const uint8_t*>(&bytes),
                           reinterpret_cast<const uint8_t*>(&bytes) + sizeof(bytes));
    }
    offer.count = handles->size();
    CUcontext context = nullptr;
    MAGI_CUDA_DRIVER_FN(cuCtxGetCurrent)(&context);
    offer.make = [handles, context](size_t i) {
      if (context != nullptr) MAGI_CUDA_DRIVER_FN(cuCtxSetCurrent)(context);
      int fd = -1;
      cuda_check(MAGI_CUDA_DRIVER_FN(cuMemExportToShareableHandle)(
                     &fd, (*handles)[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                 "cuMemExportToShareableHandle");
      return fd;
    };
    return offer;
  }
  const char* offer_refusal() const override {
    return "its cuMemCreate memory cannot be offered by descriptor: ";
  }
  void end_offers() override {
    for (CUmemGenericAllocationHandle h : retained_) MAGI_CUDA_DRIVER_FN(cuMemRelease)(h);
    retained_.clear();
  }
  bool export_alive(uintptr_t base, size_t, uint64_t identity) override {
    return identify_buffer(Backend::Cuda, reinterpret_cast<const void*>(base)).allocation_id ==
           identity;
  }
  // Mapped once per process (ImportedAllocations).
  exports::Span import(const ExportRecord& record) override {
    imports_.push_back(open_imported(record, current_device()));
    return {imports_.back(), record.bytes};
  }
  size_t imports() const override { return imports_.size(); }

  void copy_batch(std::span<const Copy> copies, void* stream) override {
    copy_batch_on(copies, static_cast<cudaStream_t>(stream), device_, batch_);
  }
  void copy_captured(std::span<const Copy> copies, void* stream) override {
    copy_each(copies, static_cast<cudaStream_t>(stream), "cudaMemcpyAsync (captured)");
  }
  // Once per capture: a graph holds the window from its first moved gather on.
  void hold_for_graph(void* stream) override {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long capture = 0;
    cudaGraph_t graph = nullptr;
    cuda_check(
        cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, &capture, &graph),
        "cudaStreamGetCaptureInfo");
    if (status != cudaStreamCaptureStatusActive || capture == held_capture_) return;
    if (!graph_holds_) graph_holds_ = std::make_shared<GraphHolds>();
    auto* held = new std::shared_ptr<GraphHolds>(graph_holds_);
    cudaUserObject_t object = nullptr;
    if (const cudaError_t made =
            cudaUserObjectCreate(&object, held, drop_graph_hold, 1, cudaUserObjectNoDestructorSync);
        made != cudaSuccess) {
      delete held;
      cuda_check(made, "cudaUserObjectCreate (a graph's hold on the window)");
    }
    graph_holds_->live.fetch_add(1, std::memory_order_acq_rel);
    // Moved to the graph: its reference is the only one, so the count falls with the graph.
    if (const cudaError_t retained =
            cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
        retained != cudaSuccess) {
      cudaUserObjectRelease(object, 1);  // runs the destructor: the count is back
      cuda_check(retained, "cudaGraphRetainUserObject (a graph's hold on the window)");
    }
    held_capture_ = capture;
    ++graphs_held_;
  }
  // Captured: external event nodes, which a graph resolves at each launch (a plain wait or record
  // of an event made outside the capture would be refused, or fixed at the capture). Once a
  // graph records the event, an eager bucket always waits for it: a replay may have run on any
  // stream since.
  void follow_last_bucket(void* stream, bool captured) override {
    if (captured) {
      make_event(bucket_end_);
      cuda_check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), bucket_end_,
                                     cudaEventWaitExternal),
                 "cudaStreamWaitEvent (a graph's bucket after the last one, at each launch)");
      return;
    }
    if (bucket_end_ != nullptr && (stream != last_bucket_stream_ || graphs_record_end_))
      cuda_check(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), bucket_end_, 0),
                 "cudaStreamWaitEvent (the last bucket, on another stream)");
  }
  void end_bucket(void* stream, bool captured) override {
    if (captured) {
      make_event(bucket_end_);
      cuda_check(cudaEventRecordWithFlags(bucket_end_, static_cast<cudaStream_t>(stream),
                                          cudaEventRecordExternal),
                 "cudaEventRecordWithFlags (a graph's bucket end, at each launch)");
      graphs_record_end_ = true;
      return;
    }
    record(bucket_end_, stream, "cudaEventRecord (bucket order)");
    last_bucket_stream_ = stream;
  }
  void rebind(const Copy& shard, void* stream) override {
    cuda_check(cudaMemcpyAsync(shard.dst, shard.src, shard.bytes, cudaMemcpyDefault,
                               static_cast<cudaStream_t>(stream)),
               "cudaMemcpyAsync (re-bind)");
  }
  void run_flags(std::span<const FlagOp> ops, void* stream) override {
    if (ops.empty()) return;
    mem_ops_.clear();
    for (const FlagOp& op : ops) mem_ops_.push_back(stream_flag_op(op));
    cuda_check(MAGI_CUDA_DRIVER_FN(cuStreamBatchMemOp)(reinterpret_cast<CUstream>(stream),
                                                       static_cast<unsigned>(mem_ops_.size()),
                                                       mem_ops_.data(), 0),
               "cuStreamBatchMemOp");
  }
  uint64_t read_flag(const uint8_t* /*word*/) const override {
    throw Error(ErrorKind::Internal, "a device window's flags are read on its stream only");
  }
  uint64_t read_word_now(const uint8_t* word) override {
    uint64_t value = 0;
    copy_word_now(&value, word, cudaMemcpyDeviceToHost);
    return value;
  }
  void write_word_now(uint8_t* word, uint64_t value) override {
    copy_word_now(word, &value, cudaMemcpyHostToDevice);
  }

  uint8_t* check_buffer() override { return static_cast<uint8_t*>(host_check_); }
  void copy_lines(uint8_t* into, const uint8_t* from, const SampleSet& set, void* stream) override {
    copy_lines_on(into, from, set, static_cast<cudaStream_t>(stream));
  }
  void mark_lines(void* stream) override {
    record(lines_copied_, stream, "cudaEventRecord (verify)");
  }
  bool lines_copied() override {
    const cudaError_t state = cudaEventQuery(lines_copied_);
    if (state == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    cuda_check(state, "cudaEventQuery (verify)");
    return true;
  }

  // This rank's flags, read on its own stream (never the program's, which may be the one
  // stuck), into the pinned buffer.
  const uint8_t* read_flags_now() override {
    if (cudaMemcpyAsync(flags_host_, flag(0), flag_bytes_, cudaMemcpyDeviceToHost, own_stream_) !=
            cudaSuccess ||
        cudaStreamSynchronize(own_stream_) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return static_cast<const uint8_t*>(flags_host_);
  }
  // Not mem_ops_: a call may be filling that on another thread.
  bool run_flags_now(std::span<const FlagOp> ops) override {
    std::vector<CUstreamBatchMemOpParams> batch;
    for (const FlagOp& op : ops) batch.push_back(stream_flag_op(op));
    const CudaDriver* driver = cuda_driver();
    if (driver == nullptr || driver->cuStreamBatchMemOp_fn == nullptr ||
        driver->cuStreamBatchMemOp_fn(reinterpret_cast<CUstream>(own_stream_),
                                      static_cast<unsigned>(batch.size()), batch.data(),
                                      0) != CUDA_SUCCESS ||
        cudaStreamSynchronize(own_stream_) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return true;
  }
  bool own_work_done() override { return cudaStreamSynchronize(own_stream_) == cudaSuccess; }

  void release(bool settled) override {
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
    const int64_t graphs = graph_holds_ ? graph_holds_->live.load(std::memory_order_acquire) : 0;
    if (settled && graphs > 0) {
      MAGI_INFO(Transport,
                "window of %zu bytes kept, with its %d peer mappings and %zu mapped peer "
                "allocations, while %lld CUDA graph(s) that read them live (of %llu captured with "
                "it); freed once they are destroyed",
                bytes_, nranks_ - 1, imports_.size(), static_cast<long long>(graphs),
                static_cast<unsigned long long>(graphs_held_));
      keep_for_graphs({graph_holds_, current_device(), base_, flags_host_, host_check_,
                       lines_copied_, peers_, imports_, identity_, rank_, flag(0), flags_,
                       bucket_end_});
      lines_copied_ = nullptr;
    } else if (settled) {
      free_window(-1, base_, flags_host_, host_check_, nullptr, peers_, imports_);
    }  // else left allocated, as the transport said (window_end.h)
    // Graphs that name the order event may still be launched: it goes with what was kept for
    // them, or, where the window was left allocated, with the process.
    if (graphs > 0) bucket_end_ = nullptr;
    cudaStreamDestroy(own_stream_);  // returns at once; the stream goes when its work has run
    cudaGetLastError();
    base_ = nullptr;
    own_stream_ = nullptr;
    flags_host_ = nullptr;
    host_check_ = nullptr;
    peers_.clear();
    imports_.clear();
    if (lines_copied_ != nullptr) cudaEventDestroy(lines_copied_);  // freed once it has passed
    lines_copied_ = nullptr;
    if (bucket_end_ != nullptr) cudaEventDestroy(bucket_end_);
    bucket_end_ = nullptr;
    graphs_record_end_ = false;
    last_bucket_stream_ = nullptr;
    graph_holds_.reset();
    held_capture_ = 0;
    graphs_held_ = 0;
    free_kept_for_graphs();
  }

 private:
  uint8_t* region() const { return static_cast<uint8_t*>(base_); }
  // One word between host and a window, through the pinned flags buffer's line of the left word
  // (read_flags_now() reads that buffer whole later; prepare, release, abandon and lost_peer() come
  // one at a time: window_transport.cc's lifetime_). It may run on a thread of the program's (its
  // watchdog's, for lost_peer()): the copy is waited for a second at most, by polling, never
  // with a call that could wait on the device's other streams.
  void copy_word_now(void* dst, const void* src, cudaMemcpyKind kind) {
    const ThreadDevice device(device_);
    uint8_t* scratch = static_cast<uint8_t*>(flags_host_) + flags_.left();
    const bool to_device = kind == cudaMemcpyHostToDevice;
    if (to_device) std::memcpy(scratch, src, sizeof(uint64_t));
    cuda_check(cudaMemcpyAsync(to_device ? dst : scratch, to_device ? scratch : src,
                               sizeof(uint64_t), kind, own_stream_),
               "cudaMemcpyAsync (a word, now)");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
    for (cudaError_t state; (state = cudaStreamQuery(own_stream_)) != cudaSuccess;) {
      if (state != cudaErrorNotReady) cuda_check(state, "cudaStreamQuery (a word, now)");
      cudaGetLastError();
      if (std::chrono::steady_clock::now() >= deadline)
        throw Error(ErrorKind::System, "a word of a window was not copied within 1 s");
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    if (!to_device) std::memcpy(dst, scratch, sizeof(uint64_t));
  }
  // `event` (made at its first use) records what `stream` holds now.
  static void record(cudaEvent_t& event, void* stream, const char* what) {
    make_event(event);
    cuda_check(cudaEventRecord(event, static_cast<cudaStream_t>(stream)), what);
  }
  static void make_event(cudaEvent_t& event) {
    if (event == nullptr)
      cuda_check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  }
  int current_device() const {
    int device = device_;
    if (device < 0 && cudaGetDevice(&device) != cudaSuccess) {
      cudaGetLastError();
      device = 0;
    }
    return device;
  }

  // A flag word of this rank's window, by its offset from the flags' start (flags_).
  uint8_t* flag(size_t offset) const { return static_cast<uint8_t*>(base_) + flags_at_ + offset; }

  const int rank_;
  const int nranks_;
  const uint64_t identity_;
  const int device_;
  const protocol::FlagLayout flags_;
  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t stride_ = 0;
  size_t flags_at_ = 0;  // offset of the flag words in the allocation
  size_t flag_bytes_ = 0;
  cudaStream_t own_stream_ = nullptr;
  void* flags_host_ = nullptr;  // pinned: this rank's flags, read back by read_flags_now()
  void* host_check_ = nullptr;  // bound: kCheckBytes, pinned
  cudaEvent_t lines_copied_ = nullptr;
  cudaEvent_t bucket_end_ = nullptr;  // recorded at each staged bucket's end (end_bucket)
  bool graphs_record_end_ = false;    // a captured bucket records bucket_end_ at its replays
  void* last_bucket_stream_ = nullptr;
  std::array<uint8_t, 16> gpu_{};  // this rank's GPU (export_window)
  std::vector<uint8_t*> peers_;
  std::vector<uint8_t*> imports_;  // opened through open_imported (cuda_imports.cc)
  // cuMemCreate exports: the handles their offers make descriptors from (descriptor_offer).
  std::vector<CUmemGenericAllocationHandle> retained_;
  CopyBatch batch_;  // a bucket's copies, kept for their room
  std::vector<CUstreamBatchMemOpParams> mem_ops_;
  // Graphs captured with this window's gathers (hold_for_graph): their count, the last capture
  // that took a hold, and how many did.
  std::shared_ptr<GraphHolds> graph_holds_;
  unsigned long long held_capture_ = 0;
  uint64_t graphs_held_ = 0;
};

}  // namespace

std::unique_ptr<MemoryOps> make_cuda_memory(int rank, int nranks, uint64_t comm_identity,
                                            int device) {
  if (!cuda_driver_loaded())
    throw Error(ErrorKind::System, "the CUDA driver is not loaded in this process");
  return std::make_unique<CudaMemoryOps>(rank, nranks, comm_identity, device);
}

}  // namespace magi::ce
