// magice-allgather-bench: what a user measures first, through the NCCL API alone, so the same
// binary runs over the real NCCL (device memory) or the stand-in (host memory), with the library
// preloaded or not. One rank per process, started by magi-launch (STANDIN_RANK, STANDIN_NRANKS,
// STANDIN_ID_FILE; tests/support/bootstrap.h). Rank 0 prints the results to stdout.
//
//   magice-allgather-bench perf [-b 4K] [-e 16M] [-f 4] [-n 40] [-w 1] [-c 1]
//                               [--memory host|device] [--plan FILE]
//   magice-allgather-bench fsdp [--layers 10] [--block-kib 64] [--steps 64] [--frames 3]
//                               [--in-place 1] [--memory host|device] [--plan FILE]
//
// perf is nccl-tests' all_gather_perf loop (float, -d float -c 1 -a 1): one send and one receive
// buffer of -e bytes; W warmup calls at the largest size and W at the smallest; then per size,
// out of place and then in place: 1 call, a barrier, N timed calls (call i shifted by i messages
// inside the buffers, tools/bench/allgather_plan.h), the mean over the ranks of the time per
// call, and with -c 1 one more call after fresh data whose result is checked. Every call goes
// through one function, called from four places, as nccl-tests' startColl is.
//
// fsdp is an FSDP-like inference loop: L layers (an embedding, identical blocks, a head), each
// step copies every layer's unchanged weight shard into a copy-in buffer and all-gathers it into
// an output buffer; both buffers come from a pool and differ from one step to the next (frame
// step % frames). --in-place 1 (FSDP2's all_gather_copy_in): the copy-in buffer is this rank's
// part of the output; 0: a buffer of its own. --frames 1 keeps the same buffers every step (a
// control). The last step's outputs are checked.
//
// --plan FILE (rank 0) writes one line per all-gather issued, in order, for the driver
// (tools/bench/allgather_bench.py) to match against the library's trace:
//   perf:  index kind size in_place iter shift count     (kind: warmup|sync|timed|check)
//   fsdp:  index step layer count
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tools/bench/allgather_plan.h"
#include "tools/bench/rank_barrier.h"

namespace {

using magi::bench::CallBuffers;
using magi::bench::GatherLayout;
using magi::bench::RankBarrier;
using Clock = std::chrono::steady_clock;

constexpr char kTool[] = "magice-allgather-bench";
constexpr size_t kElement = sizeof(float);

void nccl_check(ncclResult_t result, const char* call) {
  if (result != ncclSuccess)
    throw std::runtime_error(std::string(call) + ": " + ncclGetErrorString(result));
}
void cuda_check(cudaError_t err, const char* call) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(call) + ": " + cudaGetErrorString(err));
}
#define NCCL_CHECK(call) nccl_check((call), #call)
#define CUDA_CHECK(call) cuda_check((call), #call)

// "--name value" and "-x value" pairs after the mode.
struct Args {
  std::vector<std::pair<std::string, std::string>> pairs;
  Args(int argc, char** argv) {
    for (int i = 2; i < argc; i += 2) {
      if (argv[i][0] != '-' || i + 1 >= argc)
        throw std::runtime_error(std::string("expected an option and its value at ") + argv[i]);
      pairs.emplace_back(argv[i], argv[i + 1]);
    }
  }
  // The last value given wins, so a driver can append an override.
  std::string text(const std::string& name, const std::string& fallback) const {
    for (auto it = pairs.rbegin(); it != pairs.rend(); ++it)
      if (it->first == name) return it->second;
    return fallback;
  }
  size_t size(const std::string& name, const std::string& fallback) const {
    const auto parsed = magi::bench::parse_size(text(name, fallback));
    if (!parsed) throw std::runtime_error(name + " wants a size (4096, 4K, 16M, 1G)");
    return *parsed;
  }
  int number(const std::string& name, int fallback) const {
    const std::string value = text(name, std::to_string(fallback));
    char* end = nullptr;
    const long n = std::strtol(value.c_str(), &end, 10);
    if (*end != '\0' || n < 0 || n > 1 << 24) throw std::runtime_error(name + " wants a count");
    return static_cast<int>(n);
  }
};

// Where the buffers NCCL sees live: host memory (the stand-in, the host backend) or device
// memory on the current GPU, with the calls on a non-blocking stream of the program's own (as
// nccl-tests). Host memory is touched once when allocated, so no timed call takes a page fault.
class Memory {
 public:
  // Device memory: on GPU rank % GPUs, made current (the communicator is made on it).
  Memory(const std::string& kind, int rank) : device_(kind == "device") {
    if (kind != "host" && kind != "device") throw std::runtime_error("--memory host|device");
    if (!device_) return;
    int gpus = 0;
    CUDA_CHECK(cudaGetDeviceCount(&gpus));
    CUDA_CHECK(cudaSetDevice(rank % gpus));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~Memory() {
    for (void* p : allocations_) device_ ? (void)cudaFree(p) : std::free(p);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }
  Memory(const Memory&) = delete;
  Memory& operator=(const Memory&) = delete;

  bool device() const { return device_; }
  cudaStream_t stream() const { return stream_; }

  unsigned char* allocate(size_t bytes) {
    const size_t rounded = (bytes + 4095) / 4096 * 4096;
    void* p = nullptr;
    if (device_) {
      CUDA_CHECK(cudaMalloc(&p, rounded));
      CUDA_CHECK(cudaMemsetAsync(p, 0, rounded, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    } else {
      p = std::aligned_alloc(4096, rounded);
      if (p == nullptr) throw std::runtime_error("cannot allocate " + std::to_string(bytes));
      std::memset(p, 0, rounded);
    }
    allocations_.push_back(p);
    return static_cast<unsigned char*>(p);
  }
  // Writes, reads and zeroing go on the program's stream, which is non-blocking: on the legacy
  // default stream (cudaMemcpy, cudaMemset) they would not be ordered with the gathers, and a
  // gather could read data not yet written.
  void write(void* to, const void* from, size_t bytes) const {
    if (device_) {
      CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyHostToDevice, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    } else {
      std::memcpy(to, from, bytes);
    }
  }
  void read(void* to, const void* from, size_t bytes) const {
    if (device_) {
      CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToHost, stream_));
      CUDA_CHECK(cudaStreamSynchronize(stream_));
    } else {
      std::memcpy(to, from, bytes);
    }
  }
  void zero(void* at, size_t bytes) const {
    if (device_)
      CUDA_CHECK(cudaMemsetAsync(at, 0, bytes, stream_));
    else
      std::memset(at, 0, bytes);
  }
  // A copy in stream order (FSDP's copy-in): asynchronous on the device.
  void copy(void* to, const void* from, size_t bytes) const {
    if (device_)
      CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream_));
    else
      std::memcpy(to, from, bytes);
  }
  void synchronize() const {
    if (device_) CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  bool device_;
  cudaStream_t stream_ = nullptr;
  std::vector<void*> allocations_;
};

// Element i of rank r's data for check round `rep`: a float that is an exact integer, so every
// bit pattern sent is an ordinary number.
float value(uint32_t rep, int rank, size_t i) {
  const uint32_t h = (rep * 2654435761u) ^ (static_cast<uint32_t>(rank) * 40503u + 7u) ^
                     static_cast<uint32_t>(i * 2246822519u);
  return static_cast<float>(h & 0xffffffu);
}

std::vector<float> rank_data(uint32_t rep, int rank, size_t count) {
  std::vector<float> data(count);
  for (size_t i = 0; i < count; ++i) data[i] = value(rep, rank, i);
  return data;
}

// Elements of `got` (nranks parts of `count`) that are not what rank r sent in round `rep`.
long wrong_elements(const std::vector<float>& got, uint32_t rep, int nranks, size_t count) {
  long wrong = 0;
  for (int r = 0; r < nranks; ++r)
    for (size_t i = 0; i < count; ++i)
      if (got[static_cast<size_t>(r) * count + i] != value(rep, r, i)) ++wrong;
  return wrong;
}

// The one function every all-gather goes through; its callers are the call sites the library
// tells apart (warmup, sync, timed and check calls, as nccl-tests' startColl's callers are).
__attribute__((noinline)) void all_gather(const void* send, void* recv, size_t count,
                                          ncclComm_t comm, cudaStream_t stream) {
  NCCL_CHECK(ncclAllGather(send, recv, count, ncclFloat32, comm, stream));
  asm volatile("" ::: "memory");  // not a tail call: this frame stays on the stack
}

struct World {
  int rank = 0, nranks = 1;
  ncclComm_t comm = nullptr;
  std::unique_ptr<RankBarrier> barrier;
  ncclUniqueId id{};
};

// The rank's place in the launch and its barrier; the communicator is made later (main), once
// the rank's GPU is current.
World find_rank() {
  const Bootstrap boot = bootstrap_from_env();
  World world;
  world.rank = boot.rank;
  world.nranks = boot.nranks;
  std::string dir = std::getenv("STANDIN_ID_FILE");  // set: bootstrap_from_env checked it
  dir = dir.substr(0, dir.rfind('/') + 1);
  world.barrier = std::make_unique<RankBarrier>(dir + "bench-barrier", boot.rank, boot.nranks);
  world.id = boot.id;
  return world;
}

std::string version_text() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return "unknown";
  const int major = version / 10000, minor = version / 100 % 100, patch = version % 100;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

// Writes the plan lines (rank 0 with --plan); records nothing otherwise.
class Plan {
 public:
  explicit Plan(const std::string& path) {
    if (path.empty()) return;
    out_.open(path, std::ios::trunc);
    if (!out_) throw std::runtime_error("cannot write " + path);
  }
  bool on() const { return out_.is_open(); }
  void line(const std::string& text) {
    if (on()) out_ << index_++ << ' ' << text << '\n';
  }

 private:
  std::ofstream out_;
  size_t index_ = 0;
};

// ---- perf ------------------------------------------------------------------------------------

class PerfLoop {
 public:
  PerfLoop(World& world, Memory& memory, const Args& args)
      : w_(world),
        memory_(memory),
        min_(args.size("-b", "4K")),
        max_(args.size("-e", "16M")),
        factor_(static_cast<size_t>(args.number("-f", 4))),
        iters_(args.number("-n", 40)),
        warmup_(args.number("-w", 1)),
        check_(args.number("-c", 1) != 0),
        plan_(w_.rank == 0 ? args.text("--plan", "") : "") {
    sizes_ = magi::bench::size_sequence(min_, max_, factor_);
    if (sizes_.empty() || iters_ < 1)
      throw std::runtime_error("-b, -e and -f give no size, or -n is 0");
    send_ = memory_.allocate(max_);
    recv_ = memory_.allocate(max_);
  }

  void run() {
    if (w_.rank == 0) {
      std::printf(
          "# %s perf: %d ranks, NCCL %s, %s memory, float, -b %zu -e %zu -f %zu -n %d "
          "-w %d -c %d\n",
          kTool, w_.nranks, version_text().c_str(), memory_.device() ? "device" : "host", min_,
          max_, factor_, iters_, warmup_, check_ ? 1 : 0);
      std::printf("# %10s %12s %6s  %9s %7s %7s %6s  %9s %7s %7s %6s\n", "size", "count", "type",
                  "oop(us)", "algbw", "busbw", "#wrong", "ip(us)", "algbw", "busbw", "#wrong");
    }
    w_.barrier->wait();
    // nccl-tests warms up at the largest and at the smallest size, out of place.
    for (const size_t size : {max_, min_}) {
      const GatherLayout layout = magi::bench::gather_layout(size, kElement, w_.nranks);
      for (int iter = 0; iter < warmup_; ++iter) start(layout, false, iter, "warmup");
      memory_.synchronize();
    }
    for (const size_t size : sizes_) {
      const GatherLayout layout = magi::bench::gather_layout(size, kElement, w_.nranks);
      const Result oop = time_calls(layout, false);
      const Result ip = time_calls(layout, true);
      if (w_.rank == 0) {
        std::printf("  %10zu %12zu %6s  %9.3f %7.3f %7.3f %6ld  %9.3f %7.3f %7.3f %6ld\n",
                    layout.recv_bytes, layout.count, "float", oop.us, algbw(layout, oop.us),
                    busbw(layout, oop.us), oop.wrong, ip.us, algbw(layout, ip.us),
                    busbw(layout, ip.us), ip.wrong);
        std::fflush(stdout);
      }
      if (oop.wrong > 0 || ip.wrong > 0) failed_ = true;
    }
  }
  bool failed() const { return failed_; }

 private:
  struct Result {
    double us = 0;
    long wrong = -1;  // -1: not checked
  };

  double algbw(const GatherLayout& l, double us) const {
    return us > 0 ? static_cast<double>(l.recv_bytes) / us / 1e3 : 0;
  }
  double busbw(const GatherLayout& l, double us) const {
    return algbw(l, us) * (w_.nranks - 1) / w_.nranks;
  }

  void start(const GatherLayout& layout, bool in_place, int iter, const char* kind) {
    const CallBuffers b = magi::bench::call_buffers(layout, max_, iter, w_.rank, in_place);
    const unsigned char* send = (b.send_in_recv ? recv_ : send_) + b.send_offset;
    if (plan_.on())
      plan_.line(std::string(kind) + ' ' + std::to_string(layout.recv_bytes) + ' ' +
                 (in_place ? '1' : '0') + ' ' + std::to_string(iter) + ' ' +
                 std::to_string(b.recv_offset) + ' ' + std::to_string(layout.count));
    all_gather(send, recv_ + b.recv_offset, layout.count, w_.comm, memory_.stream());
  }

  // The data of check round `rep` at shift 0 (iteration 0), the receive buffer zeroed first.
  void fill(const GatherLayout& layout, bool in_place, uint32_t rep) {
    memory_.zero(recv_, layout.recv_bytes);
    const std::vector<float> data = rank_data(rep, w_.rank, layout.count);
    unsigned char* to = in_place ? recv_ + layout.send_bytes * static_cast<size_t>(w_.rank) : send_;
    memory_.write(to, data.data(), layout.send_bytes);
  }

  Result time_calls(const GatherLayout& layout, bool in_place) {
    if (check_) fill(layout, in_place, 99);
    start(layout, in_place, 0, "sync");
    memory_.synchronize();
    w_.barrier->wait();
    const auto begin = Clock::now();
    for (int iter = 0; iter < iters_; ++iter) start(layout, in_place, iter, "timed");
    memory_.synchronize();
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - begin).count();
    Result result;
    result.us = w_.barrier->mean(us / iters_);
    if (check_) {
      const uint32_t rep = ++rep_;
      fill(layout, in_place, rep);
      start(layout, in_place, 0, "check");
      memory_.synchronize();
      std::vector<float> got(layout.count * static_cast<size_t>(w_.nranks));
      memory_.read(got.data(), recv_, layout.recv_bytes);
      result.wrong = static_cast<long>(
          w_.barrier->sum(static_cast<double>(wrong_elements(got, rep, w_.nranks, layout.count))));
    }
    return result;
  }

  World& w_;
  Memory& memory_;
  size_t min_, max_, factor_;
  int iters_, warmup_;
  bool check_;
  Plan plan_;
  std::vector<size_t> sizes_;
  unsigned char* send_ = nullptr;
  unsigned char* recv_ = nullptr;
  uint32_t rep_ = 0;
  bool failed_ = false;
};

// ---- fsdp ------------------------------------------------------------------------------------

// The one call site of every layer's gather, as FSDP's.
__attribute__((noinline)) void gather_layer(const void* copy_in, void* output, size_t count,
                                            ncclComm_t comm, cudaStream_t stream) {
  all_gather(copy_in, output, count, comm, stream);
  asm volatile("" ::: "memory");
}

class FsdpLoop {
 public:
  FsdpLoop(World& world, Memory& memory, const Args& args)
      : w_(world),
        memory_(memory),
        layers_(args.number("--layers", 10)),
        steps_(args.number("--steps", 64)),
        frames_(args.number("--frames", 3)),
        in_place_(args.number("--in-place", 1) != 0),
        plan_(w_.rank == 0 ? args.text("--plan", "") : "") {
    const size_t block = args.size("--block-kib", "64") * 1024 / 8 * 8;
    if (layers_ < 1 || steps_ < 1 || frames_ < 1 || block == 0)
      throw std::runtime_error("fsdp wants --layers, --steps, --frames and --block-kib >= 1");
    shards_ = magi::bench::fsdp_shard_bytes(layers_, block);
    pool_ = magi::bench::pool_layout(shards_, w_.nranks, w_.rank, in_place_, frames_);
    for (int l = 0; l < layers_; ++l) {
      const size_t count = shards_[l] / kElement;
      weights_.push_back(memory_.allocate(shards_[l]));
      const std::vector<float> data = rank_data(static_cast<uint32_t>(l), w_.rank, count);
      memory_.write(weights_.back(), data.data(), shards_[l]);
    }
    pool_base_ = memory_.allocate(pool_.total_bytes());
  }

  void run() {
    w_.barrier->wait();
    std::vector<double> step_us(static_cast<size_t>(steps_));
    for (int s = 0; s < steps_; ++s) {
      const auto begin = Clock::now();
      step(s);
      memory_.synchronize();
      step_us[s] = std::chrono::duration<double, std::micro>(Clock::now() - begin).count();
    }
    double all = 0, late = 0;  // every step; the second half's
    for (int s = 0; s < steps_; ++s) {
      all += step_us[s];
      if (s >= steps_ / 2) late += step_us[s];
    }
    const double mean_us = w_.barrier->mean(all / steps_);
    const double late_us = w_.barrier->mean(late / (steps_ - steps_ / 2));
    const long wrong = static_cast<long>(w_.barrier->sum(static_cast<double>(check(steps_ - 1))));
    failed_ = wrong != 0;
    if (w_.rank == 0) {
      size_t gathered = 0;
      for (const size_t shard : shards_) gathered += shard * static_cast<size_t>(w_.nranks);
      std::printf(
          "# %s fsdp: %d ranks, NCCL %s, %s memory, %d layers (%zu bytes gathered a "
          "step), %d steps, pool of %d frames of %zu bytes, copy-in %s\n",
          kTool, w_.nranks, version_text().c_str(), memory_.device() ? "device" : "host", layers_,
          gathered, steps_, frames_, pool_.frame_bytes,
          in_place_ ? "in the output (FSDP2)" : "a buffer of its own");
      std::printf("# %6s %6s %6s %8s  %12s %12s %6s\n", "layers", "steps", "frames", "in_place",
                  "step(us)", "late(us)", "#wrong");
      std::printf("  %6d %6d %6d %8d  %12.3f %12.3f %6ld\n", layers_, steps_, frames_,
                  in_place_ ? 1 : 0, mean_us, late_us, wrong);
    }
  }
  bool failed() const { return failed_; }

 private:
  unsigned char* copy_in(int s, int l) const {
    return pool_base_ + pool_.frame_offset(s) + pool_.layers[l].copy_in;
  }
  unsigned char* output(int s, int l) const {
    return pool_base_ + pool_.frame_offset(s) + pool_.layers[l].output;
  }

  void step(int s) {
    for (int l = 0; l < layers_; ++l) {
      const size_t count = shards_[l] / kElement;
      memory_.copy(copy_in(s, l), weights_[l], shards_[l]);
      if (plan_.on())
        plan_.line(std::to_string(s) + ' ' + std::to_string(l) + ' ' + std::to_string(count));
      gather_layer(copy_in(s, l), output(s, l), count, w_.comm, memory_.stream());
    }
  }

  long check(int s) const {
    long wrong = 0;
    for (int l = 0; l < layers_; ++l) {
      const size_t count = shards_[l] / kElement;
      std::vector<float> got(count * static_cast<size_t>(w_.nranks));
      memory_.read(got.data(), output(s, l), got.size() * kElement);
      wrong += wrong_elements(got, static_cast<uint32_t>(l), w_.nranks, count);
    }
    return wrong;
  }

  World& w_;
  Memory& memory_;
  int layers_, steps_, frames_;
  bool in_place_;
  Plan plan_;
  std::vector<size_t> shards_;
  std::vector<unsigned char*> weights_;
  magi::bench::PoolLayout pool_;
  unsigned char* pool_base_ = nullptr;
  bool failed_ = false;
};

int usage() {
  std::fprintf(stderr,
               "usage: %s perf [-b 4K] [-e 16M] [-f 4] [-n 40] [-w 1] [-c 1] [--memory host|"
               "device] [--plan FILE]\n"
               "       %s fsdp [--layers 10] [--block-kib 64] [--steps 64] [--frames 3] "
               "[--in-place 1] [--memory host|device] [--plan FILE]\n"
               "ranks come from magi-launch (STANDIN_RANK, STANDIN_NRANKS, STANDIN_ID_FILE)\n",
               kTool, kTool);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage();
  const std::string mode = argv[1];
  if (mode != "perf" && mode != "fsdp") return usage();
  int rank = -1;
  try {
    const Args args(argc, argv);
    World world = find_rank();
    rank = world.rank;
    Memory memory(args.text("--memory", "host"), rank);
    NCCL_CHECK(ncclCommInitRank(&world.comm, world.nranks, world.id, rank));
    bool failed = false;
    if (mode == "perf") {
      PerfLoop loop(world, memory, args);
      loop.run();
      failed = loop.failed();
    } else {
      FsdpLoop loop(world, memory, args);
      loop.run();
      failed = loop.failed();
    }
    NCCL_CHECK(ncclCommDestroy(world.comm));
    if (failed && rank == 0) std::fprintf(stderr, "%s: wrong elements gathered\n", kTool);
    return failed ? 1 : 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: rank %d: %s\n", kTool, rank, e.what());
    return 1;
  }
}
