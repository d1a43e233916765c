// magi-transport-faults: the CUDA transport (ce_transport/cuda_memory_ops.cc) under faults, on one
// GPU, each case in processes of its own forked before any CUDA call. Run by tests/gpu/run.sh;
// prints PASS/FAIL lines and "transport-faults: N passed, M failed", exits 1 on any failure.
//
//  1. A static shard freed before binding: prepare refuses it, the context stays usable (a copy
//     from unmapped memory would have broken it for good).
//  2. A peer that hangs, alive: this rank's stream waits for it; abandon() from another thread
//     (an abort) lets the stream drain, release() does not wait, the context stays usable.
//  3. A peer that died without gathering: release() notices at once (no abort needed), the
//     stream drains, the context stays usable.
//  4. Static weights whose shard changes anyway: no check on calls the cost trial times; a
//     check never waits for the program's stream (a gather returns while the stream is held);
//     the change is found at a later call once the check's copies have run.
//  5. MAGI_INJECT_FAULT=gather:1: rank 1's gather throws before it queues anything, as a real
//     CUDA error at the bucket's first step would; rank 0's stream waits for it (its peers cannot
//     learn of it within the bucket: ce_transport.h) until abandon() frees it.
//  6. Static weights, a 256 MiB shard: a check copies sampled lines, at most 128 KiB of the shard
//     (and as much of the binding), never the shard; a rewrite of one anchor line is found at the
//     next check, one of a line between anchors within stride / 256 checks (sample_plan.h).
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "base/base.h"
#include "ce_transport/backends.h"
#include "ce_transport/ce_transport.h"
#include "ce_transport/sample_plan.h"

namespace {

using magi::ce::Backend;
using magi::ce::GatherOp;
using magi::ce::HandleBlob;
using magi::ce::WindowPlan;
using Clock = std::chrono::steady_clock;

constexpr int kMaxRanks = 2;
constexpr size_t kShard = size_t{1} << 20;

struct Shared {
  std::atomic<int> attached{0};
  std::atomic<int> finished{0};  // ranks done with the case's checks
  HandleBlob blobs[kMaxRanks];
};

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

// True once `done` holds, polled until `seconds` pass.
bool within(double seconds, const std::function<bool()>& done) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

bool stream_idle(cudaStream_t stream) {
  const cudaError_t e = cudaStreamQuery(stream);
  if (e == cudaErrorNotReady) return false;
  check(e, "cudaStreamQuery");
  return true;
}

// The context still takes work and reports no error: nothing the transport did broke it.
void expect_usable_context() {
  void* p = nullptr;
  check(cudaMalloc(&p, 4096), "cudaMalloc after the fault");
  check(cudaMemset(p, 1, 4096), "cudaMemset after the fault");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize after the fault");
  check(cudaFree(p), "cudaFree after the fault");
  check(cudaGetLastError(), "the runtime's last error");
}

// Runs body(rank) in `nranks` forked processes; true if every one exits 0 within `seconds`.
bool run_ranks(int nranks, double seconds, Shared& shared,
               const std::function<void(int, Shared&)>& body) {
  std::vector<pid_t> pids;
  std::fflush(nullptr);
  for (int r = 0; r < nranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      int status = 0;
      try {
        body(r, shared);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "  rank %d: %s\n", r, e.what());
        status = 1;
      }
      std::fflush(nullptr);
      _exit(status);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  const auto deadline = Clock::now() + std::chrono::duration<double>(seconds);
  for (size_t r = 0; r < pids.size(); ++r) {
    int status = 0;
    while (waitpid(pids[r], &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        std::fprintf(stderr, "  rank %zu: still running after %.0f s; killed\n", r, seconds);
        kill(pids[r], SIGKILL);
        waitpid(pids[r], &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ok = false;
  }
  return ok;
}

// Both ranks make and open default-mode windows; returns this rank's transport.
std::unique_ptr<magi::ce::Transport> attached_pair(int rank, Shared& shared, uint64_t identity,
                                                   const magi::Options::Fault& fault = {}) {
  check(cudaSetDevice(0), "cudaSetDevice");
  auto transport = magi::ce::make_cuda_transport(rank, kMaxRanks, identity, 0, fault);
  WindowPlan plan;
  plan.slot_bytes = kShard;
  transport->prepare(plan, shared.blobs[rank]);
  shared.attached.fetch_add(1);
  if (!within(30, [&] { return shared.attached.load() >= kMaxRanks; }))
    throw std::runtime_error("the peer never published its window");
  transport->attach(std::span<const HandleBlob>(shared.blobs, kMaxRanks));
  return transport;
}

// Rank 0's side of cases 2 and 3: one gather its peer never joins; `end` must free the stream.
void gather_alone(magi::ce::Transport& transport, const char* how,
                  const std::function<void()>& end) {
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  void *send = nullptr, *recv = nullptr;
  check(cudaMalloc(&send, kShard), "cudaMalloc");
  check(cudaMalloc(&recv, kMaxRanks * kShard), "cudaMalloc");
  const GatherOp op{send, recv, kShard, 0};
  transport.gather(std::span<const GatherOp>(&op, 1), stream);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  if (stream_idle(stream)) throw std::runtime_error("the gather finished without its peer");
  const auto started = Clock::now();
  end();
  if (!within(5, [&] { return stream_idle(stream); }))
    throw std::runtime_error(std::string("the stream still waits 5 s after ") + how);
  const double took = std::chrono::duration<double>(Clock::now() - started).count();
  if (took > 3) throw std::runtime_error(std::string(how) + " took " + std::to_string(took) + " s");
  std::fprintf(stderr, "  rank 0: stream free %.0f ms after %s\n", took * 1e3, how);
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  expect_usable_context();
}

void freed_shard_is_refused(int /*rank*/, Shared& /*shared*/) {
  check(cudaSetDevice(0), "cudaSetDevice");
  void* shard = nullptr;
  check(cudaMalloc(&shard, 64 * kShard), "cudaMalloc");
  check(cudaFree(shard), "cudaFree");  // the program frees it between the round and the binding
  auto transport = magi::ce::make_transport(Backend::Cuda, 0, 1, 1, 0);
  WindowPlan plan;
  plan.slot_bytes = kShard;
  plan.bound = true;
  plan.bind = {{shard, kShard, 0}};
  HandleBlob blob;
  bool refused = false;
  try {
    transport->prepare(plan, blob);
  } catch (const magi::Error& e) {
    refused = true;
    std::fprintf(stderr, "  refused: %s\n", e.what());
  }
  transport->release();
  if (!refused) throw std::runtime_error("prepare bound a shard whose memory was freed");
  expect_usable_context();
}

void hung_peer_then_abandon(int rank, Shared& shared) {
  auto transport = attached_pair(rank, shared, 2);
  if (rank == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(12));  // hung, alive, never gathers
    return;
  }
  gather_alone(*transport, "abandon() from another thread",
               [&] { std::thread([&] { transport->abandon(); }).join(); });
  const auto started = Clock::now();
  transport->release();
  const double took = std::chrono::duration<double>(Clock::now() - started).count();
  if (took > 2)
    throw std::runtime_error("release() after abandon() waited " + std::to_string(took) + " s");
}

void dead_peer_then_release(int rank, Shared& shared) {
  auto transport = attached_pair(rank, shared, 3);
  if (rank == 1) {
    std::fflush(nullptr);
    _exit(0);  // gone without a gather or a release, as if killed
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  gather_alone(*transport, "release() with the peer dead", [&] { transport->release(); });
}

// Holds a stream until *release becomes true (a host function: the stream waits for it).
void CUDART_CB hold_stream(void* release) {
  while (!static_cast<std::atomic<bool>*>(release)->load())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void changed_static_shard_is_found_without_waiting(int /*rank*/, Shared& /*shared*/) {
  using magi::ce::Transport;
  check(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  void *shard = nullptr, *recv = nullptr;
  check(cudaMalloc(&shard, kShard), "cudaMalloc");
  check(cudaMalloc(&recv, kShard), "cudaMalloc");
  check(cudaMemset(shard, 7, kShard), "cudaMemset");
  auto transport = magi::ce::make_transport(Backend::Cuda, 0, 1, 4, 0);
  WindowPlan plan;
  plan.slot_bytes = kShard;
  plan.bound = true;
  plan.bind = {{shard, kShard, 0}};
  plan.verify_first = 1;
  plan.verify_every = 0;
  HandleBlob blob;
  transport->prepare(plan, blob);
  transport->attach(std::span<const HandleBlob>(&blob, 1));
  const GatherOp op{shard, recv, kShard, 0};
  const std::span<const GatherOp> bucket(&op, 1);
  auto stale_after = [&](Transport::Timing timing) {
    transport->gather(bucket, stream, timing);
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return transport->take_stale_bindings().size();
  };
  check(cudaMemset(shard, 9, kShard), "cudaMemset");  // the promise broken before the first call
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // the legacy stream's memset, done
  // Calls 1 and 2 are timed: the check due on call 1 must wait for an untimed call.
  if (stale_after(Transport::Timing::Timed) != 0 || stale_after(Transport::Timing::Timed) != 0)
    throw std::runtime_error("a timed call checked its binding");
  // Call 3, untimed, starts the check while the program's stream is held: it must not wait.
  std::atomic<bool> release{false};
  check(cudaLaunchHostFunc(stream, hold_stream, &release), "cudaLaunchHostFunc");
  const auto started = Clock::now();
  transport->gather(bucket, stream);
  const double took = std::chrono::duration<double>(Clock::now() - started).count();
  const bool held = !stream_idle(stream);
  release.store(true);
  check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  if (!held || took > 0.5)
    throw std::runtime_error("a gather that checks its binding waited " + std::to_string(took) +
                             " s for the stream");
  if (!transport->take_stale_bindings().empty())
    throw std::runtime_error("the check compared before its copies ran");
  // Call 4 compares (the copies have run): the change is found, once, and re-bound.
  if (stale_after(Transport::Timing::Untimed) != 1)
    throw std::runtime_error("the changed shard was not found");
  if (stale_after(Transport::Timing::Untimed) != 0)
    throw std::runtime_error("the change was reported twice");
  std::fprintf(stderr, "  a gather that started a check returned in %.2f ms with the stream held\n",
               took * 1e3);
  transport->release();
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  expect_usable_context();
}

void sampled_check_of_a_large_shard(int /*rank*/, Shared& /*shared*/) {
  using magi::ce::SamplePlan;
  constexpr size_t kLarge = size_t{256} << 20;
  check(cudaSetDevice(0), "cudaSetDevice");
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  void* shard = nullptr;
  check(cudaMalloc(&shard, kLarge), "cudaMalloc");
  check(cudaMemset(shard, 7, kLarge), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  auto transport = magi::ce::make_transport(Backend::Cuda, 0, 1, 6, 0);
  WindowPlan plan;
  plan.slot_bytes = kLarge;
  plan.bound = true;
  plan.bind = {{shard, kLarge, 0}};
  plan.verify_first = 1;
  plan.verify_every = 1;  // a check on every call: each compares the one before
  HandleBlob blob;
  transport->prepare(plan, blob);
  transport->attach(std::span<const HandleBlob>(&blob, 1));
  const GatherOp op{shard, shard, kLarge, 0};  // in place: the call itself copies nothing
  const std::span<const GatherOp> bucket(&op, 1);
  uint64_t calls = 0;
  // One call; whether it found the shard changed. Each call's check copies at most two sets.
  auto found = [&] {
    const uint64_t before = transport->checked_bytes();
    transport->gather(bucket, stream);
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    ++calls;
    const uint64_t copied = transport->checked_bytes() - before;
    if (copied == 0 || copied > 2 * SamplePlan::kMaxSetBytes)
      throw std::runtime_error("call " + std::to_string(calls) + " checked " +
                               std::to_string(copied) + " bytes of a 256 MiB shard");
    return !transport->take_stale_bindings().empty();
  };
  // Calls until a change made now is found, at most `limit`.
  auto calls_to_find = [&](uint64_t limit) {
    for (uint64_t n = 1; n <= limit; ++n)
      if (found()) return n;
    return limit + 1;
  };
  for (int i = 0; i < 5; ++i)
    if (found()) throw std::runtime_error("an unchanged shard was reported");
  const SamplePlan lines(kLarge);
  const uint64_t p = lines.sweep_period();
  auto* bytes = static_cast<uint8_t*>(shard);
  // An anchor line: the next check copies it, the call after compares.
  check(cudaMemset(bytes + 37 * lines.stride(), 9, SamplePlan::kLine), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const uint64_t anchor_calls = calls_to_find(2);
  if (anchor_calls > 2) throw std::runtime_error("a rewritten anchor line was not found");
  // A line between anchors: within P checks, and one call more to compare the last.
  check(cudaMemset(bytes + 100 * lines.stride() + 12345, 11, SamplePlan::kLine), "cudaMemset");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const uint64_t sweep_calls = calls_to_find(p + 1);
  if (sweep_calls > p + 1)
    throw std::runtime_error("a rewritten line was not found within " + std::to_string(p + 1) +
                             " calls");
  for (int i = 0; i < 5; ++i)
    if (found()) throw std::runtime_error("a re-bound shard was reported again");
  std::fprintf(stderr,
               "  256 MiB shard: %.1f KiB checked a call; an anchor line found after %llu "
               "call(s), a line between anchors after %llu (bound %llu)\n",
               static_cast<double>(transport->checked_bytes()) / static_cast<double>(calls) / 1024,
               static_cast<unsigned long long>(anchor_calls),
               static_cast<unsigned long long>(sweep_calls),
               static_cast<unsigned long long>(p + 1));
  transport->release();
  check(cudaFree(shard), "cudaFree");
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  expect_usable_context();
}

void gather_fault_throws_before_queuing(int rank, Shared& shared) {
  auto transport = attached_pair(rank, shared, 5, {magi::Options::Fault::Where::Gather, 1});
  if (rank == 0) {
    gather_alone(*transport, "abandon() with rank 1's gather failed",
                 [&] { transport->abandon(); });
    transport->release();
    shared.finished.fetch_add(1);
    return;
  }
  cudaStream_t stream = nullptr;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  void *send = nullptr, *recv = nullptr;
  check(cudaMalloc(&send, kShard), "cudaMalloc");
  check(cudaMalloc(&recv, kMaxRanks * kShard), "cudaMalloc");
  check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  const GatherOp op{send, recv, kShard, 0};
  std::string error;
  try {
    transport->gather(std::span<const GatherOp>(&op, 1), stream);
  } catch (const magi::Error& e) {
    if (e.kind() == magi::ErrorKind::Cuda) error = e.what();
  }
  if (error.find("injected by MAGI_INJECT_FAULT") == std::string::npos)
    throw std::runtime_error("gather:1 did not make rank 1's gather throw a CUDA error");
  if (!stream_idle(stream)) throw std::runtime_error("rank 1 queued work for the bucket it failed");
  std::fprintf(stderr, "  rank 1: %s\n", error.c_str());
  expect_usable_context();
  // Alive until rank 0 is done: a dead peer would free its stream for another reason.
  if (!within(30, [&] { return shared.finished.load() >= 1; }))
    throw std::runtime_error("rank 0 never finished");
  transport->abandon();  // the program's answer to a failed call: abort the communicator
  transport->release();
  check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  expect_usable_context();
}

}  // namespace

int main() {
  struct Case {
    const char* name;
    int ranks;
    void (*body)(int, Shared&);
  };
  const Case cases[] = {
      {"a static shard freed before binding is refused; the context stays usable", 1,
       freed_shard_is_refused},
      {"a hung peer: abandon() frees the waiting stream, release() does not wait", 2,
       hung_peer_then_abandon},
      {"a dead peer: release() frees the waiting stream at once", 2, dead_peer_then_release},
      {"a changed static shard: not checked on timed calls, found later without waiting for the "
       "stream",
       1, changed_static_shard_is_found_without_waiting},
      {"gather:1: rank 1 throws before queuing anything; rank 0's stream waits until abandon()", 2,
       gather_fault_throws_before_queuing},
      {"a 256 MiB static shard: a check copies sampled lines; a rewritten line is found within "
       "the bound",
       1, sampled_check_of_a_large_shard},
  };
  int passed = 0, failed = 0;
  for (const Case& c : cases) {
    void* area =
        mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (area == MAP_FAILED) return 2;
    Shared* shared = ::new (area) Shared{};
    const bool ok = run_ranks(c.ranks, 60, *shared, c.body);
    munmap(area, sizeof(Shared));
    std::printf("%s transport-faults: %s\n", ok ? "PASS" : "FAIL", c.name);
    std::fflush(stdout);
    (ok ? passed : failed)++;
  }
  std::printf("transport-faults: %d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
