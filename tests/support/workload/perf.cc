// perf [--sizes B1,B2,...] [--warmup W] [--iters N] [--device 1 [--graph G] [--shift S]
//      [--report-capture 1]]
//
// The loop nccl-tests' all_gather_perf runs (-c 1), as a user first tries the library: for each
// size B (bytes gathered in all, split evenly over the ranks), out of place and then in place,
// W warmup calls from one call site, N timed calls from a second, then one check call from a
// third after the send buffer was rewritten. Every call of one size has one shape, so the step
// is one call, found again after each change of size. Silent unless wrong: the result of the
// last timed call and of the check call are checked element by element.
// --graph G (with --device 1), as all_gather_perf -G G: the W calls stay eager, the N timed
// calls are captured into one CUDA graph (global capture mode) launched G times, and the check
// call is captured into a graph of its own, launched once: after a change of size only the W
// calls are eager. --shift S: the timed calls take their buffers at S places in turn inside
// allocations S times larger (call i at i mod S), as all_gather_perf moves each call's buffers
// inside its allocation. --report-capture 1: each capture of the timed calls says how long it
// took, on stderr.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tests/support/workload/scenario.h"

namespace workload {
namespace {

std::vector<size_t> sizes_of(const std::string& text) {
  std::vector<size_t> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoull(item));
  return out;
}

struct Phase {
  const Placement& placement;
  ncclComm_t comm;
  int rank, nranks;
  size_t count;  // uint32 elements per rank
  bool in_place;
  Buffer& own;
  Buffer& out;
  int shifts = 1;  // places the timed calls take in turn (--shift)

  size_t shard() const { return count * sizeof(uint32_t); }
  size_t gathered() const { return shard() * static_cast<size_t>(nranks); }
  // Where call `i` takes its buffers: the out side moves by whole results, and so the send side
  // (in place it is the rank's part of the result).
  void* send_of(int i) const {
    return static_cast<unsigned char*>(send()) + gathered() * static_cast<size_t>(i % shifts);
  }
  void* recv_of(int i) const {
    return static_cast<unsigned char*>(out.nccl()) + gathered() * static_cast<size_t>(i % shifts);
  }
  static uint32_t value(uint32_t seed, int rank, size_t i) {
    return seed * 2654435761u ^ static_cast<uint32_t>(rank * 40503 + i);
  }
  const Buffer& send_side() const { return in_place ? out : own; }
  size_t send_at() const { return in_place ? shard() * static_cast<size_t>(rank) : 0; }
  void* send() const { return static_cast<unsigned char*>(send_side().nccl()) + send_at(); }

  void fill(uint32_t seed) const {
    unsigned char* into = send_side().host() + send_at();
    for (size_t i = 0; i < count; ++i) {
      const uint32_t v = value(seed, rank, i);
      std::memcpy(into + i * sizeof v, &v, sizeof v);
    }
    send_side().upload(send_at(), shard());
  }
  // Fills every place the timed calls take (--shift) with the same values.
  void fill_places(uint32_t seed) const {
    fill(seed);
    const size_t at = send_at();
    for (int place = 1; place < shifts; ++place) {
      const size_t to = at + gathered() * static_cast<size_t>(place);
      std::memcpy(send_side().host() + to, send_side().host() + at, shard());
      send_side().upload(to, shard());
    }
  }
  // Checks the result call `i` wrote (the place it took).
  void check(uint32_t seed, const char* what, int call = 0) const {
    placement.synchronize();
    const size_t base = gathered() * static_cast<size_t>(call % shifts);
    out.download(base, gathered());
    for (int r = 0; r < nranks; ++r) {
      for (size_t i = 0; i < count; ++i) {
        uint32_t got = 0;
        std::memcpy(&got, out.host() + base + shard() * static_cast<size_t>(r) + i * sizeof got,
                    sizeof got);
        if (got != value(seed, r, i))
          throw ScenarioFailure(
              format("rank %d: %zu bytes %s, %s: element %zu from rank %d is "
                     "%u, expected %u",
                     rank, shard() * static_cast<size_t>(nranks),
                     in_place ? "in place" : "out of place", what, i, r, got, value(seed, r, i)));
      }
    }
  }
};

// Each a call site of its own, as nccl-tests' warmup loop, timed loop and check are.
void warmup_calls(const Phase& p, int n) {
  for (int i = 0; i < n; ++i)
    WORKLOAD_CHECK(
        ncclAllGather(p.send(), p.out.nccl(), p.count, ncclUint32, p.comm, p.placement.stream()));
}
void timed_calls(const Phase& p, int n) {
  for (int i = 0; i < n; ++i)
    WORKLOAD_CHECK(ncclAllGather(p.send_of(i), p.recv_of(i), p.count, ncclUint32, p.comm,
                                 p.placement.stream()));
}
void check_call(const Phase& p) {
  WORKLOAD_CHECK(
      ncclAllGather(p.send(), p.out.nccl(), p.count, ncclUint32, p.comm, p.placement.stream()));
}

// Runs `calls` captured into a CUDA graph on the phase's stream, then launches it `launches`
// times (--graph). Returns how long the capture took (begin to end), in milliseconds.
template <typename Calls>
double captured(const Phase& p, int launches, Calls calls) {
  const cudaStream_t stream = p.placement.stream();
  const auto began = std::chrono::steady_clock::now();
  Placement::cuda_check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal),
                        "cudaStreamBeginCapture");
  std::string failed;
  try {
    calls();
  } catch (const ScenarioFailure& e) {
    failed = e.what();  // the capture still ends, so the stream is usable and the failure said
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(stream, &graph);
  if (!failed.empty()) {
    if (graph != nullptr) cudaGraphDestroy(graph);
    throw ScenarioFailure(failed + " (captured into a CUDA graph)");
  }
  Placement::cuda_check(ended, "cudaStreamEndCapture");
  const double took =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - began).count();
  cudaGraphExec_t exec = nullptr;
  const cudaError_t made = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  Placement::cuda_check(made, "cudaGraphInstantiate");
  cudaError_t launched = cudaSuccess;
  for (int i = 0; i < launches && launched == cudaSuccess; ++i)
    launched = cudaGraphLaunch(exec, stream);
  const cudaError_t done = cudaStreamSynchronize(stream);
  cudaGraphExecDestroy(exec);
  Placement::cuda_check(launched, "cudaGraphLaunch");
  Placement::cuda_check(done, "cudaStreamSynchronize");
  return took;
}

}  // namespace

int run_perf(const ScenarioOptions& options) {
  const std::vector<size_t> sizes = sizes_of(options.text("sizes", "4096,65536,1048576"));
  const int warmup = static_cast<int>(options.number("warmup", 1));
  const int iters = static_cast<int>(options.number("iters", 40));
  const int launches = static_cast<int>(options.number("graph", 0));
  const int shifts = static_cast<int>(options.number("shift", 1));
  const bool report_capture = options.number("report-capture", 0) != 0;
  if (sizes.empty() || warmup < 0 || iters < 1 || launches < 0 || shifts < 1)
    throw ScenarioFailure(
        "--sizes needs at least one size, --iters and --shift a positive count, --graph >= 0");
  const Placement placement(options);
  if (launches > 0 && !placement.device())
    throw ScenarioFailure("--graph needs --device 1 (CUDA graphs)");
  const Bootstrap boot = bootstrap_from_env();
  OwnedComm comm;
  WORKLOAD_CHECK(ncclCommInitRank(comm.out(), boot.nranks, boot.id, boot.rank));
  for (size_t s = 0; s < sizes.size(); ++s) {
    const size_t count = std::max<size_t>(sizes[s] / sizeof(uint32_t) / boot.nranks, 1);
    const size_t gathered = count * sizeof(uint32_t) * static_cast<size_t>(boot.nranks);
    Buffer own(placement, gathered * static_cast<size_t>(shifts));
    Buffer out(placement, gathered * static_cast<size_t>(shifts));
    for (const bool in_place : {false, true}) {
      const Phase p{placement, comm.get(), boot.rank, boot.nranks, count,
                    in_place,  own,        out,       shifts};
      const uint32_t seed = static_cast<uint32_t>(s * 4 + (in_place ? 2 : 0));
      p.fill_places(seed);
      warmup_calls(p, warmup);
      if (launches > 0) {
        const double ms = captured(p, launches, [&] { timed_calls(p, iters); });
        if (report_capture)
          std::fprintf(stderr,
                       "perf: rank %d: %zu bytes %s: a capture of %d gathers took %.2f ms\n",
                       boot.rank, sizes[s], in_place ? "in place" : "out of place", iters, ms);
      } else {
        timed_calls(p, iters);
      }
      p.check(seed, "after the timed calls", iters - 1);
      p.fill(seed + 1);
      if (launches > 0) {
        captured(p, 1, [&] { check_call(p); });
      } else {
        check_call(p);
      }
      p.check(seed + 1, "the check call");
    }
  }
  comm.destroy();
  return 0;
}

}  // namespace workload
