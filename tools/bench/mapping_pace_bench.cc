// What a static-weights set-up costs the program beside it: N processes on one GPU, each holding
// A cudaMalloc allocations of S MiB exported by CUDA IPC, each opening every peer's A handles
// (the reader's half of the set-up, (N-1) x A mappings a rank) on a thread of its own while a
// program thread beside it keeps issuing small CUDA calls, as a program's step would. It tells
// how long the mappings take under each way of pacing them, and how long the program's calls
// wait meanwhile:
//   --pause none       mappings back to back
//   --pause ratio:F    after each mapping, a pause F times as long as the mapping took
//                      (the set-up's pacing is ratio:1 clamped to 20 us .. 1 ms)
//   --pause fixed:US   after each mapping, a pause of US microseconds
//   --threads T        the mappings split over T threads (each paced alike)
//   --gate 1           no mapping starts while the program thread is inside a call (up to 5 ms)
//   --concurrent K     at most K mappings in progress at once over all ranks (0: no limit)
// The program thread: every 50 us a 4-byte cudaMemsetAsync and a cudaEventRecord on its stream
// (a kernel launch and a record, as an NCCL call makes), each pair timed on the host, and a
// stream synchronize every 64th, timed apart (it waits for the GPU as well). It runs 200 ms before
// the mappings start (the baseline), during them, and 100 ms after.
//
//   magice-mapping-pace [--ranks 8] [--allocations 500] [--mib 2] [--pause ratio:1] [--threads 1]
//
// Prints one line per rank on stderr and a summary line on stdout: the slowest rank's mapping
// time, per mapping and per GiB mapped, and the program calls' slowest and 99th-percentile wait
// during the mappings against the baseline's. Ranks are forked before any CUDA call.
#include <cuda_runtime_api.h>
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
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Config {
  int ranks = 8;
  int allocations = 500;
  int mib = 2;
  std::string pause = "ratio:1";
  int threads = 1;
  int gate = 0;
  int concurrent = 0;
};

// What each rank reports through the shared segment.
struct RankResult {
  double mapping_s = 0;
  double wait_max_us = 0, wait_p99_us = 0;       // program calls during the mappings
  double base_max_us = 0, base_p99_us = 0;       // program calls before them
  double sync_max_us = 0, sync_base_max_us = 0;  // its stream synchronizes, during and before
};

struct Shared {
  std::atomic<int> exported;
  std::atomic<int> mapped;
  std::atomic<int> mapping_now;  // --concurrent K: mappings in progress on the GPU, all ranks
  RankResult results[64];
  // then ranks x allocations handles
};

cudaIpcMemHandle_t* handles_of(Shared* shared) {
  return reinterpret_cast<cudaIpcMemHandle_t*>(shared + 1);
}

void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  std::fprintf(stderr, "mapping-pace: %s: %s\n", what, cudaGetErrorString(e));
  std::_Exit(2);
}

Clock::duration pause_after(const std::string& pause, Clock::duration took) {
  if (pause == "none") return Clock::duration::zero();
  if (pause.rfind("ratio:", 0) == 0) {
    const double f = std::atof(pause.c_str() + 6);
    return std::chrono::duration_cast<Clock::duration>(took * f);
  }
  if (pause.rfind("fixed:", 0) == 0) return std::chrono::microseconds(std::atoi(pause.c_str() + 6));
  std::fprintf(stderr, "mapping-pace: --pause takes none, ratio:F or fixed:US, not %s\n",
               pause.c_str());
  std::_Exit(2);
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

int run_rank(const Config& config, int rank, Shared* shared) {
  check(cudaSetDevice(0), "cudaSetDevice");
  const size_t bytes = static_cast<size_t>(config.mib) << 20;
  std::vector<void*> mine(static_cast<size_t>(config.allocations));
  cudaIpcMemHandle_t* handles = handles_of(shared);
  for (int a = 0; a < config.allocations; ++a) {
    check(cudaMalloc(&mine[static_cast<size_t>(a)], bytes), "cudaMalloc");
    check(
        cudaIpcGetMemHandle(&handles[rank * config.allocations + a], mine[static_cast<size_t>(a)]),
        "cudaIpcGetMemHandle");
  }
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  shared->exported.fetch_add(1);
  while (shared->exported.load() < config.ranks)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));

  // The program thread.
  cudaStream_t stream;
  cudaEvent_t event;
  void* word;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "cudaEventCreate");
  check(cudaMalloc(&word, 4), "cudaMalloc");
  enum Phase { Before, During, After, Stop };
  std::atomic<int> phase{Before};
  std::atomic<bool> in_call{false};  // --gate 1: no mapping starts while the program is in a call
  std::vector<double> before_us, during_us;
  std::vector<double> sync_before_us, sync_during_us;
  std::thread program([&] {
    for (uint64_t i = 0; phase.load() != Stop; ++i) {
      const int now = phase.load();
      in_call.store(true);
      const auto t0 = Clock::now();
      check(cudaMemsetAsync(word, static_cast<int>(i), 4, stream), "cudaMemsetAsync");
      check(cudaEventRecord(event, stream), "cudaEventRecord");
      const auto t1 = Clock::now();
      in_call.store(false);
      const double us = std::chrono::duration<double, std::micro>(t1 - t0).count();
      if (now == Before)
        before_us.push_back(us);
      else if (now == During)
        during_us.push_back(us);
      if (i % 64 == 63) {
        // Timed apart: a synchronize also waits for the GPU, not only for the driver.
        check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        const double sync_us = std::chrono::duration<double, std::micro>(Clock::now() - t1).count();
        if (now == Before)
          sync_before_us.push_back(sync_us);
        else if (now == During)
          sync_during_us.push_back(sync_us);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));

  // The mappings: every peer's allocations, split over the threads.
  std::vector<std::pair<int, int>> work;
  for (int p = 1; p < config.ranks; ++p)
    for (int a = 0; a < config.allocations; ++a) work.emplace_back((rank + p) % config.ranks, a);
  std::vector<void*> mapped(work.size(), nullptr);
  phase.store(During);
  const auto began = Clock::now();
  std::vector<std::thread> mappers;
  for (int t = 0; t < config.threads; ++t)
    mappers.emplace_back([&, t] {
      for (size_t w = static_cast<size_t>(t); w < work.size();
           w += static_cast<size_t>(config.threads)) {
        if (config.gate)
          for (int spins = 0; in_call.load() && spins < 1000; ++spins)
            std::this_thread::sleep_for(std::chrono::microseconds(5));
        if (config.concurrent > 0)
          for (int now = shared->mapping_now.load();;) {
            if (now < config.concurrent && shared->mapping_now.compare_exchange_weak(now, now + 1))
              break;
            std::this_thread::sleep_for(std::chrono::microseconds(5));
            now = shared->mapping_now.load();
          }
        const auto t0 = Clock::now();
        check(cudaIpcOpenMemHandle(&mapped[w],
                                   handles[work[w].first * config.allocations + work[w].second],
                                   cudaIpcMemLazyEnablePeerAccess),
              "cudaIpcOpenMemHandle");
        const auto took = Clock::now() - t0;
        if (config.concurrent > 0) shared->mapping_now.fetch_sub(1);
        const auto pause = pause_after(config.pause, took);
        if (pause > Clock::duration::zero()) std::this_thread::sleep_for(pause);
      }
    });
  for (auto& m : mappers) m.join();
  const double mapping_s = std::chrono::duration<double>(Clock::now() - began).count();
  phase.store(After);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  phase.store(Stop);
  program.join();

  RankResult& result = shared->results[rank];
  result.mapping_s = mapping_s;
  result.wait_max_us =
      during_us.empty() ? 0 : *std::max_element(during_us.begin(), during_us.end());
  result.wait_p99_us = percentile(during_us, 0.99);
  result.base_max_us =
      before_us.empty() ? 0 : *std::max_element(before_us.begin(), before_us.end());
  result.base_p99_us = percentile(before_us, 0.99);
  result.sync_max_us =
      sync_during_us.empty() ? 0 : *std::max_element(sync_during_us.begin(), sync_during_us.end());
  result.sync_base_max_us =
      sync_before_us.empty() ? 0 : *std::max_element(sync_before_us.begin(), sync_before_us.end());
  std::fprintf(
      stderr,
      "rank %d: %zu mappings in %.3f s; program calls during: %zu, max %.0f us, p99 %.0f us; "
      "before: max %.0f us, p99 %.0f us\n",
      rank, work.size(), mapping_s, during_us.size(), result.wait_max_us, result.wait_p99_us,
      result.base_max_us, result.base_p99_us);
  shared->mapped.fetch_add(1);
  while (shared->mapped.load() < config.ranks)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  for (void* m : mapped) cudaIpcCloseMemHandle(m);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Config config;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--ranks")
      config.ranks = std::atoi(value.c_str());
    else if (flag == "--allocations")
      config.allocations = std::atoi(value.c_str());
    else if (flag == "--mib")
      config.mib = std::atoi(value.c_str());
    else if (flag == "--pause")
      config.pause = value;
    else if (flag == "--threads")
      config.threads = std::atoi(value.c_str());
    else if (flag == "--gate")
      config.gate = std::atoi(value.c_str());
    else if (flag == "--concurrent")
      config.concurrent = std::atoi(value.c_str());
    else {
      std::fprintf(stderr,
                   "usage: magice-mapping-pace [--ranks 8] [--allocations 500] [--mib 2] "
                   "[--pause none|ratio:F|fixed:US] [--threads 1] [--gate 0] [--concurrent 0]\n");
      return 2;
    }
  }
  if (config.ranks < 2 || config.ranks > 64 || config.allocations < 1 || config.mib < 1 ||
      config.threads < 1) {
    std::fprintf(stderr,
                 "mapping-pace: 2..64 ranks, and at least one allocation, MiB and thread\n");
    return 2;
  }
  pause_after(config.pause, Clock::duration::zero());  // validates before any fork
  const size_t segment = sizeof(Shared) + sizeof(cudaIpcMemHandle_t) *
                                              static_cast<size_t>(config.ranks) *
                                              static_cast<size_t>(config.allocations);
  void* memory = mmap(nullptr, segment, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (memory == MAP_FAILED) return 2;
  auto* shared = new (memory) Shared{};
  std::vector<pid_t> children;
  for (int r = 0; r < config.ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) std::_Exit(run_rank(config, r, shared));
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  if (failed) {
    std::fprintf(stderr, "mapping-pace: %d rank(s) failed\n", failed);
    return 1;
  }
  double mapping_s = 0, wait_max = 0, wait_p99 = 0, base_max = 0, base_p99 = 0, sync_max = 0,
         sync_base_max = 0;
  for (int r = 0; r < config.ranks; ++r) {
    const RankResult& result = shared->results[r];
    mapping_s = std::max(mapping_s, result.mapping_s);
    wait_max = std::max(wait_max, result.wait_max_us);
    wait_p99 = std::max(wait_p99, result.wait_p99_us);
    base_max = std::max(base_max, result.base_max_us);
    base_p99 = std::max(base_p99, result.base_p99_us);
    sync_max = std::max(sync_max, result.sync_max_us);
    sync_base_max = std::max(sync_base_max, result.sync_base_max_us);
  }
  const double mappings = static_cast<double>(config.ranks - 1) * config.allocations;
  const double gib_mapped = mappings * config.mib / 1024.0;
  std::printf(
      "ranks %d, %d x %d MiB, pause %s, threads %d%s%s: %.3f s (%.0f us a mapping, %.3f s per GiB "
      "mapped); "
      "program calls during: max %.0f us, p99 %.0f us, sync max %.0f us; before: max %.0f us, p99 "
      "%.0f us, "
      "sync max %.0f us\n",
      config.ranks, config.allocations, config.mib, config.pause.c_str(), config.threads,
      config.gate ? ", gated" : "",
      config.concurrent ? (", at most " + std::to_string(config.concurrent) + " at once").c_str()
                        : "",
      mapping_s, mapping_s / mappings * 1e6, mapping_s / gib_mapped, wait_max, wait_p99, sync_max,
      base_max, base_p99, sync_base_max);
  return 0;
}
