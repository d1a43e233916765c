// NCCL's own copy-engine all-gather against its default path: real NCCL, one process per GPU.
//
//   nccl_ce_allgather -n RANKS --csv FILE [--min-kib 4] [--max-mib 1024] [--reps 5]
//
// The parent forks the ranks before anything touches CUDA; rank 0 publishes the communicators'
// unique ids in a file (written whole, then renamed, as tests/support/bootstrap.cc does) and the
// others wait for it: no MPI, no sockets of our own. Each rank then has three communicators:
//   nccl_ring   default configuration, buffers from cudaMalloc: NCCL's kernels, as PyTorch uses it;
//   nccl_symm   default configuration, buffers from ncclMemAlloc registered as symmetric windows
//               (ncclCommWindowRegister, NCCL_WIN_COLL_SYMMETRIC): NCCL's symmetric kernels;
//   nccl_ce     the same kind of buffers, and config.CTAPolicy = NCCL_CTA_POLICY_ZERO: NCCL moves
//               the data with the copy engines and no SM.
// Per size and repetition the three run in rotating order, each warmed up, then k calls timed by
// CUDA events; the slowest rank's time per call is appended to FILE (rank 0), one row per
// configuration, size and repetition, in the columns of allgather_bw.py.
// Built on the GPU machine: tools/bench/multi/run.sh compiles it with nvcc against NCCL >= 2.28.
#include <cuda_runtime.h>
#include <nccl.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#if !defined(NCCL_CTA_POLICY_ZERO) || !defined(NCCL_WIN_COLL_SYMMETRIC)
#error \
    "this NCCL has no copy-engine collectives (NCCL_CTA_POLICY_ZERO, symmetric windows): 2.28 or later needed"
#endif

namespace {

#define CUDA_OK(call)                                                                          \
  do {                                                                                         \
    cudaError_t e_ = (call);                                                                   \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", g_rank, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
#define NCCL_OK(call)                                                                          \
  do {                                                                                         \
    ncclResult_t r_ = (call);                                                                  \
    if (r_ != ncclSuccess) {                                                                   \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", g_rank, #call, ncclGetErrorString(r_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

int g_rank = -1;
constexpr int kConfigs = 3;
const char* const kNames[kConfigs] = {"nccl_ring", "nccl_symm", "nccl_ce"};
constexpr size_t kSampleBytes = size_t{512} << 20;  // output bytes per timed sample
constexpr int kWarmup = 5;
constexpr auto kIdWait = std::chrono::seconds(120);
constexpr auto kRunLimit = std::chrono::seconds(900);

struct Options {
  int ranks = 1;
  size_t min_kib = 4;
  size_t max_mib = 1024;
  int reps = 5;
  std::string csv;
};

void publish_ids(const std::string& path, const ncclUniqueId* ids) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(ids), sizeof(ncclUniqueId) * kConfigs);
    if (!out) {
      std::fprintf(stderr, "cannot write %s\n", temp.c_str());
      std::exit(1);
    }
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    std::perror("rename");
    std::exit(1);
  }
}

void await_ids(const std::string& path, ncclUniqueId* ids) {
  const auto deadline = std::chrono::steady_clock::now() + kIdWait;
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      if (bytes.size() == sizeof(ncclUniqueId) * kConfigs) {
        std::memcpy(static_cast<void*>(ids), bytes.data(), bytes.size());
        return;
      }
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "rank %d: no unique ids in %s after %lld s\n", g_rank, path.c_str(),
                   static_cast<long long>(kIdWait.count()));
      std::exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

struct Buffers {
  void* send = nullptr;
  void* recv = nullptr;
  ncclWindow_t send_win{};
  ncclWindow_t recv_win{};
  bool windows = false;
};

Buffers make_buffers(int config, ncclComm_t comm, size_t bytes, int ranks) {
  Buffers b;
  if (config == 0) {
    CUDA_OK(cudaMalloc(&b.send, bytes));
    CUDA_OK(cudaMalloc(&b.recv, bytes * ranks));
  } else {
    // Symmetric windows: every rank registers the same sizes in the same order (collective).
    NCCL_OK(ncclMemAlloc(&b.send, bytes));
    NCCL_OK(ncclMemAlloc(&b.recv, bytes * ranks));
    NCCL_OK(ncclCommWindowRegister(comm, b.send, bytes, &b.send_win, NCCL_WIN_COLL_SYMMETRIC));
    NCCL_OK(
        ncclCommWindowRegister(comm, b.recv, bytes * ranks, &b.recv_win, NCCL_WIN_COLL_SYMMETRIC));
    b.windows = true;
  }
  CUDA_OK(cudaMemset(b.send, g_rank + 1, bytes));
  return b;
}

void free_buffers(Buffers& b, ncclComm_t comm) {
  if (b.windows) {
    NCCL_OK(ncclCommWindowDeregister(comm, b.send_win));
    NCCL_OK(ncclCommWindowDeregister(comm, b.recv_win));
    NCCL_OK(ncclMemFree(b.send));
    NCCL_OK(ncclMemFree(b.recv));
  } else {
    CUDA_OK(cudaFree(b.send));
    CUDA_OK(cudaFree(b.recv));
  }
}

// Microseconds per call: k back-to-back all-gathers between two events on the stream.
double time_gathers(const Buffers& b, size_t count, ncclComm_t comm, cudaStream_t stream, int k) {
  cudaEvent_t start, stop;
  CUDA_OK(cudaEventCreate(&start));
  CUDA_OK(cudaEventCreate(&stop));
  for (int i = 0; i < kWarmup; ++i) {
    NCCL_OK(ncclAllGather(b.send, b.recv, count, ncclBfloat16, comm, stream));
  }
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaEventRecord(start, stream));
  for (int i = 0; i < k; ++i) {
    NCCL_OK(ncclAllGather(b.send, b.recv, count, ncclBfloat16, comm, stream));
  }
  CUDA_OK(cudaEventRecord(stop, stream));
  CUDA_OK(cudaEventSynchronize(stop));
  float ms = 0;
  CUDA_OK(cudaEventElapsedTime(&ms, start, stop));
  CUDA_OK(cudaEventDestroy(start));
  CUDA_OK(cudaEventDestroy(stop));
  return ms * 1e3 / k;
}

int run_rank(int rank, const Options& o, const std::string& id_file) {
  g_rank = rank;
  int devices = 0;
  CUDA_OK(cudaGetDeviceCount(&devices));
  CUDA_OK(cudaSetDevice(rank % devices));
  ncclUniqueId ids[kConfigs];
  if (rank == 0) {
    for (ncclUniqueId& id : ids) NCCL_OK(ncclGetUniqueId(&id));
    publish_ids(id_file, ids);
  } else {
    await_ids(id_file, ids);
  }
  ncclComm_t comms[kConfigs];
  for (int c = 0; c < kConfigs; ++c) {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    if (c == 2) config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
    NCCL_OK(ncclCommInitRankConfig(&comms[c], o.ranks, ids[c], rank, &config));
  }
  int version = 0;
  NCCL_OK(ncclGetVersion(&version));
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  std::vector<size_t> sizes;
  for (size_t bytes = o.min_kib << 10; bytes <= o.max_mib << 20; bytes *= 4) sizes.push_back(bytes);
  // times[(size * reps + rep) * kConfigs + config], reduced to the slowest rank below.
  std::vector<double> times(sizes.size() * o.reps * kConfigs, 0.0);
  for (size_t s = 0; s < sizes.size(); ++s) {
    const size_t bytes = sizes[s];
    const size_t count = bytes / 2;
    const int k = static_cast<int>(
        std::clamp<size_t>(kSampleBytes / (bytes * o.ranks), size_t{5}, size_t{200}));
    Buffers buffers[kConfigs];
    for (int c = 0; c < kConfigs; ++c) buffers[c] = make_buffers(c, comms[c], bytes, o.ranks);
    for (int rep = 0; rep < o.reps; ++rep) {
      for (int i = 0; i < kConfigs; ++i) {
        const int c = (rep + i) % kConfigs;  // rotate which goes first
        times[(s * o.reps + rep) * kConfigs + c] =
            time_gathers(buffers[c], count, comms[c], stream, k);
      }
    }
    for (int c = 0; c < kConfigs; ++c) free_buffers(buffers[c], comms[c]);
  }

  double* dev = nullptr;
  CUDA_OK(cudaMalloc(&dev, times.size() * sizeof(double)));
  CUDA_OK(cudaMemcpy(dev, times.data(), times.size() * sizeof(double), cudaMemcpyHostToDevice));
  NCCL_OK(ncclAllReduce(dev, dev, times.size(), ncclFloat64, ncclMax, comms[0], stream));
  CUDA_OK(cudaStreamSynchronize(stream));
  CUDA_OK(cudaMemcpy(times.data(), dev, times.size() * sizeof(double), cudaMemcpyDeviceToHost));
  CUDA_OK(cudaFree(dev));

  if (rank == 0) {
    struct stat st {};
    const bool fresh = ::stat(o.csv.c_str(), &st) != 0 || st.st_size == 0;
    FILE* out = std::fopen(o.csv.c_str(), "a");
    if (out == nullptr) {
      std::perror(o.csv.c_str());
      return 1;
    }
    if (fresh) {
      std::fprintf(out,
                   "bench,config,rep,world,bytes_per_rank,time_us,algbw_GBps,busbw_GBps,status\n");
    }
    std::printf("nccl_ce_allgather: NCCL %d, %d rank(s); time per call (median of %d reps), us:\n",
                version, o.ranks, o.reps);
    for (size_t s = 0; s < sizes.size(); ++s) {
      std::printf("  %8zu KiB", sizes[s] >> 10);
      for (int c = 0; c < kConfigs; ++c) {
        std::vector<double> reps;
        for (int rep = 0; rep < o.reps; ++rep) {
          const double t = times[(s * o.reps + rep) * kConfigs + c];
          reps.push_back(t);
          std::fprintf(out, "allgather_bw,%s,%d,%d,%zu,%.3f,%.3f,%.3f,ok\n", kNames[c], rep + 1,
                       o.ranks, sizes[s], t, sizes[s] * o.ranks / t / 1e3,
                       sizes[s] * (o.ranks - 1) / t / 1e3);
        }
        std::nth_element(reps.begin(), reps.begin() + reps.size() / 2, reps.end());
        std::printf("  %s %10.1f", kNames[c], reps[reps.size() / 2]);
      }
      std::printf("\n");
    }
    std::fclose(out);
  }
  for (ncclComm_t comm : comms) NCCL_OK(ncclCommDestroy(comm));
  return 0;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "-n")
      o.ranks = std::stoi(value());
    else if (a == "--csv")
      o.csv = value();
    else if (a == "--min-kib")
      o.min_kib = std::stoul(value());
    else if (a == "--max-mib")
      o.max_mib = std::stoul(value());
    else if (a == "--reps")
      o.reps = std::stoi(value());
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      std::exit(2);
    }
  }
  if (o.ranks < 1 || o.reps < 1 || o.csv.empty()) {
    std::fprintf(
        stderr,
        "usage: nccl_ce_allgather -n RANKS --csv FILE [--min-kib K] [--max-mib M] [--reps R]\n");
    std::exit(2);
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  char dir[] = "/tmp/nccl_ce.XXXXXX";
  if (::mkdtemp(dir) == nullptr) {
    std::perror("mkdtemp");
    return 1;
  }
  const std::string id_file = std::string(dir) + "/ids";
  std::vector<pid_t> children;
  for (int r = 0; r < o.ranks; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int rc = run_rank(r, o, id_file);
      std::fflush(nullptr);  // _Exit flushes nothing, and the table went to stdout
      std::_Exit(rc);
    }
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    children.push_back(pid);
  }
  // A rank that fails or hangs must end the run, not stall it: the others are killed then.
  const auto deadline = std::chrono::steady_clock::now() + kRunLimit;
  int failed = 0;
  size_t left = children.size();
  while (left > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      --left;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        ++failed;
        for (pid_t c : children) ::kill(c, SIGKILL);
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "nccl_ce_allgather: ranks still running after %lld s: killed\n",
                   static_cast<long long>(kRunLimit.count()));
      for (pid_t c : children) ::kill(c, SIGKILL);
      failed = 1;
      while (::waitpid(-1, nullptr, 0) > 0) {}
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::unlink(id_file.c_str());
  ::rmdir(dir);
  return failed == 0 ? 0 : 1;
}
