// The shim in front of the NCCL stand-in, in real processes under LD_PRELOAD: it forwards every
// call unchanged, finds NCCL however it was loaded, and records what each rank did.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "base/ids.h"
#include "capture/trace_reader.h"
#include "tests/support/has_line.h"
#include "tests/support/launch.h"
#include "tests/support/tool_run.h"

namespace magi {
namespace {

namespace fs = std::filesystem;

std::string build_dir() {
  const char* dir = std::getenv("TEST_BUILD_DIR");
  return dir ? dir : fs::absolute("build").string();
}
std::string support(const std::string& name) { return build_dir() + "/tests/support/" + name; }
std::string shim() { return build_dir() + "/libmagice.so"; }

struct TempDir {
  TempDir() {
    char tmpl[] = "/tmp/magice-test.XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
  std::string path;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

std::vector<std::string> traces_in(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".trace") out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

// What LD_PRELOAD holds for a shimmed run. A sanitizer build sets TEST_PRELOAD_FIRST to its
// runtime (make test-asan, test-tsan): the runtime must be loaded before the instrumented shim.
std::string shim_preload() {
  const char* first = std::getenv("TEST_PRELOAD_FIRST");
  return first != nullptr && *first != '\0' ? std::string(first) + " " + shim() : shim();
}

// Runs `argv` on n ranks, with the shim preloaded when `preload`, plus `env`.
support::LaunchResult run_ranks(int n, std::vector<std::string> argv, bool preload,
                                std::vector<std::pair<std::string, std::string>> env = {},
                                double timeout_s = 60) {
  support::LaunchSpec spec;
  spec.nranks = n;
  spec.argv = std::move(argv);
  spec.env = std::move(env);
  if (preload) spec.env.emplace_back("LD_PRELOAD", shim_preload());
  spec.timeout_s = timeout_s;
  spec.capture_output = true;
  return support::launch(spec);
}

std::string describe(const support::LaunchResult& r) {
  std::string out = r.timed_out ? "timed out\n" : "";
  for (size_t i = 0; i < r.ranks.size(); ++i)
    out += "rank " + std::to_string(i) + ": exit " + std::to_string(r.ranks[i].exit_code) +
           " signal " + std::to_string(r.ranks[i].signal) + "\n" + r.ranks[i].stderr_text + "\n";
  return out;
}

// Every op, every datatype, in-place and out-of-place: byte for byte what the stand-in gives
// without the shim.
class ResultsUnchanged : public testing::TestWithParam<int> {};

TEST_P(ResultsUnchanged, EveryOpGivesTheSameBytesWithAndWithoutTheShim) {
  const int n = GetParam();
  TempDir plain, shimmed, traces;
  auto a = run_ranks(n, {support("magi-workload"), "ops", "--out", plain.path}, false);
  ASSERT_TRUE(a.all_ok()) << describe(a);
  auto b = run_ranks(n, {support("magi-workload"), "ops", "--out", shimmed.path}, true,
                     {{"MAGI_TRACE_DIR", traces.path}});
  ASSERT_TRUE(b.all_ok()) << describe(b);
  for (int r = 0; r < n; ++r) {
    const std::string file = "/rank" + std::to_string(r) + ".bin";
    const std::string expected = read_file(plain.path + file);
    ASSERT_FALSE(expected.empty()) << "the workload wrote no results for rank " << r;
    EXPECT_TRUE(expected == read_file(shimmed.path + file)) << "rank " << r << " results differ";
  }
  EXPECT_EQ(traces_in(traces.path).size(), static_cast<size_t>(n));
}

INSTANTIATE_TEST_SUITE_P(Ranks, ResultsUnchanged, testing::Values(2, 3, 8));

// NCCL calls its own public API from inside some calls (its ncclBcast calls ncclBroadcast, and so
// does the stand-in's). Those inner calls reach the shim too, and must not be recorded as calls
// of the program: on each thread, no recorded call may start before the previous one returned.
TEST(Shim, CallsNcclMakesFromInsideACallAreNotRecordedAsTheProgramsCalls) {
  TempDir out, traces;
  auto r = run_ranks(2, {support("magi-workload"), "ops", "--out", out.path}, true,
                     {{"MAGI_TRACE_DIR", traces.path}});
  ASSERT_TRUE(r.all_ok()) << describe(r);
  for (const auto& file : traces_in(traces.path)) {
    trace::Trace t = trace::read_trace(file);
    std::map<uint32_t, std::vector<trace::CallRecord>> by_thread;
    size_t broadcasts = 0;
    for (const auto& c : t.calls) {
      by_thread[c.thread].push_back(c);
      broadcasts += c.op == static_cast<uint8_t>(trace::Op::Broadcast);
    }
    EXPECT_GT(broadcasts, 0u) << "the scenario should broadcast (with ncclBcast among others)";
    for (auto& [thread, calls] : by_thread) {
      std::sort(calls.begin(), calls.end(),
                [](const auto& a, const auto& b) { return a.time_ns < b.time_ns; });
      for (size_t i = 1; i < calls.size(); ++i)
        ASSERT_GE(calls[i].time_ns, calls[i - 1].time_ns + calls[i - 1].duration_ns)
            << file << ": call seq " << calls[i].seq << " began inside call seq "
            << calls[i - 1].seq;
    }
  }
}

// PyTorch loads NCCL inside an extension opened RTLD_LOCAL; dlsym(RTLD_NEXT) sees nothing there.
TEST(Shim, FindsNcclLoadedUnderAnRtldLocalExtension) {
  TempDir out, traces;
  auto r = run_ranks(2, {support("magi-workload-local"), "ops", "--out", out.path}, true,
                     {{"MAGI_TRACE_DIR", traces.path}, {"MAGI_LOG", "INFO"}});
  ASSERT_TRUE(r.all_ok()) << describe(r);
  EXPECT_NE(r.ranks[0].stderr_text.find("already loaded as libnccl.so.2"), std::string::npos)
      << r.ranks[0].stderr_text;
  const auto files = traces_in(traces.path);
  ASSERT_EQ(files.size(), 2u);
  for (const auto& f : files) EXPECT_GT(trace::read_trace(f).calls.size(), 100u) << f;
}

TEST(Shim, NoRealNcclGivesAnErrorAndOneLineNotACrash) {
  auto r = run_ranks(1, {support("magi-probe"), "AllReduce", "AllGather", "GroupStart", "GroupEnd"},
                     true);
  ASSERT_TRUE(r.all_ok()) << describe(r);
  EXPECT_NE(r.ranks[0].stdout_text.find("AllReduce=2\n"), std::string::npos)
      << r.ranks[0].stdout_text;
  EXPECT_NE(r.ranks[0].stdout_text.find("AllGather=2\n"), std::string::npos)
      << r.ranks[0].stdout_text;
  const std::string& err = r.ranks[0].stderr_text;
  size_t lines = 0;
  for (size_t at = err.find("no real NCCL found"); at != std::string::npos;
       at = err.find("no real NCCL found", at + 1))
    ++lines;
  EXPECT_EQ(lines, 1u) << err;
}

TEST(Shim, WithoutTheShimTheProbeFindsNoNccl) {
  // Guards the test above: the probe really loads no NCCL of its own.
  auto r = run_ranks(1, {support("magi-probe"), "AllReduce"}, false);
  ASSERT_TRUE(r.all_ok()) << describe(r);
  EXPECT_EQ(r.ranks[0].stdout_text, "AllReduce=absent\n");
}

TEST(Shim, ForwardsToMagiNcclLibraryAndAnswersForFunctionsItLacks) {
  auto r = run_ranks(1, {support("magi-probe"), "AllReduce", "AllGather", "AllGather"}, true,
                     {{"MAGI_NCCL_LIBRARY", support("libpartial_nccl.so")}});
  ASSERT_TRUE(r.all_ok()) << describe(r);
  const std::string& out = r.ranks[0].stdout_text;
  EXPECT_NE(out.find("AllReduce=6\n"), std::string::npos) << out;  // ncclRemoteError, unchanged
  EXPECT_NE(out.find("AllGather=5\n"), std::string::npos) << out;  // ncclInvalidUsage
  const std::string& err = r.ranks[0].stderr_text;
  const size_t first = err.find("ncclAllGather: the real NCCL");
  ASSERT_NE(first, std::string::npos) << err;
  EXPECT_EQ(err.find("ncclAllGather: the real NCCL", first + 1), std::string::npos)
      << "the missing function was reported more than once:\n"
      << err;
}

TEST(Shim, BadOptionValueGivesOneLineAndTheProgramRunsOn) {
  TempDir out;
  auto r = run_ranks(2, {support("magi-workload"), "ops", "--out", out.path}, true,
                     {{"MAGI_CALLSITE_DEPTH", "lots"}, {"MAGI_CALLSITE_DEPT", "4"}});
  ASSERT_TRUE(r.all_ok()) << describe(r);
  const std::string& err = r.ranks[0].stderr_text;
  EXPECT_NE(
      err.find("MAGI_CALLSITE_DEPTH='lots' is not accepted (expected an integer from 1 to 64)"),
      std::string::npos)
      << err;
  EXPECT_NE(
      err.find(
          "unknown variable MAGI_CALLSITE_DEPT is ignored (did you mean MAGI_CALLSITE_DEPTH?)"),
      std::string::npos)
      << err;
}

// The disk fills up while tracing (tests/support/full_disk.cc fails trace writes with ENOSPC
// past a few kilobytes): one line, tracing stops, the program and its results are unchanged,
// and what was written reads back or says where it was cut.
TEST(Shim, AFullDiskStopsTracingWithOneLineAndTheProgramRunsOn) {
  TempDir out, traces;
  // After a sanitizer's runtime (which must come first), before the shim.
  const char* first = std::getenv("TEST_PRELOAD_FIRST");
  const std::string preload = (first != nullptr && *first != '\0' ? std::string(first) + " " : "") +
                              support("libfull_disk.so") + " " + shim();
  support::LaunchSpec spec;
  spec.nranks = 2;
  spec.argv = {support("magi-workload"), "fsdp", "--layers", "4", "--steps", "40"};
  spec.env = {{"LD_PRELOAD", preload},
              {"MAGI_TRACE_DIR", traces.path},
              {"FULL_DISK_BYTES", "6000"},
              {"MAGI_TRACE_BUFFER_KIB", "16"}};
  spec.timeout_s = 60;
  spec.capture_output = true;
  const support::LaunchResult r = support::launch(spec);
  ASSERT_TRUE(r.all_ok()) << describe(r);
  size_t lines = 0;
  for (const auto& rank : r.ranks) {
    for (size_t at = rank.stderr_text.find("writing the trace failed (No space left on device)");
         at != std::string::npos; at = rank.stderr_text.find("writing the trace failed", at + 1))
      ++lines;
  }
  EXPECT_GE(lines, 1u) << describe(r);
  EXPECT_LE(lines, 2u) << "one line per process at most\n" << describe(r);
  for (const auto& file : traces_in(traces.path)) {
    try {
      trace::read_trace(file);  // cut at a record boundary, or
    } catch (const trace::TraceFormatError& e) {
      EXPECT_GT(e.offset(), 0u) << e.what();  // says where the damage starts
    }
  }
}

TEST(Shim, UnwritableTraceDirGivesOneLineAndTheProgramRunsOn) {
  TempDir out;
  auto r = run_ranks(2, {support("magi-workload"), "ops", "--out", out.path}, true,
                     {{"MAGI_TRACE_DIR", "/proc/no-such-dir/traces"}});
  ASSERT_TRUE(r.all_ok()) << describe(r);
  EXPECT_NE(r.ranks[0].stderr_text.find("MAGI_TRACE_DIR=/proc/no-such-dir/traces: cannot create"),
            std::string::npos)
      << r.ranks[0].stderr_text;
}

// ---- what the traces say ----

struct FsdpRun {
  std::vector<trace::Trace> traces;  // by rank
  support::LaunchResult result;
};

FsdpRun run_fsdp(int n, const std::string& dir, std::vector<std::string> extra = {},
                 std::vector<std::pair<std::string, std::string>> env = {}) {
  std::vector<std::string> argv = {
      support("magi-workload"), "fsdp", "--layers", "4", "--steps", "6"};
  argv.insert(argv.end(), extra.begin(), extra.end());
  env.emplace_back("MAGI_TRACE_DIR", dir);
  FsdpRun run;
  run.result = run_ranks(n, argv, true, env);
  std::map<int, trace::Trace> by_rank;
  for (const auto& f : traces_in(dir)) {
    trace::Trace t = trace::read_trace(f);
    if (!t.comms.empty()) by_rank[t.comms.front().rank] = std::move(t);
  }
  for (auto& [rank, t] : by_rank) run.traces.push_back(std::move(t));
  return run;
}

// Call sites on for the ranks (the TSan suite's default is off, Makefile): a rank's call sites
// are unwound on its main thread alone, which never frees libunwind's per-thread cache.
TEST(Traces, EveryRankRecordsTheSameCommunicatorAndTheSameCallsites) {
  TempDir dir;
  FsdpRun run = run_fsdp(4, dir.path, {}, {{"MAGI_CALLSITES", "1"}});
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  ASSERT_EQ(run.traces.size(), 4u);
  const uint64_t comm_id = run.traces[0].comms.at(0).comm_id;
  for (size_t r = 0; r < 4; ++r) {
    const trace::Trace& t = run.traces[r];
    ASSERT_EQ(t.comms.size(), 1u);
    EXPECT_EQ(t.comms[0].comm_id, comm_id) << "rank " << r;
    EXPECT_EQ(t.comms[0].rank, static_cast<int>(r));
    EXPECT_EQ(t.comms[0].nranks, 4);
    ASSERT_EQ(t.calls.size(), run.traces[0].calls.size()) << "rank " << r;
    for (size_t i = 0; i < t.calls.size(); ++i) {
      EXPECT_EQ(t.calls[i].seq, i);
      EXPECT_EQ(t.calls[i].shape, run.traces[0].calls[i].shape) << "rank " << r << " call " << i;
      EXPECT_NE(t.calls[i].callsite, 0u);
      EXPECT_EQ(t.calls[i].callsite, run.traces[0].calls[i].callsite)
          << "rank " << r << " call " << i;
      EXPECT_NE(t.calls[i].sendbuf, 0u);
    }
    EXPECT_FALSE(t.callsites.empty());
    EXPECT_FALSE(t.modules.empty());
    ASSERT_EQ(t.comm_ends.size(), 1u);
    EXPECT_EQ(t.comm_ends[0].calls, t.calls.size());
    EXPECT_EQ(t.dropped, 0u);
  }
  struct stat st {};
  ASSERT_EQ(stat(run.traces[0].path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(Traces, TheStepIsFoundOnEveryRankAtTheSameCollective) {
  TempDir dir;
  FsdpRun run = run_fsdp(3, dir.path);
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  ASSERT_EQ(run.traces.size(), 3u);
  for (const trace::Trace& t : run.traces) {
    ASSERT_FALSE(t.steps.empty()) << t.path;
    EXPECT_EQ(t.steps[0].event, static_cast<uint8_t>(trace::StepEvent::Found));
    EXPECT_EQ(t.steps[0].seq, run.traces[0].steps[0].seq);
    EXPECT_EQ(t.steps[0].period, run.traces[0].steps[0].period);
    EXPECT_EQ(t.steps[0].digest, run.traces[0].steps[0].digest);
    EXPECT_GE(t.steps[0].period, 2u);
  }
}

TEST(Traces, AProgramThatNeverDestroysItsCommunicatorStillLeavesACompleteTrace) {
  TempDir dir;
  FsdpRun run = run_fsdp(2, dir.path, {"--exit-without-destroy", "1"});
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  ASSERT_EQ(run.traces.size(), 2u);
  for (const trace::Trace& t : run.traces) {
    ASSERT_EQ(t.comm_ends.size(), 1u) << t.path;
    EXPECT_EQ(t.comm_ends[0].how, static_cast<uint8_t>(trace::CommEndKind::ProcessExit));
    EXPECT_EQ(t.comm_ends[0].calls, t.calls.size());
    EXPECT_EQ(t.calls.size(), run.traces[0].calls.size());
    EXPECT_GT(t.calls.size(), 20u);
  }
}

TEST(Traces, AForkedChildThatExitsLeavesNoTraceOfTheParentsCommunicators) {
  TempDir dir;
  FsdpRun run = run_fsdp(2, dir.path, {"--fork-child", "1"});
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  EXPECT_EQ(traces_in(dir.path).size(), 2u) << "a child wrote a trace of its own";
  ASSERT_EQ(run.traces.size(), 2u);
  for (const trace::Trace& t : run.traces) {
    ASSERT_EQ(t.comm_ends.size(), 1u) << t.path;
    EXPECT_EQ(t.comm_ends[0].how, static_cast<uint8_t>(trace::CommEndKind::Destroy));
    EXPECT_EQ(t.comm_ends[0].calls, t.calls.size());
  }
}

TEST(Traces, CallsitesOffRecordsZeroCallsites) {
  TempDir dir;
  FsdpRun run = run_fsdp(2, dir.path, {}, {{"MAGI_CALLSITES", "0"}});
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  ASSERT_EQ(run.traces.size(), 2u);
  for (const auto& c : run.traces[0].calls) EXPECT_EQ(c.callsite, 0u);
  EXPECT_TRUE(run.traces[0].callsites.empty());
}

TEST(Traces, SplitChildrenHaveIdentitiesEqualWithinAColorAndDistinctAcrossColors) {
  TempDir dir;
  auto r = run_ranks(4, {support("magi-workload"), "split"}, true, {{"MAGI_TRACE_DIR", dir.path}});
  ASSERT_TRUE(r.all_ok()) << describe(r);
  // The scenario splits by parity first (then splits and shrinks again): the first child of each
  // rank is its parity communicator.
  std::map<int, uint64_t> child_of_rank;  // parent rank -> child comm id
  uint64_t parent = 0;
  for (const auto& f : traces_in(dir.path)) {
    trace::Trace t = trace::read_trace(f);
    int parent_rank = -1;
    for (const auto& c : t.comms) {
      if (c.origin != static_cast<uint8_t>(trace::CommOrigin::InitRank)) continue;
      parent_rank = c.rank;
      parent = c.comm_id;
    }
    for (const auto& c : t.comms)
      if (c.origin == static_cast<uint8_t>(trace::CommOrigin::Split)) {
        EXPECT_EQ(c.parent_id, parent);
        if (!child_of_rank.count(parent_rank)) child_of_rank[parent_rank] = c.comm_id;
      }
  }
  ASSERT_EQ(child_of_rank.size(), 4u);
  EXPECT_EQ(child_of_rank[0], child_of_rank[2]);  // color = rank % 2
  EXPECT_EQ(child_of_rank[1], child_of_rank[3]);
  EXPECT_NE(child_of_rank[0], child_of_rank[1]);
}

TEST(Traces, InitAllRecordsEveryRankOfItsCommunicatorInOneFile) {
  TempDir dir;
  auto r = run_ranks(1, {support("magi-workload"), "initall", "--ndev", "3"}, true,
                     {{"MAGI_TRACE_DIR", dir.path}});
  ASSERT_TRUE(r.all_ok()) << describe(r);
  const auto files = traces_in(dir.path);
  ASSERT_EQ(files.size(), 1u);
  const trace::Trace t = trace::read_trace(files[0]);
  std::set<int> ranks;
  uint64_t id = 0;
  for (const auto& c : t.comms) {
    if (c.origin != static_cast<uint8_t>(trace::CommOrigin::InitAll)) continue;
    if (id == 0) id = c.comm_id;
    EXPECT_EQ(c.comm_id, id);
    EXPECT_EQ(c.nranks, 3);
    ranks.insert(c.rank);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  std::set<int> calling_ranks;
  for (const auto& call : t.calls)
    if (call.comm_id == id) calling_ranks.insert(call.rank);
  EXPECT_EQ(calling_ranks, (std::set<int>{0, 1, 2}));
}

// ---- magice-trace over real traces ----

int run_tool(const std::vector<std::string>& args, std::string* out) {
  return test::run_magice_trace(args, out);
}

TEST(TraceTool, RanksOfOneProgramDiffClean) {
  TempDir dir;
  FsdpRun run = run_fsdp(4, dir.path);
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  std::vector<std::string> args = {"diff"};
  for (const auto& f : traces_in(dir.path)) args.push_back(f);
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 0) << out;
}

// The fsdp scenario issues one all-reduce, then per step L gathers and one all-reduce; rank R's
// divergence is its layer-0 gather of step K: collective #(1 + K·(L+1)).
constexpr int kLayers = 4, kDivergeStep = 3;
constexpr int kDivergentCollective = 1 + kDivergeStep * (kLayers + 1);

TEST(TraceTool, DiffReportsAnInjectedCountDivergenceAtTheRightCollective) {
  TempDir dir;
  FsdpRun run = run_fsdp(4, dir.path,
                         {"--diverge-rank", "2", "--diverge-step", std::to_string(kDivergeStep),
                          "--diverge-kind", "count"},
                         {{"STANDIN_MISMATCH", "error"}});
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  std::vector<std::string> args = {"diff"};
  for (const auto& f : traces_in(dir.path)) args.push_back(f);
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  EXPECT_NE(out.find("diverges at collective #" + std::to_string(kDivergentCollective)),
            std::string::npos)
      << out;
}

TEST(TraceTool, DiffReportsAnInjectedCallsiteDivergenceAtTheRightCollective) {
  TempDir dir;
  FsdpRun run = run_fsdp(4, dir.path,
                         {"--diverge-rank", "1", "--diverge-step", std::to_string(kDivergeStep),
                          "--diverge-kind", "callsite"},
                         {{"MAGI_CALLSITES", "1"}});
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  std::vector<std::string> args = {"diff"};
  for (const auto& f : traces_in(dir.path)) args.push_back(f);
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  EXPECT_NE(out.find("call sites differ from collective #" + std::to_string(kDivergentCollective)),
            std::string::npos)
      << out;
  args.insert(args.begin() + 1, "--shapes-only");
  EXPECT_EQ(run_tool(args, &out), 0) << out;
}

// The ids that a rank's log lines name as joined ("comm 0c1d9e7b0001 joined: rank 0 of 2"), in
// the order it joined them.
std::vector<std::string> joined_ids(const std::string& log) {
  const std::string before = " comm ", after = " joined: ";
  std::vector<std::string> ids;
  std::istringstream lines(log);
  for (std::string line; std::getline(lines, line);) {
    const size_t at = line.find(before);
    if (at != std::string::npos && line.find(after) == at + before.size() + 12)
      ids.push_back(line.substr(at + before.size(), 12));
  }
  return ids;
}

// An id copied from a log line finds the same communicator in every output of magice-trace,
// and `dump --comm` takes it (or the whole 64-bit id) and shows that communicator alone.
TEST(TraceTool, TheIdALogLineShowsNamesTheSameCommunicatorInEveryOutput) {
  TempDir dir;
  FsdpRun run = run_fsdp(2, dir.path, {"--comms", "2"}, {{"MAGI_LOG", "INFO"}});
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  ASSERT_EQ(run.traces.size(), 2u);
  const std::vector<std::string> ids = joined_ids(run.result.ranks[0].stderr_text);
  ASSERT_EQ(ids.size(), 2u) << run.result.ranks[0].stderr_text;
  const std::string& world = ids[0];
  const std::string& split = ids[1];
  ASSERT_NE(world, split);
  const trace::Trace& rank0 = run.traces[0];
  ASSERT_EQ(rank0.comms.size(), 2u);
  const std::string file = rank0.path;

  std::string shown;
  ASSERT_EQ(run_tool({"dump", "--comm", world, file}, &shown), 0) << shown;
  EXPECT_TRUE(test::has_line(shown, "^  " + world + "  0/2 ")) << shown;
  EXPECT_TRUE(test::has_line(shown, "^  " + world + " +[0-9]+  AllGather ")) << shown;
  EXPECT_EQ(shown.find(split), std::string::npos) << shown;
  // The whole id, as a program holds it, selects the same communicator.
  char whole[17];
  std::snprintf(whole, sizeof(whole), "%016llx",
                static_cast<unsigned long long>(rank0.comms[0].comm_id));
  std::string out;
  ASSERT_EQ(run_tool({"dump", "--comm", whole, file}, &out), 0) << out;
  EXPECT_EQ(out, shown);
  ASSERT_EQ(run_tool({"dump", "--comm", split, file}, &out), 0) << out;
  EXPECT_TRUE(test::has_line(out, "^  " + split + "  0/1 ")) << out;
  EXPECT_FALSE(test::has_line(out, "^  " + world + " ")) << out;

  ASSERT_EQ(run_tool({"skeleton", file}, &out), 0) << out;
  EXPECT_TRUE(test::has_line(out, "^comm " + world + " rank 0/2: ")) << out;
  EXPECT_TRUE(test::has_line(out, "^comm " + split + " rank 0/1: ")) << out;

  std::vector<std::string> args = {"decisions"};
  for (const trace::Trace& t : run.traces) args.push_back(t.path);
  EXPECT_EQ(run_tool(args, &out), 0) << out;
  EXPECT_TRUE(test::has_line(out, "^comm " + world + "[ :]")) << out;
  EXPECT_TRUE(test::has_line(out, "^comm " + split + "[ :]")) << out;

  args[0] = "diff";
  EXPECT_EQ(run_tool(args, &out), 0) << out;
  EXPECT_TRUE(test::has_line(out, "^comm " + world + ": 2 ranks")) << out;

  ASSERT_EQ(run_tool({"export", "--chrome", file, "-o", "-"}, &out), 0) << out;
  EXPECT_NE(out.find("\"comm " + world + "\""), std::string::npos) << out;
}

// The number that follows `marker` on the first line of `text` holding both `marker` and
// `context`; -1 when there is none.
int64_t number_after(const std::string& text, const std::string& context,
                     const std::string& marker) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t at = line.find(marker);
    if (at == std::string::npos || line.find(context) == std::string::npos) continue;
    return std::strtoll(line.c_str() + at + marker.size(), nullptr, 10);
  }
  return -1;
}

// "collective #N" is one call wherever it is shown: the library's end-of-communicator line
// names the first all-gather served off NCCL by its collective index, and decisions and dump
// name that same call so. The step is one group (served at its ncclGroupEnd, after the group's
// last call) and a Send/Recv pair comes first (a call's seq runs ahead of its collective index).
TEST(TraceTool, TheFirstMovedCollectiveALogLineNamesIsTheSameCallInDecisionsAndDump) {
  TempDir dir;
  FsdpRun run = run_fsdp(2, dir.path, {"--step-group", "1", "--p2p", "1", "--steps", "14"},
                         {{"MAGI_LOG", "INFO"}, {"MAGI_BACKEND", "host"}, {"MAGI_CE_FORCE", "1"}});
  ASSERT_TRUE(run.result.all_ok()) << describe(run.result);
  ASSERT_EQ(run.traces.size(), 2u);
  const trace::Trace& rank0 = run.traces[0];
  ASSERT_EQ(rank0.comms.size(), 1u);
  const std::string world = short_id_text(rank0.comms[0].comm_id);

  // What the trace says: the first call marked moved, as a collective index and as a seq.
  std::vector<trace::CallRecord> calls = rank0.calls;
  std::sort(calls.begin(), calls.end(), [](const auto& a, const auto& b) { return a.seq < b.seq; });
  int64_t first_collective = -1, first_seq = -1, collectives = 0;
  for (const trace::CallRecord& call : calls) {
    if (!trace::is_collective(static_cast<trace::Op>(call.op))) continue;
    if ((call.flags & trace::kCallMoved) != 0 && first_collective < 0) {
      first_collective = collectives;
      first_seq = static_cast<int64_t>(call.seq);
    }
    ++collectives;
  }
  ASSERT_GE(first_collective, 0) << "nothing moved\n" << describe(run.result);
  ASSERT_GT(first_seq, first_collective) << "the Send/Recv pair is missing";

  const std::string& log = run.result.ranks[0].stderr_text;
  EXPECT_EQ(number_after(log, "comm " + world + ": ", "the first at collective #"),
            first_collective)
      << log;

  std::vector<std::string> args = {"decisions"};
  for (const trace::Trace& t : run.traces) args.push_back(t.path);
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 0) << out;
  EXPECT_EQ(number_after(out, "comm " + world + " rank 0: ", "the first at collective #"),
            first_collective)
      << out;

  ASSERT_EQ(run_tool({"dump", rank0.path}, &out), 0) << out;
  // Its row: the call's seq, its op, its collective index, and the mark.
  EXPECT_TRUE(test::has_line(out, "^  " + world + " +" + std::to_string(first_seq) +
                                      "  AllGather +" + std::to_string(first_collective) +
                                      "  .*  moved( |$)"))
      << out;
}
}  // namespace
}  // namespace magi
