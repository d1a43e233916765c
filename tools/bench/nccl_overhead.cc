// What the shim adds to one call of the real NCCL, in pass-through: ncclAllReduce of one float in
// place on a 1-rank communicator (NCCL launches nothing for it, so the call is pure host work),
// called directly and through libmagice.so's exported ncclAllReduce, in one process. Batches of
// each are interleaved; the per-call median over the batches is reported. Needs a GPU.
//
//   magice-nccl-bench --nccl /path/to/libnccl.so.2 --shim build/libmagice.so
//                     [--op allreduce|allgather] [--calls N] [--batches B] [--spacing-ns S]
//
// Options (MAGI_*) are read once per process: run-nccl-bench.sh runs one process per
// configuration. --op allgather times an in-place all-gather instead (on a 1-rank communicator
// NCCL launches nothing for it either), the call rewrite/ looks at most closely. --spacing-ns S
// starts calls at least S ns apart, as real collectives are (what the flight recorder's
// completion needs: it hands its events back once a millisecond), and times each call alone.
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tools/bench/loading.h"

namespace {

using magi::bench::must_find;
using magi::bench::must_open;
constexpr char kTool[] = "magice-nccl-bench";

void must(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "%s: %s failed\n", kTool, what);
  std::exit(2);
}

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string nccl_path, shim_path, op = "allreduce";
  long calls = 20000, batches = 31, spacing_ns = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string key = argv[i];
    if (key == "--nccl")
      nccl_path = argv[i + 1];
    else if (key == "--shim")
      shim_path = argv[i + 1];
    else if (key == "--op")
      op = argv[i + 1];
    else if (key == "--calls")
      calls = std::atol(argv[i + 1]);
    else if (key == "--batches")
      batches = std::atol(argv[i + 1]);
    else if (key == "--spacing-ns")
      spacing_ns = std::atol(argv[i + 1]);
  }
  if (nccl_path.empty() || shim_path.empty() || calls < 1 || batches < 1 || spacing_ns < 0 ||
      (op != "allreduce" && op != "allgather")) {
    std::fprintf(stderr,
                 "usage: magice-nccl-bench --nccl LIBNCCL --shim LIBMAGICE [--op allreduce|"
                 "allgather] [--calls N] [--batches B] [--spacing-ns S]\n");
    return 2;
  }
  // RTLD_LOCAL, as PyTorch loads NCCL.
  void* nccl = must_open(kTool, nccl_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  void* magice = must_open(kTool, shim_path.c_str(), RTLD_NOW | RTLD_LOCAL);
  using AllReduceFn = decltype(&ncclAllReduce);
  using AllGatherFn = decltype(&ncclAllGather);
  const auto direct_reduce = must_find<AllReduceFn>(kTool, nccl, "ncclAllReduce");
  const auto shim_reduce = must_find<AllReduceFn>(kTool, magice, "ncclAllReduce");
  const auto direct_gather = must_find<AllGatherFn>(kTool, nccl, "ncclAllGather");
  const auto shim_gather = must_find<AllGatherFn>(kTool, magice, "ncclAllGather");
  const auto get_id = must_find<decltype(&ncclGetUniqueId)>(kTool, nccl, "ncclGetUniqueId");
  const auto init = must_find<decltype(&ncclCommInitRank)>(kTool, magice, "ncclCommInitRank");
  const auto destroy = must_find<decltype(&ncclCommDestroy)>(kTool, magice, "ncclCommDestroy");

  must(cudaSetDevice(0) == cudaSuccess, "cudaSetDevice");
  float* buffer = nullptr;
  must(cudaMalloc(&buffer, 256) == cudaSuccess, "cudaMalloc");
  cudaStream_t stream = nullptr;
  must(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess,
       "cudaStreamCreate");
  ncclUniqueId id;
  ncclComm_t comm = nullptr;
  must(get_id(&id) == ncclSuccess && init(&comm, 1, id, 0) == ncclSuccess,
       "making a 1-rank communicator");

  auto call = [&](bool through_shim) {
    const ncclResult_t r = op == "allreduce"
                               ? (through_shim ? shim_reduce : direct_reduce)(
                                     buffer, buffer, 1, ncclFloat32, ncclSum, comm, stream)
                               : (through_shim ? shim_gather : direct_gather)(
                                     buffer, buffer, 1, ncclFloat32, comm, stream);
    if (r != ncclSuccess) must(false, "a call");
  };
  using Clock = std::chrono::steady_clock;
  // Mean ns per call of one batch: back to back, or each call timed alone, S ns apart.
  auto batch = [&](bool through_shim) {
    double ns = 0;
    if (spacing_ns == 0) {
      const auto start = Clock::now();
      for (long i = 0; i < calls; ++i) call(through_shim);
      ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
    } else {
      for (long i = 0; i < calls; ++i) {
        const auto start = Clock::now();
        call(through_shim);
        const auto end = Clock::now();
        ns += std::chrono::duration<double, std::nano>(end - start).count();
        while (Clock::now() - start < std::chrono::nanoseconds(spacing_ns)) {}
      }
    }
    must(cudaStreamSynchronize(stream) == cudaSuccess, "cudaStreamSynchronize");
    return ns / static_cast<double>(calls);
  };
  batch(false);  // warm both paths up (the shim reads its options, finds its step)
  batch(true);
  std::vector<double> direct, shim;
  for (long b = 0; b < batches; ++b) {
    // Alternate which goes first, so that neither always follows the other.
    if (b % 2 == 0) {
      direct.push_back(batch(false));
      shim.push_back(batch(true));
    } else {
      shim.push_back(batch(true));
      direct.push_back(batch(false));
    }
  }
  const double d = median(direct), s = median(shim);
  std::printf(
      "%s in place, 1 rank, %ld calls x %ld batches%s: direct %.1f ns  shim %.1f ns  "
      "added %.1f ns\n",
      op.c_str(), calls, batches,
      spacing_ns != 0 ? (", " + std::to_string(spacing_ns) + " ns apart").c_str() : "", d, s,
      s - d);
  destroy(comm);
  cudaStreamDestroy(stream);
  cudaFree(buffer);
  return 0;
}
