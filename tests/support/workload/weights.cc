// weights --layers L --steps S --program reused|swap|alternate|rehome|move [--swap-step K]
//         [--rehome-rank R --rehome-step K [--rehome-other 1] [--rehome-reuse 1]]
//         [--move-step K [--move-rank R] [--move-order forward|reverse]] [--device 1]
//         [--arena 1 [--arenas N]] [--vmm 1|2] [--memfd 1] [--report-memory 1] [--shard-elements N]
//         [--swap-rank R] [--errors-expected 1] [--report-slowest 1] [--mixed 1]
//         [--check-every K] [--recv-buffers N] [--step-pause-ms T]
//         [--graph-step K [--graph-rewrite 1] [--graph-streams 2]]
//
// Weights that never change after load, gathered every step in the ways a program may hold
// them, for MAGI_STATIC_WEIGHTS=1 (whose promise each one keeps: the gathered contents never
// change; which buffer holds them may). Each step gathers every layer's shard once (int32
// elements, equal shapes for every layer, one call site), then all-reduces a counter. Every
// received byte is checked right after its call, against the layer the call meant. With
// --device 1 every buffer NCCL sees (the shards, the one reused buffer, the re-homed shard and
// the receive buffers) is device memory on GPU 0 (Placement, scenario.h): the shards are
// uploaded once at load, as weights are, and each received buffer is copied back and checked
// right after its call, as on host memory.
//   reused     one send buffer for every layer: each layer's shard is copied into it just before
//              its gather (a program with one staging buffer)
//   swap       a buffer of its own per layer; from step K (default 15) on, every rank gathers
//              layers 0 and 1 in the other order
//   alternate  the same, swapping the order of layers 0 and 1 every other step from step K
//              (swap and alternate: with --swap-rank R only rank R changes its order; every
//              rank's part is checked against the layer that rank sent, as NCCL gathers it)
//   rehome     a buffer per layer; at step K rank R (default 1) copies its shard of layer 0 into a
//              new buffer and gathers from there on (the old one stays allocated, unchanged);
//              with --rehome-other 1 the new buffer holds other bytes (a broken promise: every
//              rank accepts either the old or the new bytes of that part from step K on);
//              with --rehome-reuse 1 the old buffer is then refilled with other bytes, as a
//              caching allocator hands a freed block to another tensor (the promise holds: the
//              new buffer holds the shard)
//   move       the shards come from an allocator that reuses freed blocks (an arena, below: the
//              /dev/shm one with --arena 1, else one on the heap); at step K (--move-step,
//              default 12) every rank, or rank R alone with --move-rank R, re-homes every layer
//              in order: a new block, the same values copied in, the old block poisoned and
//              given back. So layer 0 gets a fresh block and layer i + 1 the block layer i had:
//              the values never change, only where they live. With --move-order reverse every
//              old block is poisoned and given back first, and the layers then loaded anew in
//              order: the last block given back first, so layer i gets the block of layer
//              L - 1 - i (by addresses, the layers gathered in reverse order)
// Where the shards live (the other buffers are always Buffers of their own, re-homed shards too):
//   default         a Buffer of its own each (aligned_alloc, or cudaMalloc with --device 1)
//   --arena 1       all carved out of one allocation (arena.h), as a caching allocator does: a
//                   file in /dev/shm mapped MAP_SHARED on host memory, one cudaMalloc on device
//   --arenas N      (with --arena 1) N such allocations, the layers split among them in order, as a
//                   large model's shards are (the caching allocator gives a shard of 10 MiB or
//                   more a segment of its own): --arenas L gives every shard its own allocation
//   --vmm 1         (with --device 1) all in one range of cuMemCreate granules (2 MiB each, made
//                   shareable as POSIX file descriptors), as PyTorch's expandable segments are
//   --memfd 1       (host memory) all in one memfd_create file mapped MAP_SHARED: no name a peer
//                   could open, so its owner hands peers a descriptor of it
//   --vmm 2         (with --device 1) all in one cuMemCreate allocation made without a shareable
//                   handle type: no other process can map it
// The shards are loaded before the communicator is made, as a program loads its model first.
// --shard-elements N: int32 elements of every shard (default 1024); with --mixed 1 (--program
// swap) layer l >= 2 holds 1 to 32 times N, 4 times on average (2 to 64 MiB from N of 512 Ki,
// 8 MiB on average), as a model's projections differ.
// --check-every K: the received bytes are checked at every K-th step and the last (default 1:
// every step), so that a run of many large gathers spends its time gathering.
// --recv-buffers N: N receive buffers taken in turn instead of one a layer (so 1,000 layers of
// up to 64 MiB on 8 ranks fit one GPU).
// --graph-step K (--device 1, --program swap with no swap, one receive buffer a layer): step K's
// gathers are captured into a CUDA graph (the global capture mode, as torch.cuda.graph's) and
// every step from K on replays it instead of calling NCCL; the counter's all-reduce stays an
// eager call. The received bytes are checked after each replay as after eager calls. The graph
// is destroyed after the communicator, as a program that keeps its graphs to the end does.
// --graph-rewrite 1 (no static weights: the promise is broken on purpose): before each replay
// every rank rewrites every shard, position p holding layer (p + step) % 64's values at that
// step, so a replay that sent what the buffers held at its capture, or at an earlier replay,
// is caught.
// --graph-streams 2: step K + 1 captures a second graph on a second stream, the layers in
// reverse order into receive buffers of its own; from then on each step launches the first
// graph on the program's stream and the second on the other, with nothing ordering the two (as
// NCCL allows of one communicator's graphs), and checks both.
// --errors-expected 1: a gather may return an error and receive wrong bytes, as long as the
// rank learns of it: at the end, every rank with a wrong byte must have had an error from a
// gather or from ncclCommGetAsyncError, else the run fails ("silent").
// --step-pause-ms T: after each step every rank sleeps T ms (host work between steps), so that a
// run of many steps lasts long enough for a set-up the library makes off the calls.
// --report-slowest 1 prints the longest time one ncclAllGather call took on this rank, host
// time, and its step ("rank R: slowest gather call: <us> us (step S)"): whether any call waited
// for the library's set-up. Rank 0 also prints, each step, its gather calls' mean host time and
// the step's time ("rank 0: step S: <us> us a gather call on average, <s> s the step").
// --report-memory 1 (with --device 1) prints the device's free memory to stderr once every rank
// has loaded and joined ("device memory free before: <bytes>") and after the last step, before
// the communicator goes ("device memory free after: <bytes>"), between all-reduces that keep
// every rank from allocating or freeing while another reads it. All ranks share the GPU: the
// difference is what the whole job allocated on the way, for every rank together.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tests/support/workload/arena.h"
#include "tests/support/workload/scenario.h"

namespace workload {
namespace {

// Elements of every shard (--shard-elements, default 1024), set once before anything runs.
size_t shard_elements = 1024;
// --mixed 1: layer l >= 2 holds shard_elements times kMixed[(l - 2) % 16] elements (1x to 32x,
// 4x on average, as a model's projections differ: 2 to 64 MiB, 8 MiB on average, from 2 MiB);
// layers 0 and 1, which programs swap, the base.
bool mixed_sizes = false;
constexpr size_t kMixed[16] = {1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 8, 32};

size_t layer_elements(int layer) {
  return mixed_sizes && layer >= 2 ? shard_elements * kMixed[(layer - 2) % 16] : shard_elements;
}

int32_t element(int layer, int rank, size_t index) {
  const uint32_t h = static_cast<uint32_t>(index * 2654435761u) ^
                     static_cast<uint32_t>((layer + 1) * 40503) ^
                     static_cast<uint32_t>((rank + 1) * 0x9e3779b1u);
  return static_cast<int32_t>(h);
}

int32_t* elements(const Buffer& buffer) { return reinterpret_cast<int32_t*>(buffer.host()); }

// `s` filled with a shard of `layer`'s weights, written once where NCCL reads it (as a load does).
Buffer load_shard(Buffer s, int layer, int rank) {
  const size_t count = std::min(layer_elements(layer), s.bytes() / sizeof(int32_t));
  for (size_t i = 0; i < count; ++i) elements(s)[i] = element(layer, rank, i);
  s.upload(0, s.bytes());
  return s;
}

// The arena the shards are carved out of, if the options ask for one.
std::optional<Arena::Kind> arena_kind(const ScenarioOptions& options, const Placement& placement) {
  const auto vmm = options.number("vmm", 0);
  if (vmm != 0 && !placement.device()) throw ScenarioFailure("--vmm needs --device 1");
  if (vmm != 0) return vmm == 2 ? Arena::Kind::CudaVmmPrivate : Arena::Kind::CudaVmm;
  if (options.number("memfd", 0) != 0) {
    if (placement.device()) throw ScenarioFailure("--memfd 1 is host memory: not with --device 1");
    return Arena::Kind::HostMemfd;
  }
  if (options.number("arena", 0) == 0) return std::nullopt;
  return placement.device() ? Arena::Kind::CudaMalloc : Arena::Kind::SharedFile;
}

size_t free_device_memory() {
  size_t free = 0;
  size_t total = 0;
  Placement::cuda_check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
  return free;
}

__attribute__((noinline)) ncclResult_t gather_layer(const void* shard, void* full, size_t count,
                                                    ncclComm_t comm, cudaStream_t stream) {
  const ncclResult_t result = ncclAllGather(shard, full, count, ncclInt32, comm, stream);
  asm volatile("" ::: "memory");
  return result;
}

constexpr int kOtherBytes = 100;         // the layer whose bytes a --rehome-other shard holds
constexpr int kReusedBytes = 101;        // what --rehome-reuse writes into the old block
constexpr unsigned char kPoison = 0xee;  // a checked receive buffer before the gather
constexpr size_t kGuardBytes = size_t{4} << 10;  // poisoned past the gathered bytes, and checked

// What a gather should have received: rank r's part is `layer_of(r)`'s shard of r, or, for
// `either_rank`, possibly kOtherBytes'. "" when it did, else what was wrong.
template <class LayerOf>
std::string wrong_parts(const int32_t* full, size_t count, int nranks, LayerOf layer_of, int me,
                        int step, int position, int either_rank = -1) {
  for (int r = 0; r < nranks; ++r) {
    const int layer = layer_of(r);
    const int32_t* part = full + static_cast<size_t>(r) * count;
    size_t wrong = 0;
    size_t first = 0;
    for (size_t i = 0; i < count; ++i) {
      if (part[i] == element(layer, r, i)) continue;
      if (r == either_rank && part[i] == element(kOtherBytes, r, i)) continue;
      if (wrong++ == 0) first = i;
    }
    if (wrong == 0) continue;
    int other = -1;  // which layer the bytes are, if any
    for (int l = 0; l < 64 && other < 0; ++l)
      if (part[first] == element(l, r, first)) other = l;
    return format(
        "rank %d: step %d position %d (layer %d): %zu wrong elements of "
        "rank %d's part, the first at %zu (bytes of layer %d)",
        me, step, position, layer, wrong, r, first, other);
  }
  return {};
}

}  // namespace

int run_weights(const ScenarioOptions& options) {
  const int layers = static_cast<int>(options.number("layers", 4));
  shard_elements = static_cast<size_t>(options.number("shard-elements", 1024));
  if (shard_elements == 0) throw ScenarioFailure("--shard-elements must be at least 1");
  const int steps = static_cast<int>(options.number("steps", 40));
  const std::string program = options.text("program", "reused");
  const int swap_step = static_cast<int>(options.number("swap-step", 15));
  const int swap_rank = static_cast<int>(options.number("swap-rank", -1));
  const bool errors_expected = options.number("errors-expected", 0) != 0;
  const int rehome_rank = static_cast<int>(options.number("rehome-rank", 1));
  const int rehome_step = static_cast<int>(options.number("rehome-step", 15));
  const bool rehome_other = options.number("rehome-other", 0) != 0;
  const bool rehome_reuse = options.number("rehome-reuse", 0) != 0;
  const bool report_memory = options.number("report-memory", 0) != 0;
  const bool report_slowest = options.number("report-slowest", 0) != 0;
  const auto step_pause =
      std::chrono::duration<double, std::milli>(options.number("step-pause-ms", 0));
  mixed_sizes = options.number("mixed", 0) != 0;
  if (mixed_sizes && program != "swap") throw ScenarioFailure("--mixed 1 takes --program swap");
  const int check_every = static_cast<int>(options.number("check-every", 1));
  if (check_every < 1) throw ScenarioFailure("--check-every must be at least 1");
  const int recv_buffers = static_cast<int>(options.number("recv-buffers", 0));
  if (recv_buffers < 0) throw ScenarioFailure("--recv-buffers must be at least 1 (0: one a layer)");
  std::chrono::steady_clock::duration slowest{};  // the longest ncclAllGather call, host time
  int slowest_step = -1;
  if (layers < 2) throw ScenarioFailure("--layers must be at least 2");
  const int move_step = static_cast<int>(options.number("move-step", 12));
  const int move_rank = static_cast<int>(options.number("move-rank", -1));
  const std::string move_order = options.text("move-order", "forward");
  if (move_order != "forward" && move_order != "reverse")
    throw ScenarioFailure("--move-order is forward or reverse");
  if (program != "reused" && program != "swap" && program != "alternate" && program != "rehome" &&
      program != "move")
    throw ScenarioFailure("unknown --program " + program);

  const Placement placement(options);  // before the communicator: NCCL takes the device then
  if (report_memory && !placement.device())
    throw ScenarioFailure("--report-memory 1 needs --device 1");
  const size_t shard_bytes = shard_elements * sizeof(int32_t);
  const Bootstrap boot = bootstrap_from_env();
  const int n = boot.nranks;
  const int me = boot.rank;

  // Before the shards they lend memory to: they go after them.
  std::vector<std::unique_ptr<Arena>> arenas;
  const int arena_count = static_cast<int>(options.number("arenas", 1));
  if (arena_count < 1 || arena_count > layers)
    throw ScenarioFailure("--arenas takes 1 to --layers allocations");
  std::optional<Arena::Kind> kind = arena_kind(options, placement);
  if (!kind && program == "move") {
    if (placement.device()) throw ScenarioFailure("--program move on a device needs --arena 1");
    kind = Arena::Kind::Heap;
  }
  if (program == "move" && arena_count != 1)
    throw ScenarioFailure("--program move takes one arena (--arenas 1)");
  if (kind) {
    for (int a = 0; a < arena_count; ++a) {
      const int first = a * layers / arena_count, end = (a + 1) * layers / arena_count;
      // move: room for one more block, the one layer 0 moves to.
      size_t bytes = program == "move" ? Arena::aligned(shard_bytes) : 0;
      for (int l = first; l < end; ++l)
        bytes += Arena::aligned(layer_elements(l) * sizeof(int32_t));
      arenas.push_back(std::make_unique<Arena>(placement, *kind, bytes, a));
    }
  }
  Arena* const arena = arenas.empty() ? nullptr : arenas.front().get();  // move's one arena
  std::vector<Buffer> shards;  // this rank's part of every layer, loaded once
  for (int l = 0; l < layers; ++l) {
    // Arena a holds layers [a * layers / arena_count, (a + 1) * layers / arena_count).
    int a = 0;
    while (!arenas.empty() && (a + 1) * layers / arena_count <= l) ++a;
    const size_t bytes = layer_elements(l) * sizeof(int32_t);
    shards.push_back(load_shard(
        arenas.empty() ? Buffer(placement, bytes) : arenas[static_cast<size_t>(a)]->carve(bytes), l,
        me));
  }

  const int graph_step = static_cast<int>(options.number("graph-step", -1));
  const bool graph_rewrite = options.number("graph-rewrite", 0) != 0;
  const bool two_graphs = options.number("graph-streams", 1) == 2;
  if (two_graphs && (graph_step < 0 || mixed_sizes))
    throw ScenarioFailure("--graph-streams 2 takes --graph-step, and layers of one size");
  // The layer whose values position p's shard holds at a step of the graph.
  const auto graph_layer = [&](int position, int step) {
    return graph_rewrite ? (position + step) % 64 : position;
  };
  if (graph_step >= 0 &&
      (!placement.device() || program != "swap" || swap_step < steps || recv_buffers != 0))
    throw ScenarioFailure(
        "--graph-step takes --device 1, --program swap with no swap and one receive buffer a "
        "layer");
  // Declared before the communicator, so destroyed after it (the stream after the graphs).
  struct OwnStream {
    cudaStream_t stream = nullptr;
    ~OwnStream() {
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
  } other_stream;
  if (two_graphs)
    Placement::cuda_check(cudaStreamCreateWithFlags(&other_stream.stream, cudaStreamNonBlocking),
                          "cudaStreamCreateWithFlags");
  struct Graph {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    ~Graph() {
      if (exec != nullptr) cudaGraphExecDestroy(exec);
      if (graph != nullptr) cudaGraphDestroy(graph);
    }
  } graph, reversed;

  OwnedComm owned;
  WORKLOAD_CHECK(ncclCommInitRank(owned.out(), n, boot.id, me));
  const ncclComm_t comm = owned.get();
  const cudaStream_t stream = placement.stream();

  const Buffer staging(placement, shard_bytes);  // reused: the one send buffer
  std::vector<Buffer> retired;                   // rehome: the old buffer, kept unchanged
  // One receive buffer per position, or --recv-buffers N taken in turn (position p gathers into
  // buffer p % N, as a program that frees each layer's gathered weights after use does).
  const int receivers = recv_buffers == 0 ? layers : std::min(recv_buffers, layers);
  std::vector<size_t> receiver_elements(static_cast<size_t>(receivers), 0);
  for (int l = 0; l < layers; ++l) {
    size_t& most = receiver_elements[static_cast<size_t>(l % receivers)];
    most = std::max(most, layer_elements(l));
  }
  std::vector<Buffer> full;
  for (const size_t most : receiver_elements)
    full.emplace_back(placement, most * sizeof(int32_t) * n);
  std::vector<Buffer> full_reversed;  // --graph-streams 2: the second graph's
  if (two_graphs)
    for (const size_t most : receiver_elements)
      full_reversed.emplace_back(placement, most * sizeof(int32_t) * n);
  Buffer counter(placement, sizeof(int32_t));
  // Every rank adds 1: the sum says every rank got here (and a step's calls are all done).
  const auto count_ranks = [&](int step) {
    elements(counter)[0] = 1;
    counter.upload(0, counter.bytes());
    WORKLOAD_CHECK(
        ncclAllReduce(counter.nccl(), counter.nccl(), 1, ncclInt32, ncclSum, comm, stream));
    placement.synchronize();
    counter.download(0, counter.bytes());
    if (elements(counter)[0] != n)
      throw ScenarioFailure(
          format("rank %d: step %d: counter %d, expected %d", me, step, elements(counter)[0], n));
  };

  if (report_memory) {
    count_ranks(-1);
    std::fprintf(stderr, "device memory free before: %zu\n", free_device_memory());
  }
  int wrong_gathers = 0;   // --errors-expected: gathers that received a wrong byte
  int failed_gathers = 0;  // and that returned an error
  for (int step = 0; step < steps; ++step) {
    const auto step_began = std::chrono::steady_clock::now();
    std::chrono::steady_clock::duration step_calls{};  // host time inside ncclAllGather
    if (program == "rehome" && me == rehome_rank && step == rehome_step) {
      retired.push_back(std::exchange(shards[0], load_shard(Buffer(placement, shard_bytes),
                                                            rehome_other ? kOtherBytes : 0, me)));
      // As a caching allocator does: the old block goes to another tensor, which fills it.
      if (rehome_reuse) retired.back() = load_shard(std::move(retired.back()), kReusedBytes, me);
    }
    const bool moving =
        program == "move" && step == move_step && (move_rank < 0 || me == move_rank);
    if (moving && move_order == "reverse") {
      for (Buffer& shard : shards) {
        std::memset(shard.host(), 0x5a, shard_bytes);
        shard.upload(0, shard_bytes);
        arena->give_back(std::move(shard));
      }
      for (int l = 0; l < layers; ++l)
        shards[static_cast<size_t>(l)] = load_shard(arena->carve(shard_bytes), l, me);
    } else if (moving) {
      for (Buffer& shard : shards) {
        Buffer moved = arena->carve(shard_bytes);
        if (placement.device()) {
          Placement::cuda_check(
              cudaMemcpy(moved.nccl(), shard.nccl(), shard_bytes, cudaMemcpyDeviceToDevice),
              "cudaMemcpy of a moved shard");
        } else {
          std::memcpy(moved.host(), shard.host(), shard_bytes);
        }
        std::memset(shard.host(), 0x5a, shard_bytes);  // what a freed block may hold next
        shard.upload(0, shard_bytes);
        arena->give_back(std::exchange(shard, std::move(moved)));
      }
    }
    if (graph_step >= 0 && step >= graph_step) {
      const bool checked = step % check_every == 0 || step == steps - 1;
      // The layer the second graph gathers at `position` (the reverse order).
      const auto reversed_layer = [&](int position) { return layers - 1 - position; };
      const bool second = two_graphs && step > graph_step;
      if (checked)
        for (const std::vector<Buffer>* set : {&full, &full_reversed})
          for (const Buffer& recv : *set) {
            std::memset(recv.host(), kPoison, recv.bytes());
            recv.upload(0, recv.bytes());
          }
      // Each position's gathers captured into `into` on `on`, from the layer `layer_of` names.
      const auto capture = [&](Graph& into, cudaStream_t on, const std::vector<Buffer>& recvs,
                               auto layer_of) {
        Placement::cuda_check(cudaStreamBeginCapture(on, cudaStreamCaptureModeGlobal),
                              "cudaStreamBeginCapture");
        ncclResult_t captured = ncclSuccess;
        for (int position = 0; position < layers; ++position) {
          const int layer = layer_of(position);
          const ncclResult_t r = gather_layer(shards[static_cast<size_t>(layer)].nccl(),
                                              recvs[static_cast<size_t>(position)].nccl(),
                                              layer_elements(layer), comm, on);
          if (captured == ncclSuccess) captured = r;
        }
        const cudaError_t ended = cudaStreamEndCapture(on, &into.graph);
        check(captured, "ncclAllGather (captured into a CUDA graph)");
        Placement::cuda_check(ended, "cudaStreamEndCapture");
        Placement::cuda_check(cudaGraphInstantiate(&into.exec, into.graph, 0),
                              "cudaGraphInstantiate");
      };
      if (step == graph_step) capture(graph, stream, full, [](int position) { return position; });
      if (two_graphs && step == graph_step + 1)
        capture(reversed, other_stream.stream, full_reversed, reversed_layer);
      if (graph_rewrite)
        for (int position = 0; position < layers; ++position) {
          const Buffer& shard = shards[static_cast<size_t>(position)];
          const size_t count = layer_elements(position);
          for (size_t i = 0; i < count; ++i)
            elements(shard)[i] = element(graph_layer(position, step), me, i);
          shard.upload(0, count * sizeof(int32_t));
        }
      const auto launched = std::chrono::steady_clock::now();
      Placement::cuda_check(cudaGraphLaunch(graph.exec, stream), "cudaGraphLaunch");
      if (second) {
        Placement::cuda_check(cudaGraphLaunch(reversed.exec, other_stream.stream),
                              "cudaGraphLaunch (the second graph)");
        Placement::cuda_check(cudaStreamSynchronize(other_stream.stream),
                              "cudaStreamSynchronize (the second graph)");
      }
      placement.synchronize();
      step_calls += std::chrono::steady_clock::now() - launched;
      if (checked)
        for (int position = 0; position < layers; ++position) {
          const Buffer& recv = full[static_cast<size_t>(position)];
          recv.download(0, recv.bytes());
          const std::string wrong = wrong_parts(
              elements(recv), layer_elements(position), n,
              [&](int) { return graph_layer(position, step); }, me, step, position);
          if (!wrong.empty()) throw ScenarioFailure("replay: " + wrong);
          if (!second) continue;
          const Buffer& other = full_reversed[static_cast<size_t>(position)];
          other.download(0, other.bytes());
          const int layer = reversed_layer(position);
          const std::string wrong_other = wrong_parts(
              elements(other), layer_elements(layer), n,
              [&](int) { return graph_layer(layer, step); }, me, step, position);
          if (!wrong_other.empty()) throw ScenarioFailure("second graph's replay: " + wrong_other);
        }
      if (report_slowest && me == 0)
        std::fprintf(stderr,
                     "rank 0: step %d: %.1f us a gather replayed on average (the graph launched "
                     "and waited for)\n",
                     step,
                     std::chrono::duration<double, std::micro>(step_calls).count() /
                         (layers * (second ? 2 : 1)));
      count_ranks(step);
      continue;
    }
    const bool swapping = (program == "swap" && step >= swap_step) ||
                          (program == "alternate" && step >= swap_step && step % 2 == 1);
    // The layer rank r gathers at `position`: swapped on every rank, or on --swap-rank only.
    const auto layer_at = [&](int r, int position) {
      const bool swapped = swapping && (swap_rank < 0 || r == swap_rank);
      return swapped && position < 2 ? 1 - position : position;
    };
    for (int position = 0; position < layers; ++position) {
      const int layer = layer_at(me, position);
      const Buffer* send = &shards[static_cast<size_t>(layer)];
      if (program == "reused") {
        // Refilled from the layer's shard where NCCL reads it: a device-to-device copy on the
        // calls' stream, ordered before the gather as a program's own copy kernel would be.
        if (placement.device()) {
          Placement::cuda_check(cudaMemcpyAsync(staging.nccl(), send->nccl(), shard_bytes,
                                                cudaMemcpyDeviceToDevice, stream),
                                "cudaMemcpyAsync to the reused buffer");
        } else {
          std::memcpy(staging.host(), send->host(), shard_bytes);
        }
        send = &staging;
      }
      const Buffer& recv = full[static_cast<size_t>(position % receivers)];
      const size_t count = layer_elements(layer);  // equal at the positions swaps exchange
      // --check-every K: the received bytes are checked at every K-th step and the last.
      const bool checked = step % check_every == 0 || step == steps - 1;
      // Poisoned before every checked call, so a byte the gather did not write cannot pass. Only
      // the gathered bytes and a guard after them travel: a receive buffer shared by positions
      // of mixed sizes is sized for the largest, and moving all of it made a checked step of
      // 1,000 gathers take minutes on one GPU.
      const size_t gathered_bytes = count * sizeof(int32_t) * static_cast<size_t>(n);
      const size_t checked_bytes = std::min(recv.bytes(), gathered_bytes + kGuardBytes);
      if (checked) {
        std::memset(recv.host(), kPoison, checked_bytes);
        recv.upload(0, checked_bytes);
      }
      const auto called = std::chrono::steady_clock::now();
      const ncclResult_t gathered = gather_layer(send->nccl(), recv.nccl(), count, comm, stream);
      const auto took = std::chrono::steady_clock::now() - called;
      step_calls += took;
      if (took > slowest) {
        slowest = took;
        slowest_step = step;
      }
      if (!errors_expected) check(gathered, "ncclAllGather");
      if (gathered != ncclSuccess && failed_gathers++ == 0)
        std::fprintf(stderr, "rank %d: step %d position %d: ncclAllGather returned %s\n", me, step,
                     position, ncclGetErrorString(gathered));
      if (!checked) continue;
      placement.synchronize();
      recv.download(0, checked_bytes);
      const bool either = rehome_other && layer == 0 && step >= rehome_step;
      std::string wrong = wrong_parts(
          elements(recv), count, n, [&](int r) { return layer_at(r, position); }, me, step,
          position, either ? rehome_rank : -1);
      const unsigned char* guard = recv.host() + gathered_bytes;
      if (wrong.empty() && std::any_of(guard, guard + (checked_bytes - gathered_bytes),
                                       [](unsigned char b) { return b != kPoison; }))
        wrong = format("rank %d: step %d position %d: the gather wrote past its %zu bytes", me,
                       step, position, gathered_bytes);
      if (wrong.empty()) continue;
      if (!errors_expected) throw ScenarioFailure(wrong);
      if (wrong_gathers++ == 0) std::fprintf(stderr, "%s\n", wrong.c_str());
    }
    if (report_slowest && me == 0)
      std::fprintf(
          stderr, "rank 0: step %d: %.1f us a gather call on average, %.3f s the step\n", step,
          std::chrono::duration<double, std::micro>(step_calls).count() / layers,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - step_began).count());
    count_ranks(step);
    if (step_pause.count() > 0) std::this_thread::sleep_for(step_pause);
  }
  if (report_slowest)
    std::fprintf(stderr, "rank %d: slowest gather call: %.1f us (step %d)\n", me,
                 std::chrono::duration<double, std::micro>(slowest).count(), slowest_step);
  if (report_memory) {
    count_ranks(steps);
    std::fprintf(stderr, "device memory free after: %zu\n", free_device_memory());
    count_ranks(steps);  // no rank frees anything (destroy) before every rank has read it
  }
  if (errors_expected) {
    // Wrong bytes are allowed only where NCCL reports an error: at a gather, or afterwards as the
    // communicator's asynchronous error (read once every rank is past its last gather).
    count_ranks(steps);
    ncclResult_t async = ncclSuccess;
    WORKLOAD_CHECK(ncclCommGetAsyncError(comm, &async));
    std::fprintf(stderr,
                 "rank %d: %d gathers received wrong bytes, %d returned an error; asynchronous "
                 "error: %s\n",
                 me, wrong_gathers, failed_gathers, ncclGetErrorString(async));
    if (wrong_gathers != 0 && failed_gathers == 0 && async == ncclSuccess)
      throw ScenarioFailure(format("rank %d: wrong bytes and no error: silent", me));
  }
  owned.destroy();
  return 0;
}

}  // namespace workload
