// What the shim adds to one NCCL call in pass-through: the same stand-in ncclAllReduce called
// directly, and through libmagice.so's exported ncclAllReduce, in one process, interleaved by
// Google Benchmark. Options are read once per process, so run-bench.sh runs this once per
// configuration (call sites off/on, tracing on).
//
//   magice-bench --standin build/tests/support/libnccl.so.2 --shim build/libmagice.so [benchmark
//   flags]
#include <benchmark/benchmark.h>
#include <dlfcn.h>
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "tools/bench/loading.h"

namespace {

using magi::bench::must_find;
using magi::bench::must_open;
constexpr char kTool[] = "magice-bench";

using AllReduceFn = decltype(&ncclAllReduce);
AllReduceFn g_direct = nullptr;
AllReduceFn g_shim = nullptr;
ncclComm_t g_comm = nullptr;
float g_send[1] = {1.f}, g_recv[1];

void BM_DirectAllReduce(benchmark::State& state) {
  for (auto _ : state)
    benchmark::DoNotOptimize(g_direct(g_send, g_recv, 1, ncclFloat32, ncclSum, g_comm, nullptr));
}
void BM_ShimAllReduce(benchmark::State& state) {
  for (auto _ : state)
    benchmark::DoNotOptimize(g_shim(g_send, g_recv, 1, ncclFloat32, ncclSum, g_comm, nullptr));
}
BENCHMARK(BM_DirectAllReduce);
BENCHMARK(BM_ShimAllReduce);

}  // namespace

int main(int argc, char** argv) {
  std::string standin, shim;
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--standin") == 0 && i + 1 < argc)
      standin = argv[++i];
    else if (std::strcmp(argv[i], "--shim") == 0 && i + 1 < argc)
      shim = argv[++i];
    else
      argv[kept++] = argv[i];
  }
  argc = kept;
  if (standin.empty() || shim.empty()) {
    std::fprintf(stderr,
                 "usage: magice-bench --standin LIBNCCL --shim LIBMAGICE [benchmark flags]\n");
    return 2;
  }
  // The stand-in goes in RTLD_LOCAL, as PyTorch loads NCCL; the shim then finds it by soname.
  void* nccl = must_open(kTool, standin.c_str(), RTLD_NOW | RTLD_LOCAL);
  void* magice = must_open(kTool, shim.c_str(), RTLD_NOW | RTLD_LOCAL);
  g_direct = must_find<AllReduceFn>(kTool, nccl, "ncclAllReduce");
  g_shim = must_find<AllReduceFn>(kTool, magice, "ncclAllReduce");
  auto get_id = must_find<decltype(&ncclGetUniqueId)>(kTool, nccl, "ncclGetUniqueId");
  auto init = must_find<decltype(&ncclCommInitRank)>(kTool, magice, "ncclCommInitRank");
  auto destroy = must_find<decltype(&ncclCommDestroy)>(kTool, magice, "ncclCommDestroy");
  ncclUniqueId id;
  if (get_id(&id) != ncclSuccess || init(&g_comm, 1, id, 0) != ncclSuccess) {
    std::fprintf(stderr, "magice-bench: could not make a 1-rank communicator\n");
    return 2;
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  destroy(g_comm);
  return 0;
}
