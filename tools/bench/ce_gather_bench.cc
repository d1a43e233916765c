// The CUDA copy-engine transport against plain cudaMemcpyAsync: N processes on one GPU, each a
// rank, gather shards of one size, and the same bytes are moved five ways in the same process,
// on the same stream, repetitions interleaved (the order rotates each repetition, so drift and a
// noisy neighbour hit every way alike):
//   reference  N cudaMemcpyAsync per gather: the N-1 peers' send buffers (opened by CUDA IPC)
//              and this rank's own, into the receive buffer, no handshake;
//   batch      the same N copies as one cudaMemcpyBatchAsync with the transport's attributes
//              (tells the cost of the copy API apart from the transport's own);
//   default    Transport::gather: stage the shard, the handshake, read the peers' slots;
//   bound      Transport::gather on a bound window (static weights): peer reads only, from the
//              peers' windows, where prepare copied their shards;
//   zero-copy  Transport::gather on a zero-copy bound window: peer reads only, from the peers'
//              own cudaMalloc allocations, exported at prepare (0 bytes copied). Its send buffer
//              holds the same bytes as the others' but is an allocation of its own: a process
//              can map a peer's allocation once only, and the reference maps the send buffers.
// The bound and zero-copy windows bind the whole send buffer at slot offset 0 (a gather of a
// smaller shard reads its start) and 1 MiB pieces at i MiB (the host-cost buckets' gathers).
// With --diagnose 1, four more, each one of the transport's differences from the batch alone:
//   window-like  the batch from buffers shaped like a window: sources 512 bytes into an
//                allocation 512 bytes larger than the data (the flag lines come first);
//   padded       the batch from allocations 2 MiB larger than the data, sources at their start;
//   +write       the batch, then a stream write of a flag word (as the bound way publishes done);
//   flags        the handshake alone: write this rank's flag, wait for every peer's (no copies).
// Each batch of K gathers is timed twice: by cudaEvents on each rank's stream (device time; a
// repetition's is the slowest rank's), and by the wall clock from the first rank's start to the
// last rank's finish (the collective's time: N processes on one GPU take turns on it, which
// events on one stream do not see). Tables give medians over repetitions; one of them puts the
// ways side by side: cudaMemcpyAsync's collective time ÷ each way's, by N and shard.
// Also: the latency of a 1-byte gather (the handshake and the copies' fixed cost), the device
// memory the bound and zero-copy windows of the largest shard took, and with --extras 1 the host
// cost of one gather() call by bucket size (1, 4, 16, 64 gathers of 1 MiB) and the set-up cost
// of static weights over 1 GiB of shards, all ranks at once (bound: prepare, 1 GiB copied;
// zero-copy: prepare + attach, with the shards held as 16 allocations of 64 MiB, one of 1 GiB, or
// 256 of 4 MiB). Every way that moves bytes is checked once per size: sampled words of every
// rank's shard must arrive. Zero-copy source tables travel through the memory the ranks share, as
// the handle blobs do (at most kTableBytes per rank).
//
//   magice-ce-bench [--ranks 1,2,4,8] [--min-kib 64] [--max-mib 256] [--reps 9] [--extras 1]
//                   [--diagnose 0] [--timeout 240]
// (kUsage below says what each does; --help prints it.)
//
// Prints markdown on stdout, progress on stderr. Under tools/bench/count_kernels.cc
// (CUDA_INJECTION64_PATH) it names its phases, so the counts of the gathers stand apart.
// Ranks are forked before any CUDA call (a CUDA context does not survive fork); the parent never
// touches CUDA.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "base/base.h"
#include "ce_transport/ce_transport.h"

namespace {

using magi::ce::Backend;
using magi::ce::BindOp;
using magi::ce::GatherOp;
using magi::ce::HandleBlob;
using magi::ce::SourceTable;
using magi::ce::Transport;
using magi::ce::WindowMemory;
using magi::ce::WindowPlan;

constexpr int kMaxRanks = 8;
constexpr int kMaxSizes = 16;
constexpr int kMaxReps = 32;
constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kGiB = size_t{1} << 30;
constexpr size_t kBucketGathers[] = {1, 4, 16, 64};
constexpr int kBuckets = static_cast<int>(std::size(kBucketGathers));
constexpr size_t kBucketShard = kMiB;
constexpr int kSubmitCalls = 30;
constexpr size_t kBindBytes = kGiB;
constexpr size_t kBindPiece = 64 * kMiB;
constexpr int kBindRepeats = 3;
constexpr uint64_t kIdentity = 0xce'be'4c'00'00'00'00'00;
// A zero-copy window's source table, serialized, as the ranks share it: 256 allocations of one
// shard each take 8 + 256 × (72 + 8) = 20,488 bytes.
constexpr size_t kTableBytes = 24 * 1024;
// The zero-copy set-up measurement: 1 GiB of shards (kBindBytes) held three ways.
struct SetupLayout {
  size_t allocations;
  size_t shards;
  const char* name;
};
constexpr SetupLayout kSetupLayouts[] = {{16, 16, "16 allocations of 64 MiB"},
                                         {1, 16, "1 allocation of 1 GiB, 16 shards"},
                                         {256, 256, "256 allocations of 4 MiB"}};
constexpr int kLayouts = static_cast<int>(std::size(kSetupLayouts));
constexpr size_t kFlagBytes = 512;
using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);

enum Way {
  kReference,
  kBatch,
  kDefault,
  kBound,
  kZeroCopy,
  kWindowLike,
  kPadded,
  kBatchWrite,
  kFlags,
  kMaxWays
};
constexpr int kMainWays = kWindowLike;  // the rest only with --diagnose 1
const char* const kWayName[kMaxWays] = {
    "cudaMemcpyAsync",       "cudaMemcpyBatchAsync", "moved, default",
    "moved, bound",          "moved, zero-copy",     "batch, window-like sources",
    "batch, padded sources", "batch + flag write",   "flags only"};
const char* const kWayPhase[kMaxWays] = {
    "memcpy reference",  "batch reference", "gather default", "gather bound", "gather zero-copy",
    "batch window-like", "batch padded",    "batch write",    "flags"};
constexpr size_t kWindowHead =
    512;  // where a window's region starts (ce_transport/cuda_memory_ops.cc)
constexpr size_t kPadding = 2 << 20;

struct Config {
  std::vector<int> ranks = {1, 2, 4, 8};
  size_t min_shard = 64 * 1024;
  size_t max_shard = 256 * kMiB;
  int reps = 9;
  bool extras = true;
  bool diagnose = false;
  int ways() const { return diagnose ? kMaxWays : kMainWays; }
  double timeout_s = 240;
};

// The shard sizes: 1 byte (the latency row), then min_shard, ×4, … up to max_shard.
std::vector<size_t> shard_sizes(const Config& config) {
  std::vector<size_t> sizes = {1};
  for (size_t s = config.min_shard; s <= config.max_shard && sizes.size() < kMaxSizes; s *= 4)
    sizes.push_back(s);
  return sizes;
}

// Gathers per timed batch: enough for about 25 ms of the slowest way (measured in the warm-up),
// 4 to 1000. Rank 0 decides, so every rank runs the same number (the handshake counts them).
constexpr double kBatchMs = 25;
int iterations(double slowest_ms_per_gather) {
  return static_cast<int>(
      std::clamp(kBatchMs / std::max(slowest_ms_per_gather, 1e-6), 4.0, 1000.0));
}

// ---- what the ranks share (mapped before the fork) -------------------------------------------

// WindowMemory without its string, for the shared area.
struct WindowFacts {
  size_t window_bytes = 0;
  size_t bound_shards = 0;
  size_t bound_bytes = 0;
  size_t exported_shards = 0;
  size_t exported_allocations = 0;
  size_t peer_mappings = 0;
  WindowFacts() = default;
  explicit WindowFacts(const WindowMemory& m)
      : window_bytes(m.window_bytes),
        bound_shards(m.bound_shards),
        bound_bytes(m.bound_bytes),
        exported_shards(m.exported_shards),
        exported_allocations(m.exported_allocations),
        peer_mappings(m.peer_mappings) {}
};

struct Shared {
  std::atomic<uint32_t> arrived{0};
  std::atomic<uint32_t> generation{0};
  std::atomic<int> failed{0};
  std::atomic<int> check_failures{0};
  // kReference: the send buffer's cudaIpcMemHandle_t; kFlags: the flag words'.
  HandleBlob blobs[kMaxWays][kMaxRanks];
  double batch_ms[kMaxSizes][kMaxWays][kMaxReps][kMaxRanks];  // events, per gather
  int64_t wall_ns[kMaxSizes][kMaxWays][kMaxReps][kMaxRanks]
                 [2];  // steady clock: after the barrier, done
  int batch_iterations[kMaxSizes];
  double submit_us[kBuckets][kMainWays][kMaxRanks];  // median of kSubmitCalls calls
  double bind_s[kMaxRanks];                          // median of kBindRepeats prepares of 1 GiB
  int64_t bind_wall_ns[kBindRepeats][kMaxRanks][2];  // steady clock: prepare's start, its end
  WindowFacts bind_facts[kMaxRanks];
  // The sweep's zero-copy window: each rank's serialized SourceTable (kZeroCopy's blobs above).
  uint8_t tables[kMaxRanks][kTableBytes];
  // The zero-copy set-up measurement, by layout: blobs and tables of the window being set up,
  // each rank's prepare + attach (seconds, median of kBindRepeats; steady clock of each repeat),
  // and what its window took.
  HandleBlob setup_blobs[kMaxRanks];
  uint8_t setup_tables[kMaxRanks][kTableBytes];
  double setup_s[kLayouts][kMaxRanks];
  int64_t setup_wall_ns[kLayouts][kBindRepeats][kMaxRanks][2];
  WindowFacts setup_facts[kLayouts][kMaxRanks];
  WindowFacts window_facts[kMainWays][kMaxRanks];  // the sweep's windows, after attach
};

// A rank that fails marks it, so the others leave their barrier instead of waiting for ever.
void barrier(Shared& shared, int nranks) {
  const uint32_t generation = shared.generation.load(std::memory_order_acquire);
  if (shared.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(nranks)) {
    shared.arrived.store(0, std::memory_order_relaxed);
    shared.generation.fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  while (shared.generation.load(std::memory_order_acquire) == generation) {
    if (shared.failed.load(std::memory_order_relaxed) != 0)
      throw std::runtime_error("another rank failed");
    sched_yield();
  }
}

// ---- a rank ------------------------------------------------------------------------------------

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Word i of rank r's send buffer: every byte names the rank, the word's place shifts it.
uint64_t pattern_word(int rank, size_t i) {
  return (static_cast<uint64_t>(rank + 1) * 0x0101010101010101ull) ^
         (static_cast<uint64_t>(i) << 8);
}

// The phase marker of tools/bench/count_kernels.cc, when the driver loaded it into this process.
using PhaseFn = void (*)(const char*);
using ReportFn = void (*)();
struct Counter {
  PhaseFn phase = nullptr;
  ReportFn report = nullptr;
  void find() {
    const char* path = std::getenv("CUDA_INJECTION64_PATH");
    if (path == nullptr) return;
    void* lib = dlopen(path, RTLD_NOLOAD | RTLD_LAZY);
    if (lib == nullptr) return;
    phase = reinterpret_cast<PhaseFn>(dlsym(lib, "count_kernels_phase"));
    report = reinterpret_cast<ReportFn>(dlsym(lib, "count_kernels_report"));
  }
  void mark(const char* name) const {
    if (phase != nullptr) phase(name);
  }
};

class Rank {
 public:
  Rank(int rank, int nranks, const Config& config, Shared& shared)
      : rank_(rank),
        nranks_(nranks),
        config_(config),
        shared_(shared),
        buffer_bytes_(std::max(config.max_shard, kBucketGathers[kBuckets - 1] * kBucketShard)),
        ways_(config.ways()) {}

  int run() {
    check(cudaSetDevice(0), "cudaSetDevice");
    check(cudaFree(nullptr),
          "cudaFree (context)");  // loads the driver: the transport needs it there
    counter_.find();
    counter_.mark("bench");
    setup();
    sweep();
    if (config_.extras) {
      submission_cost();
      bind_cost();
      zero_copy_setup_cost();
    }
    barrier(shared_, nranks_);  // every rank done with every window before any is freed
    counter_.mark("release");
    for (auto& t : transports_) t.reset();
    for (uint8_t* p : peer_send_)
      if (p != nullptr) cudaIpcCloseMemHandle(p);
    for (const std::vector<uint8_t*>* peers : {&peer_flags_, &peer_window_like_, &peer_padded_})
      for (uint8_t* p : *peers)
        if (p != nullptr) cudaIpcCloseMemHandle(p);
    barrier(shared_, nranks_);
    counter_.mark("bench");
    cudaFree(send_);
    cudaFree(exported_);
    cudaFree(recv_);
    cudaFree(flags_);
    cudaFree(window_like_);
    cudaFree(padded_);
    cudaStreamDestroy(stream_);
    if (counter_.report != nullptr) counter_.report();
    return 0;
  }

 private:
  void setup() {
    check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    check(cudaEventCreate(&start_), "cudaEventCreate");
    check(cudaEventCreate(&stop_), "cudaEventCreate");
    check(cudaMalloc(&send_, buffer_bytes_), "cudaMalloc (send)");
    check(cudaMalloc(&recv_, buffer_bytes_ * static_cast<size_t>(nranks_)), "cudaMalloc (recv)");
    {
      std::vector<uint64_t> host(buffer_bytes_ / sizeof(uint64_t));
      for (size_t i = 0; i < host.size(); ++i) host[i] = pattern_word(rank_, i);
      check(cudaMemcpy(send_, host.data(), buffer_bytes_, cudaMemcpyHostToDevice),
            "cudaMemcpy (pattern)");
    }
    check(cudaMalloc(&exported_, buffer_bytes_), "cudaMalloc (exported send)");
    check(cudaMemcpy(exported_, send_, buffer_bytes_, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    // The reference reads the peers' send buffers as the transport reads their windows: mapped.
    cudaIpcMemHandle_t handle{};
    check(cudaIpcGetMemHandle(&handle, send_), "cudaIpcGetMemHandle");
    std::memcpy(shared_.blobs[kReference][rank_].bytes, &handle, sizeof handle);
    check(cudaMalloc(&flags_, kFlagBytes), "cudaMalloc (flags)");
    check(cudaMemset(flags_, 0, kFlagBytes), "cudaMemset (flags)");
    check(cudaIpcGetMemHandle(&handle, flags_), "cudaIpcGetMemHandle (flags)");
    std::memcpy(shared_.blobs[kFlags][rank_].bytes, &handle, sizeof handle);
    if (ways_ > kMainWays) {  // the same bytes in allocations of other shapes
      check(cudaMalloc(&window_like_, buffer_bytes_ + kWindowHead), "cudaMalloc (window-like)");
      check(cudaMalloc(&padded_, buffer_bytes_ + kPadding), "cudaMalloc (padded)");
      check(cudaMemcpy(window_like_ + kWindowHead, send_, buffer_bytes_, cudaMemcpyDeviceToDevice),
            "cudaMemcpy");
      check(cudaMemcpy(padded_, send_, buffer_bytes_, cudaMemcpyDeviceToDevice), "cudaMemcpy");
      check(cudaIpcGetMemHandle(&handle, window_like_), "cudaIpcGetMemHandle (window-like)");
      std::memcpy(shared_.blobs[kWindowLike][rank_].bytes, &handle, sizeof handle);
      check(cudaIpcGetMemHandle(&handle, padded_), "cudaIpcGetMemHandle (padded)");
      std::memcpy(shared_.blobs[kPadded][rank_].bytes, &handle, sizeof handle);
    }
    cudaDriverEntryPointQueryResult found{};
    void* fn = nullptr;
    check(cudaGetDriverEntryPointByVersion("cuStreamBatchMemOp", &fn, 12000, cudaEnableDefault,
                                           &found),
          "cuStreamBatchMemOp");
    batch_mem_op_ = reinterpret_cast<BatchMemOp>(fn);

    counter_.mark("prepare+attach");
    WindowPlan staging;
    staging.slot_bytes = buffer_bytes_;
    const WindowPlan bound = bound_plan(send_, false);
    const WindowPlan zero_copy = bound_plan(exported_, true);
    transports_[kDefault] =
        magi::ce::make_transport(Backend::Cuda, rank_, nranks_, kIdentity + 1, 0);
    transports_[kBound] = magi::ce::make_transport(Backend::Cuda, rank_, nranks_, kIdentity + 2, 0);
    transports_[kZeroCopy] =
        magi::ce::make_transport(Backend::Cuda, rank_, nranks_, kIdentity + 3, 0);
    transports_[kDefault]->prepare(staging, shared_.blobs[kDefault][rank_]);
    transports_[kBound]->prepare(bound, shared_.blobs[kBound][rank_]);
    transports_[kZeroCopy]->prepare(zero_copy, shared_.blobs[kZeroCopy][rank_]);
    publish_table(*transports_[kZeroCopy], shared_.tables[rank_]);
    barrier(shared_, nranks_);
    transports_[kDefault]->attach(
        std::span<const HandleBlob>(shared_.blobs[kDefault], static_cast<size_t>(nranks_)));
    transports_[kBound]->attach(
        std::span<const HandleBlob>(shared_.blobs[kBound], static_cast<size_t>(nranks_)));
    transports_[kZeroCopy]->attach(
        std::span<const HandleBlob>(shared_.blobs[kZeroCopy], static_cast<size_t>(nranks_)),
        read_tables(shared_.tables));
    for (const Way w : {kDefault, kBound, kZeroCopy}) {
      const WindowMemory memory = transports_[w]->memory();
      shared_.window_facts[w][rank_] = WindowFacts(memory);
      if (w == kZeroCopy && memory.bound_shards != 0)  // the way would not be what it says
        std::fprintf(stderr, "rank %d: zero-copy window copied %zu shards (shard %lld: %s)\n",
                     rank_, memory.bound_shards, static_cast<long long>(memory.first_refused),
                     memory.refusal.c_str());
    }
    peer_send_ = open_peers(kReference);
    peer_flags_ = open_peers(kFlags);
    if (ways_ > kMainWays) {
      peer_window_like_ = open_peers(kWindowLike);
      peer_padded_ = open_peers(kPadded);
    }
    counter_.mark("bench");
    barrier(shared_, nranks_);
  }

  // A bound window over `source` (one cudaMalloc allocation of buffer_bytes_), zero-copy or not:
  // the whole buffer at slot offset 0, which a gather of any shard of the sweep reads the start
  // of, and 1 MiB pieces at 1 MiB … 63 MiB, the offsets of the host-cost buckets' gathers (a
  // bound gather must name a bound slot offset). Verification off: pure peer reads (a check is a
  // host round trip, and never runs on a timed call anyway).
  WindowPlan bound_plan(uint8_t* source, bool zero_copy) const {
    WindowPlan plan;
    plan.slot_bytes = buffer_bytes_;
    plan.bound = true;
    plan.zero_copy = zero_copy;
    plan.table_room = zero_copy ? kTableBytes : 0;
    plan.bind = {BindOp{source, buffer_bytes_, 0}};
    for (size_t i = 1; i < kBucketGathers[kBuckets - 1]; ++i)
      plan.bind.push_back(BindOp{source + i * kBucketShard, kBucketShard, i * kBucketShard});
    plan.verify_first = 0;
    plan.verify_every = 0;
    return plan;
  }

  // This rank's source table into its place in the shared area (zero-copy windows, after
  // prepare), and every rank's back out of it (after the barrier that follows).
  static void publish_table(const Transport& transport, uint8_t (&out)[kTableBytes]) {
    transport.sources().serialize(std::span<uint8_t>(out, kTableBytes));
  }
  std::vector<SourceTable> read_tables(const uint8_t (&tables)[kMaxRanks][kTableBytes]) const {
    std::vector<SourceTable> parsed;
    for (int r = 0; r < nranks_; ++r)
      parsed.push_back(SourceTable::parse(std::span<const uint8_t>(tables[r], kTableBytes)));
    return parsed;
  }

  std::vector<uint8_t*> open_peers(Way blobs) {
    std::vector<uint8_t*> mapped(static_cast<size_t>(nranks_), nullptr);
    for (int r = 0; r < nranks_; ++r) {
      if (r == rank_) continue;
      cudaIpcMemHandle_t peer{};
      std::memcpy(&peer, shared_.blobs[blobs][r].bytes, sizeof peer);
      void* p = nullptr;
      check(cudaIpcOpenMemHandle(&p, peer, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
      mapped[static_cast<size_t>(r)] = static_cast<uint8_t*>(p);
    }
    return mapped;
  }

  void mem_ops(std::vector<CUstreamBatchMemOpParams>& ops) {
    if (ops.empty()) return;
    if (batch_mem_op_(reinterpret_cast<CUstream>(stream_), static_cast<unsigned>(ops.size()),
                      ops.data(), 0) != CUDA_SUCCESS)
      throw std::runtime_error("cuStreamBatchMemOp failed");
  }

  // One gather of `count` shards of `shard` bytes (gather i: send + i × shard, received at
  // recv + i × nranks × shard, slot offset i × shard), one of the ways.
  void gather(Way way, size_t shard, size_t count = 1) {
    if (way == kReference) {
      for (size_t i = 0; i < count; ++i) {
        uint8_t* recv = recv_ + i * shard * static_cast<size_t>(nranks_);
        for (int r = 0; r < nranks_; ++r) {
          const uint8_t* from =
              (r == rank_ ? send_ : peer_send_[static_cast<size_t>(r)]) + i * shard;
          check(cudaMemcpyAsync(recv + static_cast<size_t>(r) * shard, from, shard,
                                cudaMemcpyDeviceToDevice, stream_),
                "cudaMemcpyAsync (reference)");
        }
      }
      return;
    }
    if (way == kFlags) {  // the handshake alone, as the transport does it
      const uint64_t n = ++flag_sequence_;
      std::vector<CUstreamBatchMemOpParams> ops(1);
      ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      ops[0].writeValue.address = reinterpret_cast<CUdeviceptr>(flags_);
      ops[0].writeValue.value64 = n;
      ops[0].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
      for (int r = 0; r < nranks_; ++r) {
        if (r == rank_) continue;
        CUstreamBatchMemOpParams wait{};
        wait.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
        wait.waitValue.address = reinterpret_cast<CUdeviceptr>(peer_flags_[static_cast<size_t>(r)]);
        wait.waitValue.value64 = n;
        wait.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
        ops.push_back(wait);
      }
      mem_ops(ops);
      return;
    }
    if (way == kBatch || way == kWindowLike || way == kPadded || way == kBatchWrite) {
      uint8_t* mine = way == kWindowLike ? window_like_ + kWindowHead
                      : way == kPadded   ? padded_
                                         : send_;
      const std::vector<uint8_t*>& theirs = way == kWindowLike ? peer_window_like_
                                            : way == kPadded   ? peer_padded_
                                                               : peer_send_;
      const size_t skew = way == kWindowLike ? kWindowHead : 0;
      dsts_.clear();
      srcs_.clear();
      sizes_.clear();
      for (size_t i = 0; i < count; ++i)
        for (int r = 0; r < nranks_; ++r) {
          dsts_.push_back(recv_ +
                          (i * static_cast<size_t>(nranks_) + static_cast<size_t>(r)) * shard);
          srcs_.push_back(r == rank_ ? mine + i * shard
                                     : theirs[static_cast<size_t>(r)] + skew + i * shard);
          sizes_.push_back(shard);
        }
      cudaMemcpyAttributes attributes{};  // as ce_transport/cuda_memory_ops.cc asks
      attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
      attributes.flags = cudaMemcpyFlagPreferOverlapWithCompute;
      attributes.srcLocHint.type = cudaMemLocationTypeDevice;
      attributes.srcLocHint.id = 0;
      attributes.dstLocHint = attributes.srcLocHint;
      size_t first = 0;
      check(cudaMemcpyBatchAsync(dsts_.data(), srcs_.data(), sizes_.data(), dsts_.size(),
                                 &attributes, &first, 1, stream_),
            "cudaMemcpyBatchAsync (reference)");
      if (way == kBatchWrite) {  // a word of its own, away from the flags' handshake
        std::vector<CUstreamBatchMemOpParams> ops(1);
        ops[0].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        ops[0].writeValue.address = reinterpret_cast<CUdeviceptr>(flags_ + kFlagBytes / 2);
        ops[0].writeValue.value64 = ++write_sequence_;
        ops[0].writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
        mem_ops(ops);
      }
      return;
    }
    uint8_t* const send = way == kZeroCopy ? exported_ : send_;  // the window's agreed sources
    ops_.clear();
    for (size_t i = 0; i < count; ++i)
      ops_.push_back(GatherOp{send + i * shard, recv_ + i * shard * static_cast<size_t>(nranks_),
                              shard, i * shard});
    transports_[way]->gather(ops_, stream_);
  }

  // Poisons sampled words of the receive buffer, gathers once, and checks each rank's words.
  void validate(Way way, size_t shard) {
    std::vector<size_t> offsets = {0};
    if (shard >= 16) offsets = {0, shard / 2 / 8 * 8, shard - 8};
    const size_t len = std::min<size_t>(8, shard);
    const uint64_t poison = 0xdeadbeefdeadbeefull;
    for (int r = 0; r < nranks_; ++r)
      for (size_t off : offsets)
        check(cudaMemcpy(recv_ + static_cast<size_t>(r) * shard + off, &poison, len,
                         cudaMemcpyHostToDevice),
              "cudaMemcpy (poison)");
    counter_.mark(kWayPhase[way]);
    gather(way, shard);
    counter_.mark("bench");
    check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (validate)");
    for (int r = 0; r < nranks_; ++r)
      for (size_t off : offsets) {
        uint64_t got = 0;
        check(cudaMemcpy(&got, recv_ + static_cast<size_t>(r) * shard + off, len,
                         cudaMemcpyDeviceToHost),
              "cudaMemcpy (check)");
        const uint64_t want = pattern_word(r, off / 8);
        if (std::memcmp(&got, &want, len) != 0) {
          std::fprintf(stderr,
                       "rank %d: %s, shard %zu B: rank %d's word at %zu is %#llx, expected %#llx\n",
                       rank_, kWayName[way], shard, r, off, static_cast<unsigned long long>(got),
                       static_cast<unsigned long long>(want));
          shared_.check_failures.fetch_add(1);
        }
      }
  }

  // `k` gathers between two events; milliseconds per gather. `wall` (if given) gets the steady
  // clock (one clock for every process) as the batch starts and once its last gather is done.
  double timed_batch(Way way, size_t shard, int k, int64_t* wall = nullptr) {
    barrier(shared_, nranks_);
    const auto t0 = std::chrono::steady_clock::now();
    check(cudaEventRecord(start_, stream_), "cudaEventRecord");
    counter_.mark(kWayPhase[way]);
    for (int i = 0; i < k; ++i) gather(way, shard);
    counter_.mark("bench");
    check(cudaEventRecord(stop_, stream_), "cudaEventRecord");
    check(cudaEventSynchronize(stop_), "cudaEventSynchronize");
    const auto t1 = std::chrono::steady_clock::now();
    if (wall != nullptr) {
      wall[0] = std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
      wall[1] = std::chrono::duration_cast<std::chrono::nanoseconds>(t1.time_since_epoch()).count();
    }
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
    return static_cast<double>(ms) / k;
  }

  void sweep() {
    const std::vector<size_t> sizes = shard_sizes(config_);
    for (size_t s = 0; s < sizes.size(); ++s) {
      const size_t shard = sizes[s];
      for (int w = 0; w < ways_; ++w)
        if (w != kFlags) validate(static_cast<Way>(w), shard);  // flags move no bytes
      double slowest = 0;  // ms per gather, by this rank's wall clock (never below its device time)
      for (int w = 0; w < ways_; ++w) {
        int64_t wall[2];
        timed_batch(static_cast<Way>(w), shard, 8, wall);
        slowest = std::max(slowest, static_cast<double>(wall[1] - wall[0]) / 8 / 1e6);
      }
      if (rank_ == 0) shared_.batch_iterations[s] = iterations(slowest);
      barrier(shared_, nranks_);
      const int k = shared_.batch_iterations[s];
      for (int rep = 0; rep < config_.reps; ++rep)
        for (int j = 0; j < ways_; ++j) {
          const Way way = static_cast<Way>((rep + j) % ways_);
          shared_.batch_ms[s][way][rep][rank_] =
              timed_batch(way, shard, k, shared_.wall_ns[s][way][rep][rank_]);
        }
      if (rank_ == 0)
        std::fprintf(stderr, "  N=%d shard %zu B: %d x %d gathers per way\n", nranks_, shard,
                     config_.reps, k);
    }
  }

  // Wall time of the gather() call alone (the stream drained before each), by bucket size.
  void submission_cost() {
    for (int b = 0; b < kBuckets; ++b)
      for (int w = 0; w < kMainWays; ++w) {
        const Way way = static_cast<Way>(w);
        barrier(shared_, nranks_);
        std::vector<double> us;
        for (int call = 0; call < 3 + kSubmitCalls; ++call) {
          counter_.mark(kWayPhase[w]);
          const auto t0 = std::chrono::steady_clock::now();
          gather(way, kBucketShard, kBucketGathers[b]);
          const auto t1 = std::chrono::steady_clock::now();
          counter_.mark("bench");
          check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize (submission)");
          if (call >= 3) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        }
        shared_.submit_us[b][w][rank_] = median(us);
      }
  }

  // prepare() of a bound window of 1 GiB of bindings (16 × 64 MiB), every rank at once.
  void bind_cost() {
    uint8_t* source = nullptr;
    check(cudaMalloc(&source, kBindBytes), "cudaMalloc (bind source)");
    check(cudaMemcpy(source, send_, std::min(kBindBytes, buffer_bytes_), cudaMemcpyDeviceToDevice),
          "cudaMemcpy");
    WindowPlan plan;
    plan.slot_bytes = kBindBytes;
    plan.bound = true;
    for (size_t off = 0; off < kBindBytes; off += kBindPiece)
      plan.bind.push_back(BindOp{source + off, kBindPiece, off});
    std::vector<double> seconds;
    for (int i = 0; i < kBindRepeats; ++i) {
      auto t = magi::ce::make_transport(Backend::Cuda, rank_, nranks_,
                                        kIdentity + 8 + static_cast<uint64_t>(i), 0);
      HandleBlob blob;
      barrier(shared_, nranks_);
      counter_.mark("bind prepare");
      const auto t0 = std::chrono::steady_clock::now();
      t->prepare(plan, blob);
      const auto t1 = std::chrono::steady_clock::now();
      counter_.mark("bench");
      seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
      stamp(t0, t1, shared_.bind_wall_ns[i][rank_]);
      shared_.bind_facts[rank_] = WindowFacts(t->memory());
      t->release();
    }
    shared_.bind_s[rank_] = median(seconds);
    cudaFree(source);
  }

  // prepare() + attach() of a zero-copy window over 1 GiB of shards, every rank at once, for
  // each of kSetupLayouts: what exporting costs by allocation (an address-range query and an IPC
  // handle per shard, a mapping per peer allocation), with the table exchange in between.
  void zero_copy_setup_cost() {
    for (int l = 0; l < kLayouts; ++l) {
      const SetupLayout& layout = kSetupLayouts[l];
      const size_t allocation_bytes = kBindBytes / layout.allocations;
      const size_t shard_bytes = kBindBytes / layout.shards;
      const size_t per_allocation = layout.shards / layout.allocations;
      std::vector<uint8_t*> allocations(layout.allocations, nullptr);
      for (uint8_t*& a : allocations)
        check(cudaMalloc(&a, allocation_bytes), "cudaMalloc (zero-copy set-up)");
      WindowPlan plan;
      plan.slot_bytes = kBindBytes;
      plan.bound = true;
      plan.zero_copy = true;
      plan.table_room = kTableBytes;
      plan.verify_first = 0;
      plan.verify_every = 0;
      for (size_t j = 0; j < layout.shards; ++j)
        plan.bind.push_back(
            BindOp{allocations[j / per_allocation] + j % per_allocation * shard_bytes, shard_bytes,
                   j * shard_bytes});
      std::vector<double> seconds;
      for (int i = 0; i < kBindRepeats; ++i) {
        auto t = magi::ce::make_transport(
            Backend::Cuda, rank_, nranks_,
            kIdentity + 16 + static_cast<uint64_t>(l * kBindRepeats + i), 0);
        barrier(shared_, nranks_);
        counter_.mark("zero-copy set-up");
        const auto t0 = std::chrono::steady_clock::now();
        t->prepare(plan, shared_.setup_blobs[rank_]);
        publish_table(*t, shared_.setup_tables[rank_]);
        barrier(shared_, nranks_);
        t->attach(std::span<const HandleBlob>(shared_.setup_blobs, static_cast<size_t>(nranks_)),
                  read_tables(shared_.setup_tables));
        const auto t1 = std::chrono::steady_clock::now();
        counter_.mark("bench");
        seconds.push_back(std::chrono::duration<double>(t1 - t0).count());
        stamp(t0, t1, shared_.setup_wall_ns[l][i][rank_]);
        shared_.setup_facts[l][rank_] = WindowFacts(t->memory());
        barrier(shared_, nranks_);  // every peer has opened this window and read the tables
        t->release();
      }
      shared_.setup_s[l][rank_] = median(seconds);
      barrier(shared_, nranks_);  // every peer has let go of these allocations
      for (uint8_t* a : allocations) cudaFree(a);
    }
  }

  static void stamp(std::chrono::steady_clock::time_point t0,
                    std::chrono::steady_clock::time_point t1, int64_t (&wall)[2]) {
    wall[0] = std::chrono::duration_cast<std::chrono::nanoseconds>(t0.time_since_epoch()).count();
    wall[1] = std::chrono::duration_cast<std::chrono::nanoseconds>(t1.time_since_epoch()).count();
  }

  const int rank_;
  const int nranks_;
  const Config& config_;
  Shared& shared_;
  const size_t buffer_bytes_;  // the send buffer, each rank's part of the receive buffer, a slot
  const int ways_;
  Counter counter_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  uint8_t* send_ = nullptr;
  uint8_t* exported_ = nullptr;  // kZeroCopy's send buffer: send_'s bytes, exported to the peers
  uint8_t* recv_ = nullptr;
  std::vector<uint8_t*> peer_send_;
  std::unique_ptr<Transport> transports_[kMainWays];
  std::vector<GatherOp> ops_;
  uint8_t* flags_ =
      nullptr;  // kFlags: this rank's flag at 0; kBatchWrite: a word at kFlagBytes / 2
  std::vector<uint8_t*> peer_flags_;
  uint8_t* window_like_ = nullptr;  // --diagnose: the send buffer's bytes at kWindowHead
  uint8_t* padded_ = nullptr;       // --diagnose: the send buffer's bytes, kPadding more allocated
  std::vector<uint8_t*> peer_window_like_, peer_padded_;
  uint64_t flag_sequence_ = 0;
  uint64_t write_sequence_ = 0;
  BatchMemOp batch_mem_op_ = nullptr;
  std::vector<void*> dsts_;
  std::vector<const void*> srcs_;
  std::vector<size_t> sizes_;
};

// ---- the parent: fork, wait, report ----------------------------------------------------------

// Forks the ranks; true if every one exited 0 within the timeout (a late one is killed).
bool run_ranks(int nranks, const Config& config, Shared& shared) {
  std::vector<pid_t> pids;
  std::fflush(nullptr);
  for (int r = 0; r < nranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      int status = 3;
      try {
        status = Rank(r, nranks, config, shared).run();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d of %d: %s\n", r, nranks, e.what());
        shared.failed.store(1);
        status = 2;
      }
      std::fflush(nullptr);
      _exit(status);
    }
    pids.push_back(pid);
  }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(config.timeout_s);
  bool ok = true;
  size_t left = pids.size();
  std::vector<bool> reaped(pids.size(), false);
  while (left > 0) {
    for (size_t r = 0; r < pids.size(); ++r) {
      int status = 0;
      if (reaped[r] || waitpid(pids[r], &status, WNOHANG) != pids[r]) continue;
      reaped[r] = true;
      --left;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "rank %zu of %d: exit status %d, signal %d\n", r, nranks,
                     WIFEXITED(status) ? WEXITSTATUS(status) : -1,
                     WIFSIGNALED(status) ? WTERMSIG(status) : 0);
        ok = false;
        shared.failed.store(1);
      }
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "N=%d: timed out after %.0f s; killing the ranks\n", nranks,
                   config.timeout_s);
      for (size_t r = 0; r < pids.size(); ++r)
        if (!reaped[r]) kill(pids[r], SIGKILL);
      for (size_t r = 0; r < pids.size(); ++r)
        if (!reaped[r]) waitpid(pids[r], nullptr, 0);
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return ok;
}

std::string size_name(size_t bytes) {
  char out[32];
  if (bytes >= kMiB && bytes % kMiB != 0)  // a window: its flag lines past the region
    std::snprintf(out, sizeof out, "%.3f MiB", static_cast<double>(bytes) / kMiB);
  else if (bytes >= kMiB)
    std::snprintf(out, sizeof out, "%zu MiB", bytes / kMiB);
  else if (bytes >= 1024)
    std::snprintf(out, sizeof out, "%zu KiB", bytes / 1024);
  else
    std::snprintf(out, sizeof out, "%zu B", bytes);
  return out;
}

std::string time_name(double ms) {
  char out[32];
  if (ms >= 1)
    std::snprintf(out, sizeof out, "%.2f ms", ms);
  else
    std::snprintf(out, sizeof out, "%.1f µs", ms * 1e3);
  return out;
}

// A way's time per gather at one size, over the repetitions: by events (a repetition's is its
// slowest rank's device time) and by the wall clock (first rank's start to last rank's finish).
struct WayTimes {
  double events_ms, wall_ms, wall_min_ms, wall_max_ms;
};
WayTimes way_times(const Shared& shared, int s, int way, int nranks, int reps) {
  std::vector<double> events, wall;
  const double k = shared.batch_iterations[s];
  for (int rep = 0; rep < reps; ++rep) {
    double slowest = 0;
    int64_t first = INT64_MAX, last = INT64_MIN;
    for (int r = 0; r < nranks; ++r) {
      slowest = std::max(slowest, shared.batch_ms[s][way][rep][r]);
      first = std::min(first, shared.wall_ns[s][way][rep][r][0]);
      last = std::max(last, shared.wall_ns[s][way][rep][r][1]);
    }
    events.push_back(slowest);
    wall.push_back(static_cast<double>(last - first) / 1e6 / k);
  }
  return {median(events), median(wall), *std::min_element(wall.begin(), wall.end()),
          *std::max_element(wall.begin(), wall.end())};
}

// First rank's start to last rank's end of each repeat (steady clock); the median, in seconds.
double collective_s(const int64_t (*wall)[kMaxRanks][2], int nranks) {
  std::vector<double> repeats;
  for (int i = 0; i < kBindRepeats; ++i) {
    int64_t first = INT64_MAX, last = INT64_MIN;
    for (int r = 0; r < nranks; ++r) {
      first = std::min(first, wall[i][r][0]);
      last = std::max(last, wall[i][r][1]);
    }
    repeats.push_back(static_cast<double>(last - first) / 1e9);
  }
  return median(repeats);
}

struct NResult {
  int nranks;
  bool ok;
  std::unique_ptr<Shared, void (*)(Shared*)> shared;
};

void print_tables(const Config& config, const std::vector<NResult>& results) {
  const std::vector<size_t> sizes = shard_sizes(config);
  std::printf("### Gather time and throughput\n\n");
  std::printf(
      "Received bytes per rank per gather = N × shard; GB/s = 10^9 bytes/s. Medians of %d "
      "interleaved "
      "repetitions of about %.0f ms of back-to-back gathers. *device*: cudaEvents on each rank's "
      "stream, the "
      "slowest rank. *collective*: wall clock from the first rank's start to the last rank's "
      "finish. "
      "Spread: (max − min) / median of the collective time over repetitions. %% columns: "
      "cudaMemcpyAsync's "
      "time / this way's time.\n\n",
      config.reps, kBatchMs);
  std::printf(
      "| N | shard | way | device time | vs memcpy | collective time | spread | per rank GB/s | "
      "all ranks "
      "GB/s | vs memcpy |\n");
  std::printf("| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const NResult& n : results) {
    if (!n.ok) {
      std::printf("| %d | — | failed (see stderr) | | | | | | | |\n", n.nranks);
      continue;
    }
    for (size_t s = 1; s < sizes.size(); ++s) {
      const WayTimes ref =
          way_times(*n.shared, static_cast<int>(s), kReference, n.nranks, config.reps);
      for (int w = 0; w < config.ways(); ++w) {
        if (w == kFlags) continue;  // moves nothing: in the latency table only
        const WayTimes t = way_times(*n.shared, static_cast<int>(s), w, n.nranks, config.reps);
        const double per_rank = static_cast<double>(sizes[s]) * n.nranks / (t.wall_ms * 1e-3) / 1e9;
        std::printf("| %d | %s | %s | %s | %.0f%% | %s | %.0f%% | %.1f | %.1f | %.0f%% |\n",
                    n.nranks, size_name(sizes[s]).c_str(), kWayName[w],
                    time_name(t.events_ms).c_str(), 100 * ref.events_ms / t.events_ms,
                    time_name(t.wall_ms).c_str(), 100 * (t.wall_max_ms - t.wall_min_ms) / t.wall_ms,
                    per_rank, per_rank * n.nranks, 100 * ref.wall_ms / t.wall_ms);
      }
    }
  }
  std::printf("\n### Against cudaMemcpyAsync\n\n");
  std::printf(
      "Collective time of cudaMemcpyAsync ÷ that of each way (the *vs memcpy* column above, the "
      "last one), by N and shard.\n\n| N | shard |");
  for (int w = kBatch; w < kMainWays; ++w) std::printf(" %s |", kWayName[w]);
  std::printf("\n| ---: | ---: |");
  for (int w = kBatch; w < kMainWays; ++w) std::printf(" ---: |");
  std::printf("\n");
  for (const NResult& n : results) {
    if (!n.ok) continue;
    for (size_t s = 1; s < sizes.size(); ++s) {
      const int size = static_cast<int>(s);
      const double ref = way_times(*n.shared, size, kReference, n.nranks, config.reps).wall_ms;
      std::printf("| %d | %s |", n.nranks, size_name(sizes[s]).c_str());
      for (int w = kBatch; w < kMainWays; ++w)
        std::printf(" %.0f%% |",
                    100 * ref / way_times(*n.shared, size, w, n.nranks, config.reps).wall_ms);
      std::printf("\n");
    }
  }
  std::printf("\n### Latency of a 1-byte gather\n\n");
  std::printf(
      "Time per gather of back-to-back 1-byte gathers (about %.0f ms of them), device / collective "
      "as "
      "above, medians of %d repetitions. For the default way this is the handshake's cost.\n\n",
      kBatchMs, config.reps);
  std::printf("| N |");
  for (int w = 0; w < config.ways(); ++w) std::printf(" %s |", kWayName[w]);
  std::printf("\n| ---: |");
  for (int w = 0; w < config.ways(); ++w) std::printf(" ---: |");
  std::printf("\n");
  for (const NResult& n : results) {
    if (!n.ok) continue;
    std::printf("| %d", n.nranks);
    for (int w = 0; w < config.ways(); ++w) {
      const WayTimes t = way_times(*n.shared, 0, w, n.nranks, config.reps);
      std::printf(" | %s / %s", time_name(t.events_ms).c_str(), time_name(t.wall_ms).c_str());
    }
    std::printf(" |\n");
  }
  std::printf("\n### Device memory of the static-weights windows\n\n");
  std::printf(
      "The bound and zero-copy windows of the gathers above, sized for the largest shard (%s, "
      "bound at slot offset 0; the 63 pieces of 1 MiB for the host-cost buckets lie inside it, "
      "and rank 0's counts of shards and copied bytes count them again): the device memory each "
      "rank's window took (WindowMemory::window_bytes: the flag lines and the region of copied "
      "shards), the median rank's and the largest, each divided by the shard bytes.\n\n",
      size_name(std::max(config.max_shard, kBucketGathers[kBuckets - 1] * kBucketShard)).c_str());
  std::printf(
      "| N | window | window per rank, median | ÷ shard bytes | largest rank | ÷ shard bytes | "
      "copied into it | read in place | peer allocations mapped |\n");
  std::printf("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  const size_t shard_bytes =
      std::max(config.max_shard, kBucketGathers[kBuckets - 1] * kBucketShard);
  for (const NResult& n : results) {
    if (!n.ok) continue;
    for (const Way w : {kBound, kZeroCopy}) {
      const WindowFacts* facts = n.shared->window_facts[w];
      std::vector<double> window;
      for (int r = 0; r < n.nranks; ++r)
        window.push_back(static_cast<double>(facts[r].window_bytes));
      const double middle = median(window);
      const double largest = *std::max_element(window.begin(), window.end());
      std::printf(
          "| %d | %s | %s | %.4f | %s | %.4f | %zu shards, %s | %zu shards, %zu allocations | %zu "
          "|\n",
          n.nranks, kWayName[w], size_name(static_cast<size_t>(middle)).c_str(),
          middle / static_cast<double>(shard_bytes),
          size_name(static_cast<size_t>(largest)).c_str(),
          largest / static_cast<double>(shard_bytes), facts[0].bound_shards,
          size_name(facts[0].bound_bytes).c_str(), facts[0].exported_shards,
          facts[0].exported_allocations, facts[0].peer_mappings);
    }
  }
  if (!config.extras) return;
  std::printf("\n### Host cost of one gather call\n\n");
  std::printf(
      "Wall time of the call alone (stream drained before each call), buckets of 1 MiB gathers; "
      "median "
      "over %d calls per rank, then over ranks. The references issue N copies per gather.\n\n",
      kSubmitCalls);
  std::printf("| N | gathers in bucket |");
  for (int w = 0; w < kMainWays; ++w) std::printf(" %s |", kWayName[w]);
  std::printf("\n| ---: | ---: |");
  for (int w = 0; w < kMainWays; ++w) std::printf(" ---: |");
  std::printf("\n");
  for (const NResult& n : results) {
    if (!n.ok) continue;
    for (int b = 0; b < kBuckets; ++b) {
      std::printf("| %d | %zu", n.nranks, kBucketGathers[b]);
      for (int w = 0; w < kMainWays; ++w) {
        std::vector<double> ranks(n.shared->submit_us[b][w], n.shared->submit_us[b][w] + n.nranks);
        std::printf(" | %.1f µs", median(ranks));
      }
      std::printf(" |\n");
    }
  }
  std::printf(
      "\n### Binding cost (static weights): bound and zero-copy set-up, 1 GiB of shards\n\n");
  std::printf(
      "Every rank at once, median of %d. *bound*: prepare() of a bound window holding 1 GiB of "
      "bindings (16 × 64 MiB): the window's allocation, a device synchronize, the copies, the IPC "
      "handle. *zero-copy*: prepare() + attach() of a zero-copy window over 1 GiB of shards held "
      "as shown: an address-range query and an IPC handle per shard, the source tables' exchange "
      "(through shared host memory), every peer's window and allocations mapped. Per rank: that "
      "rank's own time (the median rank's, the slowest rank's); collective: the wall clock from "
      "the first rank's start to the last rank's end, and that divided by the allocations. "
      "Window: the device memory each rank's window took (WindowMemory::window_bytes, median "
      "rank); then what each rank copied into it and what its peers read in place.\n\n",
      kBindRepeats);
  std::printf(
      "| N | window | 1 GiB held as | per GiB, median rank | slowest rank | collective per GiB | "
      "collective per allocation | window per rank | copied per rank | read in place per rank "
      "|\n");
  std::printf("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
  for (const NResult& n : results) {
    if (!n.ok) continue;
    const Shared& sh = *n.shared;
    auto row = [&](const char* window, const char* held_as, size_t allocations, const double* own_s,
                   const int64_t(*wall)[kMaxRanks][2], const WindowFacts* facts) {
      std::vector<double> ranks(own_s, own_s + n.nranks);
      const double collective_ms = collective_s(wall, n.nranks) * 1e3;
      std::vector<double> taken;
      for (int r = 0; r < n.nranks; ++r)
        taken.push_back(static_cast<double>(facts[r].window_bytes));
      std::printf("| %d | %s | %s | %s | %s | %s | %s | %s | %s | %zu shards, %zu allocations |\n",
                  n.nranks, window, held_as, time_name(median(ranks) * 1e3).c_str(),
                  time_name(*std::max_element(ranks.begin(), ranks.end()) * 1e3).c_str(),
                  time_name(collective_ms).c_str(),
                  time_name(collective_ms / static_cast<double>(allocations)).c_str(),
                  size_name(static_cast<size_t>(median(taken))).c_str(),
                  size_name(facts[0].bound_bytes).c_str(), facts[0].exported_shards,
                  facts[0].exported_allocations);
    };
    row("bound", "1 allocation of 1 GiB, 16 shards", 1, sh.bind_s, sh.bind_wall_ns, sh.bind_facts);
    for (int l = 0; l < kLayouts; ++l)
      row("zero-copy", kSetupLayouts[l].name, kSetupLayouts[l].allocations, sh.setup_s[l],
          sh.setup_wall_ns[l], sh.setup_facts[l]);
  }
}

std::vector<int> parse_ranks(const char* list) {
  std::vector<int> out;
  for (const char* p = list; *p != '\0';) {
    char* end = nullptr;
    const long n = std::strtol(p, &end, 10);
    if (end == p || n < 1 || n > kMaxRanks)
      throw std::runtime_error("--ranks takes numbers 1 to 8, comma separated");
    out.push_back(static_cast<int>(n));
    p = *end == ',' ? end + 1 : end;
    if (*end != ',' && *end != '\0')
      throw std::runtime_error("--ranks takes numbers 1 to 8, comma separated");
  }
  return out;
}

constexpr const char* kUsage =
    "usage: magice-ce-bench [--ranks 1,2,4,8] [--min-kib 64] [--max-mib 256] [--reps 9]\n"
    "                       [--extras 1] [--diagnose 0] [--timeout 240]\n"
    "  --ranks     the numbers of ranks to run, each its own set of processes on GPU 0 (1 to 8)\n"
    "  --min-kib   the smallest shard after the 1-byte row; sizes grow by 4 up to --max-mib\n"
    "  --max-mib   the largest shard (and the bound and zero-copy windows' size, at least 64)\n"
    "  --reps      interleaved repetitions per size and way (1 to 32)\n"
    "  --extras    1: also the host cost of a gather call and the set-up cost of static\n"
    "              weights (bound and zero-copy, 1 GiB of shards)\n"
    "  --diagnose  1: four more ways that each isolate one difference from the batch\n"
    "  --timeout   seconds each N may take before its ranks are killed\n"
    "Markdown on stdout, progress on stderr; exit 1 if a rank failed or a word arrived wrong.\n";

Config parse(int argc, char** argv) {
  Config config;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) throw std::runtime_error("missing value after " + arg);
    const char* value = argv[++i];
    if (arg == "--ranks")
      config.ranks = parse_ranks(value);
    else if (arg == "--min-kib")
      config.min_shard = std::strtoull(value, nullptr, 10) * 1024;
    else if (arg == "--max-mib")
      config.max_shard = std::strtoull(value, nullptr, 10) * kMiB;
    else if (arg == "--reps")
      config.reps = std::clamp(std::atoi(value), 1, kMaxReps);
    else if (arg == "--extras")
      config.extras = std::atoi(value) != 0;
    else if (arg == "--diagnose")
      config.diagnose = std::atoi(value) != 0;
    else if (arg == "--timeout")
      config.timeout_s = std::atof(value);
    else
      throw std::runtime_error("unknown option " + arg);
  }
  if (config.min_shard < 8 || config.max_shard < config.min_shard)
    throw std::runtime_error("need 8 B <= --min-kib <= --max-mib");
  return config;
}

Shared* map_shared() {
  void* p =
      mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) throw std::runtime_error("mmap of the shared area failed");
  return ::new (p) Shared{};
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::fputs(kUsage, stdout);
      return 0;
    }
  try {
    const Config config = parse(argc, argv);
    std::vector<NResult> results;
    int check_failures = 0;
    bool all_ok = true;
    for (const int nranks : config.ranks) {
      std::fprintf(stderr, "N=%d ranks on GPU 0\n", nranks);
      NResult n{nranks, false, {map_shared(), [](Shared* s) { munmap(s, sizeof(Shared)); }}};
      n.ok = run_ranks(nranks, config, *n.shared);
      check_failures += n.shared->check_failures.load();
      all_ok = all_ok && n.ok;
      results.push_back(std::move(n));
    }
    print_tables(config, results);
    if (check_failures > 0) {
      std::printf("\n**%d sampled words did not arrive right (see stderr).**\n", check_failures);
      return 1;
    }
    if (!all_ok) return 1;
    std::printf("\nEvery way, every size: sampled words of every rank's shard arrived right.\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "magice-ce-bench: %s\n%s", e.what(), kUsage);
    return 2;
  }
}
