// Several threads of one process calling NCCL at once, each on a communicator of its own, with
// tracing on: the trace still holds every call of every thread, in each communicator's order,
// also while the threads make and end communicators, and every record it has no room for is
// counted.
// This is the test `make test-tsan` exists for: the call path, the communicator registry and the
// trace writer's buffers and thread are all shared between the callers.
//
// The calling process is a child (this program again, only ThreadedCallsChild selected), so the
// library starts with a fresh environment and writes its trace out at exit as in a real program.
// The child opens the NCCL stand-in and build/libmagice.so with dlopen, RTLD_LOCAL, and calls the
// shim's exported entry points (ncclGetUniqueId, which the shim leaves alone, the stand-in's); the
// shim finds the stand-in already loaded and forwards to it.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <limits.h>
#include <nccl.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <latch>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "capture/trace_reader.h"
#include "tests/support/launch.h"

namespace magi {
namespace {

namespace fs = std::filesystem;

constexpr const char* kChildVariable = "THREADED_CALLS_CHILD";  // "independent", "clique", "churn"
constexpr int kThreads = 4;
constexpr int kSteps = 150;
constexpr int kChurnRounds = 20;  // "churn": communicators made, used for kChurnSteps, and ended
constexpr int kChurnSteps = 30;

// One step, issued kSteps times by every thread: five collectives of distinct shapes, the last
// inside a group, so the step detector of each communicator finds a period of five.
constexpr trace::Op kStep[] = {trace::Op::AllReduce, trace::Op::AllGather, trace::Op::Broadcast,
                               trace::Op::ReduceScatter, trace::Op::AllReduce};
constexpr int kStepCalls = static_cast<int>(std::size(kStep));
constexpr int kCallsPerThread = kSteps * kStepCalls;

std::string build_dir() {
  const char* dir = std::getenv("TEST_BUILD_DIR");
  return dir ? dir : fs::absolute("build").string();
}

std::string self_path() {
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  return n > 0 ? std::string(path, static_cast<size_t>(n)) : std::string();
}

// ---- the child ---------------------------------------------------------------------------------

// The entry points a program linked against NCCL reaches with the shim preloaded.
struct NcclEntryPoints {
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) init_rank = nullptr;
  decltype(&ncclCommInitAll) init_all = nullptr;
  decltype(&ncclCommDestroy) destroy = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
};

template <class Function>
void bind(void* library, const char* name, Function& out) {
  out = reinterpret_cast<Function>(dlsym(library, name));
  ASSERT_NE(out, nullptr) << name << ": " << dlerror();
}

void bind_all(void* standin, void* shim, NcclEntryPoints& nccl) {
  bind(standin, "ncclGetUniqueId", nccl.get_unique_id);
  bind(shim, "ncclCommInitRank", nccl.init_rank);
  bind(shim, "ncclCommInitAll", nccl.init_all);
  bind(shim, "ncclCommDestroy", nccl.destroy);
  bind(shim, "ncclGroupStart", nccl.group_start);
  bind(shim, "ncclGroupEnd", nccl.group_end);
  bind(shim, "ncclAllReduce", nccl.all_reduce);
  bind(shim, "ncclAllGather", nccl.all_gather);
  bind(shim, "ncclBroadcast", nccl.broadcast);
  bind(shim, "ncclReduceScatter", nccl.reduce_scatter);
}

// Issues `steps` steps on `comm`; the first failing call's result, else ncclSuccess.
ncclResult_t drive(const NcclEntryPoints& nccl, ncclComm_t comm, int steps) {
  constexpr size_t kCount = 256;
  std::vector<float> send(kCount * kThreads, 1.0f), recv(kCount * kThreads, 0.0f);
  for (int step = 0; step < steps; ++step) {
    ncclResult_t results[] = {
        nccl.all_reduce(send.data(), recv.data(), kCount, ncclFloat32, ncclSum, comm, nullptr),
        nccl.all_gather(send.data(), recv.data(), kCount / 2, ncclFloat32, comm, nullptr),
        nccl.broadcast(send.data(), recv.data(), kCount / 4, ncclFloat32, 0, comm, nullptr),
        nccl.reduce_scatter(send.data(), recv.data(), kCount / 8, ncclFloat32, ncclMax, comm,
                            nullptr),
        nccl.group_start(),
        nccl.all_reduce(send.data(), recv.data(), kCount / 16, ncclFloat32, ncclSum, comm, nullptr),
        nccl.group_end(),
    };
    for (ncclResult_t r : results)
      if (r != ncclSuccess) return r;
  }
  return ncclSuccess;
}

// Runs only as the child of the tests below (they select it); a no-op anywhere else.
TEST(ThreadedCallsChild, DISABLED_CallsFromEveryThreadAtOnce) {
  const char* mode = std::getenv(kChildVariable);
  if (mode == nullptr) GTEST_SKIP() << "runs only as a child of the ThreadedCalls tests";
  const bool clique = std::string(mode) == "clique";
  const bool churn = std::string(mode) == "churn";
  void* standin =
      dlopen((build_dir() + "/tests/support/libnccl.so.2").c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(standin, nullptr) << dlerror();
  void* shim = dlopen((build_dir() + "/libmagice.so").c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(shim, nullptr) << dlerror();
  NcclEntryPoints nccl;
  ASSERT_NO_FATAL_FAILURE(bind_all(standin, shim, nccl));

  // A clique's communicators wait for one another in every collective: one thread per rank, as
  // a single-process multi-GPU program drives them. Independent ones never wait.
  std::vector<ncclComm_t> comms(kThreads, nullptr);
  if (clique) {
    ASSERT_EQ(nccl.init_all(comms.data(), kThreads, nullptr), ncclSuccess);
  }
  std::latch start(kThreads);
  std::vector<ncclResult_t> results(kThreads, ncclSuccess);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      ncclComm_t& comm = comms[static_cast<size_t>(t)];
      ncclResult_t& result = results[static_cast<size_t>(t)];
      for (int round = 0; round < (churn ? kChurnRounds : 1); ++round) {
        if (!clique) {
          ncclUniqueId id;
          result = nccl.get_unique_id(&id);
          if (result == ncclSuccess) result = nccl.init_rank(&comm, 1, id, 0);
        }
        if (round == 0) start.arrive_and_wait();  // all threads call at once
        if (result == ncclSuccess) result = drive(nccl, comm, churn ? kChurnSteps : kSteps);
        if (comm != nullptr && nccl.destroy(comm) != ncclSuccess && result == ncclSuccess)
          result = ncclInternalError;
        comm = nullptr;
        if (result != ncclSuccess) break;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t)
    EXPECT_EQ(results[static_cast<size_t>(t)], ncclSuccess) << "thread " << t;
  // Both libraries stay loaded: the shim's exit hooks write the trace out when this process ends.
}

// ---- the tests ---------------------------------------------------------------------------------

struct TempDir {
  TempDir() {
    char pattern[] = "/tmp/magice-threads.XXXXXX";
    if (mkdtemp(pattern) != nullptr) path = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    if (!path.empty()) fs::remove_all(path, ignored);
  }
  std::string path;
};

std::string describe(const LaunchResult& r) {
  std::string out = r.summary() + "\n";
  for (const RankResult& rank : r.ranks) out += rank.stdout_text + rank.stderr_text;
  return out;
}

// Runs the child in `mode` with `env` added; returns its one trace.
testing::AssertionResult run_child(const std::string& mode,
                                   std::vector<std::pair<std::string, std::string>> env,
                                   trace::Trace& out) {
  TempDir traces;
  if (traces.path.empty())
    return testing::AssertionFailure() << "cannot make a temporary directory";
  LaunchSpec spec;
  spec.argv = {self_path(), "--gtest_filter=ThreadedCallsChild.*",
               "--gtest_also_run_disabled_tests"};
  spec.env = std::move(env);
  spec.env.emplace_back(kChildVariable, mode);
  spec.env.emplace_back("MAGI_TRACE_DIR", traces.path);
  spec.timeout_s = 120;  // TSan slows the child down many times over
  spec.capture_output = true;
  const LaunchResult result = launch(spec);
  if (!result.all_ok()) return testing::AssertionFailure() << describe(result);
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(traces.path)) files.push_back(entry.path());
  if (files.size() != 1)
    return testing::AssertionFailure() << "expected one trace file, found " << files.size() << "\n"
                                       << describe(result);
  out = trace::read_trace(files[0]);
  return testing::AssertionSuccess();
}

// A caller's communicator: its identity and rank (a clique's ranks share the identity).
using CommKey = std::pair<uint64_t, int32_t>;

std::map<CommKey, std::vector<trace::CallRecord>> calls_by_communicator(const trace::Trace& t) {
  std::map<CommKey, std::vector<trace::CallRecord>> out;
  for (const trace::CallRecord& call : t.calls) out[{call.comm_id, call.rank}].push_back(call);
  return out;
}

// Every thread's calls are in the trace, once each, in the order it issued them, on its own
// communicator; every communicator ended and found its step.
void expect_every_call_traced(const trace::Trace& t) {
  EXPECT_EQ(t.dropped, 0u);
  ASSERT_EQ(t.comms.size(), static_cast<size_t>(kThreads));
  const auto by_comm = calls_by_communicator(t);
  ASSERT_EQ(by_comm.size(), static_cast<size_t>(kThreads));
  std::set<uint32_t> threads;
  for (const auto& [key, calls] : by_comm) {
    SCOPED_TRACE("communicator " + std::to_string(key.first) + " rank " +
                 std::to_string(key.second));
    ASSERT_EQ(calls.size(), static_cast<size_t>(kCallsPerThread));
    for (size_t i = 0; i < calls.size(); ++i) {
      ASSERT_EQ(calls[i].seq, i);
      ASSERT_EQ(calls[i].op, static_cast<uint8_t>(kStep[i % kStepCalls])) << "call " << i;
      ASSERT_EQ(calls[i].result, ncclSuccess) << "call " << i;
      ASSERT_EQ(calls[i].thread, calls[0].thread) << "call " << i << " came from another thread";
      ASSERT_EQ((calls[i].flags & trace::kCallInGroup) != 0, i % kStepCalls == kStepCalls - 1)
          << "call " << i;
    }
    threads.insert(calls[0].thread);
  }
  EXPECT_EQ(threads.size(), static_cast<size_t>(kThreads)) << "communicators shared a thread";

  // Per identity, as many ends and found steps as ranks: a clique's ranks share the identity.
  std::map<uint64_t, int> ranks, ends, steps;
  for (const trace::CommRecord& comm : t.comms) ++ranks[comm.comm_id];
  for (const trace::CommEndRecord& end : t.comm_ends) {
    EXPECT_EQ(end.how, static_cast<uint8_t>(trace::CommEndKind::Destroy));
    EXPECT_EQ(end.calls, static_cast<uint64_t>(kCallsPerThread));
    ++ends[end.comm_id];
  }
  for (const trace::StepRecord& step : t.steps)
    if (step.event == static_cast<uint8_t>(trace::StepEvent::Found) && step.period == kStepCalls)
      ++steps[step.comm_id];
  EXPECT_EQ(ends, ranks);
  EXPECT_EQ(steps, ranks);
}

TEST(ThreadedCalls, ThreadsOnCommunicatorsOfTheirOwnAreTracedCallForCall) {
  trace::Trace t;
  ASSERT_TRUE(
      run_child("independent", {{"MAGI_TRACE_BUFFER_KIB", "256"}, {"MAGI_LOG", "INFO"}}, t));
  expect_every_call_traced(t);
  std::set<uint64_t> identities;
  for (const trace::CommRecord& c : t.comms) identities.insert(c.comm_id);
  EXPECT_EQ(identities.size(), static_cast<size_t>(kThreads));
}

TEST(ThreadedCalls, ThreadsDrivingTheRanksOfOneInitAllCliqueAreTracedCallForCall) {
  trace::Trace t;
  ASSERT_TRUE(run_child("clique", {{"MAGI_TRACE_BUFFER_KIB", "256"}}, t));
  expect_every_call_traced(t);
  for (const trace::CommRecord& c : t.comms) {
    EXPECT_EQ(c.comm_id, t.comms[0].comm_id);
    EXPECT_EQ(c.nranks, kThreads);
  }
}

// Every ncclCommDestroy flushes the trace; here the threads end communicators all the time, so
// flushes from several threads meet each other and the writer thread's own handovers.
TEST(ThreadedCalls, ThreadsMakingAndEndingCommunicatorsAtOnceLoseNoRecord) {
  trace::Trace t;
  ASSERT_TRUE(run_child("churn", {{"MAGI_TRACE_BUFFER_KIB", "256"}}, t));
  EXPECT_EQ(t.dropped, 0u);
  ASSERT_EQ(t.comms.size(), static_cast<size_t>(kThreads * kChurnRounds));
  std::map<uint64_t, int> ends;
  for (const trace::CommEndRecord& end : t.comm_ends) {
    EXPECT_EQ(end.calls, static_cast<uint64_t>(kChurnSteps * kStepCalls));
    ++ends[end.comm_id];
  }
  const auto by_comm = calls_by_communicator(t);
  EXPECT_EQ(by_comm.size(), t.comms.size());
  for (const trace::CommRecord& comm : t.comms) {
    SCOPED_TRACE("communicator " + std::to_string(comm.comm_id));
    EXPECT_EQ(ends[comm.comm_id], 1);
    const auto calls = by_comm.find({comm.comm_id, comm.rank});
    ASSERT_NE(calls, by_comm.end());
    ASSERT_EQ(calls->second.size(), static_cast<size_t>(kChurnSteps * kStepCalls));
    for (size_t i = 0; i < calls->second.size(); ++i) EXPECT_EQ(calls->second[i].seq, i);
  }
}

// The smallest buffers make the writer thread fall behind the callers; a record it has no room
// for is counted, never waited for. Every record the threads made is in the file or in the
// Dropped count, and what is in the file is in each communicator's order. What "every record"
// is comes from the same run with buffers large enough to drop nothing: besides each
// communicator's Comm record, calls, Step and CommEnd, its settings check (the hello round)
// writes Agreement records. MAGI_TRANSPORT=nccl keeps that the only round, so both runs make the
// same records; call sites off, since their records depend on the build.
TEST(ThreadedCalls, WithTheSmallestBuffersEveryRecordIsWrittenOrCountedAsDropped) {
  const auto all_written = [](const trace::Trace& t) {
    return t.comms.size() + t.calls.size() + t.steps.size() + t.comm_ends.size() +
           t.agreements.size() + t.decisions.size();
  };
  trace::Trace full;
  ASSERT_TRUE(run_child(
      "independent",
      {{"MAGI_TRACE_BUFFER_KIB", "1024"}, {"MAGI_CALLSITES", "0"}, {"MAGI_TRANSPORT", "nccl"}},
      full));
  ASSERT_EQ(full.dropped, 0u);
  // Each communicator: its Comm record, its calls, one Step (found once, never lost: the calls
  // repeat to the end), its CommEnd; and its hello's records.
  EXPECT_EQ(full.comms.size() + full.calls.size() + full.steps.size() + full.comm_ends.size(),
            uint64_t{kThreads} * (1 + kCallsPerThread + 1 + 1));
  EXPECT_FALSE(full.agreements.empty());
  const uint64_t made = all_written(full);

  trace::Trace t;
  ASSERT_TRUE(run_child(
      "independent",
      {{"MAGI_TRACE_BUFFER_KIB", "16"}, {"MAGI_CALLSITES", "0"}, {"MAGI_TRANSPORT", "nccl"}}, t));
  const uint64_t written = all_written(t);
  EXPECT_EQ(written + t.dropped, made) << written << " written, " << t.dropped << " dropped";
  for (const auto& [key, calls] : calls_by_communicator(t))
    for (size_t i = 1; i < calls.size(); ++i) ASSERT_LT(calls[i - 1].seq, calls[i].seq);
}

}  // namespace
}  // namespace magi
