// The flight recorder and `magice-trace hang` on real ranks of the stand-in under the shim: ranks
// that hang are SIGKILLed by the launcher's timeout, and the report, read from the files the
// killed processes left, must name the rank and the collective. And the dump signal writes out a
// live, waiting rank's trace.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "capture/trace_reader.h"
#include "tests/support/has_line.h"
#include "tests/support/launch.h"
#include "tests/support/tool_run.h"

namespace magi {
namespace {

namespace fs = std::filesystem;
using test::build_dir;
using test::files_in;
using test::TempDir;

int run_tool(const std::vector<std::string>& args, std::string* out) {
  return test::run_magice_trace(args, out);
}

std::string preload() {
  const std::string shim = build_dir() + "/libmagice.so";
  const char* first = std::getenv("TEST_PRELOAD_FIRST");
  return first != nullptr && *first != '\0' ? std::string(first) + " " + shim : shim;
}

// fsdp with 4 layers issues one all-reduce, then per step 4 gathers and one all-reduce: step K's
// first gather is collective #(1 + 5K).
constexpr int kStep = 3;
constexpr int kCollective = 1 + kStep * 5;

support::LaunchResult run_fsdp(
    const std::string& dir, std::vector<std::string> extra,
    std::vector<std::pair<std::string, std::string>> env, double timeout_s,
    std::vector<std::vector<std::pair<std::string, std::string>>> rank_env = {},
    bool hang_expected = false) {
  support::LaunchSpec spec;
  spec.nranks = 4;
  spec.argv = {
      build_dir() + "/tests/support/magi-workload", "fsdp", "--layers", "4", "--steps", "6"};
  spec.argv.insert(spec.argv.end(), extra.begin(), extra.end());
  spec.env = std::move(env);
  spec.env.emplace_back("LD_PRELOAD", preload());
  spec.env.emplace_back("MAGI_FLIGHT_RECORDER", "64");
  spec.env.emplace_back("MAGI_FLIGHT_RECORDER_DIR", dir);
  spec.rank_env = std::move(rank_env);
  spec.timeout_s = timeout_s;
  spec.hang_expected = hang_expected;
  spec.capture_output = true;
  return support::launch(spec);
}

// A run the test makes hang, killed after exactly `timeout_s`.
support::LaunchResult hang_fsdp(const std::string& dir, std::vector<std::string> extra,
                                std::vector<std::pair<std::string, std::string>> env,
                                double timeout_s) {
  return run_fsdp(dir, std::move(extra), std::move(env), timeout_s, {}, true);
}

std::string file_of_pid(const std::vector<std::string>& files, int pid) {
  for (const std::string& f : files)
    if (f.find("." + std::to_string(pid) + ".") != std::string::npos) return f;
  return "";
}

TEST(FlightRecorder, HangNamesTheRankThatStoppedAndTheCollectiveFromKilledRanks) {
  TempDir dir;
  const support::LaunchResult r = hang_fsdp(
      dir.path, {"--stall-rank", "2", "--stall-step", std::to_string(kStep), "--stall-s", "60"}, {},
      4);
  ASSERT_TRUE(r.timed_out) << r.summary();
  for (const auto& rank : r.ranks) EXPECT_EQ(rank.signal, SIGKILL) << r.summary();
  const std::vector<std::string> files = files_in(dir.path, ".flight");
  ASSERT_EQ(files.size(), 4u);
  std::vector<std::string> args = {"hang"};
  args.insert(args.end(), files.begin(), files.end());
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  const std::string verdict = out.substr(0, out.find('\n'));
  EXPECT_NE(verdict.find("rank 2 never issued collective #" + std::to_string(kCollective) +
                         " (AllGather float32 x "),
            std::string::npos)
      << out;
  EXPECT_NE(verdict.find("ranks 0,1,3 wait in it"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 2: issued " + std::to_string(kCollective) + ", returned from " +
                     std::to_string(kCollective) + " collectives; last call #" +
                     std::to_string(kCollective - 1) + " AllReduce"),
            std::string::npos)
      << out;

  args.insert(args.begin() + 1, "--json");
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  EXPECT_NE(out.find("\"behind\":[2],\"waiting\":[0,1,3],\"missing_collective\":" +
                     std::to_string(kCollective)),
            std::string::npos)
      << out;

  // Without rank 3's file, rank 3 is absent; the others still show who stopped.
  args = {"hang"};
  for (const std::string& f : files)
    if (f != file_of_pid(files, r.ranks[3].pid)) args.push_back(f);
  ASSERT_EQ(args.size(), 4u);
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  EXPECT_NE(out.find("rank 3 of 4 absent"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 2 never issued collective #" + std::to_string(kCollective)),
            std::string::npos)
      << out;
}

// Two communicators (the world and its split by rank % 2): the one the stalled rank leaves
// waiting comes first, the split ones (whose ranks all stopped at the same place) after.
TEST(FlightRecorder, HangPutsTheCommunicatorThatWaitsFirstAmongSeveral) {
  TempDir dir;
  const support::LaunchResult r = hang_fsdp(dir.path,
                                            {"--comms", "2", "--stall-rank", "1", "--stall-step",
                                             std::to_string(kStep), "--stall-s", "60"},
                                            {}, 4);
  ASSERT_TRUE(r.timed_out) << r.summary();
  std::vector<std::string> args = {"hang"};
  for (const std::string& f : files_in(dir.path, ".flight")) args.push_back(f);
  ASSERT_EQ(args.size(), 5u);
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  const std::string verdict = out.substr(0, out.find('\n'));
  EXPECT_NE(verdict.find("rank 1 never issued collective #" + std::to_string(kCollective) +
                         " (AllGather float32 x "),
            std::string::npos)
      << out;
  EXPECT_NE(verdict.find("ranks 0,2,3 wait in it"), std::string::npos) << out;
  size_t fine = 0;
  for (size_t at = 0; (at = out.find(": no hang seen: 2 ranks issued", at)) != std::string::npos;
       ++at)
    ++fine;
  EXPECT_EQ(fine, 2u) << out;
}

// No trace is written: the call sites come from the recorder files alone, named from the
// workload's debug info (tests/support/workload/fsdp.cc: gather_layer issues the gathers).
TEST(FlightRecorder, HangNamesTheStalledCollectivesCallSiteFromKilledRanksFiles) {
  TempDir dir;
  const support::LaunchResult r = hang_fsdp(
      dir.path, {"--stall-rank", "2", "--stall-step", std::to_string(kStep), "--stall-s", "60"}, {},
      4);
  ASSERT_TRUE(r.timed_out) << r.summary();
  const std::vector<std::string> files = files_in(dir.path, ".flight");
  ASSERT_EQ(files.size(), 4u);
  EXPECT_TRUE(files_in(dir.path, ".trace").empty());
  std::vector<std::string> args = {"hang"};
  args.insert(args.end(), files.begin(), files.end());
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  const std::string verdict = out.substr(0, out.find('\n'));
  EXPECT_NE(verdict.find("rank 2 never issued collective #" + std::to_string(kCollective)),
            std::string::npos)
      << out;
  EXPECT_TRUE(test::has_line(
      verdict, R"(\(AllGather float32 x [0-9]+ at workload::gather_layer \(fsdp\.cc:[0-9]+\)\))"))
      << out;
  // The details list the frames under each waiting rank's last call.
  EXPECT_TRUE(test::has_line(out, R"(^ +workload::FsdpModel::step \(fsdp\.cc:[0-9]+\)$)")) << out;

  std::vector<std::string> raw = args;
  raw.insert(raw.begin() + 1, "--no-symbols");
  EXPECT_EQ(run_tool(raw, &out), 1) << out;
  EXPECT_NE(out.substr(0, out.find('\n')).find(" at libworkload.so+0x"), std::string::npos) << out;

  args.insert(args.begin() + 1, "--json");
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  EXPECT_NE(out.find("\"missing_call\":{\"op\":\"AllGather\",\"dtype\":\"float32\""),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("\"site\":\"workload::gather_layer (fsdp.cc:"), std::string::npos) << out;
  EXPECT_NE(out.find("\"python\":null,\"frames\":[\"workload::gather_layer (fsdp.cc:"),
            std::string::npos)
      << out;
}

// With MAGI_CALLSITES=1 (the default) the recorder alone names the all-gathers' sites only (the
// unwinding would be most of its cost); with 2 every call's, the stalled rank's last
// all-reduce too.
TEST(FlightRecorder, HangNamesEveryCallsSiteWithCallSitesAtTwo) {
  for (const char* level : {"1", "2"}) {
    TempDir dir;
    const support::LaunchResult r = hang_fsdp(
        dir.path, {"--stall-rank", "2", "--stall-step", std::to_string(kStep), "--stall-s", "60"},
        {{"MAGI_CALLSITES", level}}, 4);
    ASSERT_TRUE(r.timed_out) << r.summary();
    std::vector<std::string> args = {"hang"};
    for (const std::string& f : files_in(dir.path, ".flight")) args.push_back(f);
    ASSERT_EQ(args.size(), 5u);
    std::string out;
    EXPECT_EQ(run_tool(args, &out), 1) << out;
    const std::string last =
        "rank 2: issued [0-9]+, returned from [0-9]+ collectives; last call #[0-9]+ AllReduce "
        "float32 x 32 ";
    EXPECT_TRUE(test::has_line(out, std::string(level) == "2"
                                        ? last + "at .*FsdpModel::step \\(collective #"
                                        : last + "\\(collective #"))
        << "MAGI_CALLSITES=" << level << "\n"
        << out;
  }
}

// A rank whose recorder is off (as one that never joined leaves no file): reported absent.
TEST(FlightRecorder, HangReportsARankWithoutAFileAsAbsent) {
  TempDir dir;
  std::vector<std::vector<std::pair<std::string, std::string>>> rank_env(4);
  rank_env[1] = {{"MAGI_FLIGHT_RECORDER", "0"}};
  const support::LaunchResult r = run_fsdp(dir.path, {}, {}, 60, rank_env);
  ASSERT_TRUE(r.all_ok()) << r.summary();
  const std::vector<std::string> files = files_in(dir.path, ".flight");
  ASSERT_EQ(files.size(), 3u);
  std::vector<std::string> args = {"hang"};
  args.insert(args.end(), files.begin(), files.end());
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  EXPECT_NE(out.find(": rank 1 of 4 absent (no file holds them)"), std::string::npos) << out;
}

// A rank that never reaches ncclCommInitRank: the others wait inside the init (the stand-in's
// init waits for every rank, as NCCL's does) until the launcher kills them. Their files say they
// were joining; the missing rank has none.
TEST(FlightRecorder, HangNamesTheRankThatNeverJoinedAndTheRanksWaitingInTheInit) {
  TempDir dir;
  const support::LaunchResult r =
      hang_fsdp(dir.path, {"--stall-rank", "2", "--stall-init", "1", "--stall-s", "60"}, {}, 3);
  ASSERT_TRUE(r.timed_out) << r.summary();
  const std::vector<std::string> files = files_in(dir.path, ".flight");
  ASSERT_EQ(files.size(), 3u);
  std::vector<std::string> args = {"hang"};
  args.insert(args.end(), files.begin(), files.end());
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  const std::string verdict = out.substr(0, out.find('\n'));
  EXPECT_NE(verdict.find(": ranks 0,1,3 wait in the communicator's init; rank 2 never reached it "
                         "(no file holds it)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("rank 0: issued 0, returned from 0 collectives; inside the communicator's "
                     "init"),
            std::string::npos)
      << out;
  args.insert(args.begin() + 1, "--json");
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  EXPECT_NE(out.find("\"absent\":[2]"), std::string::npos) << out;
  EXPECT_NE(out.find("\"joining\":[0,1,3]"), std::string::npos) << out;
}

TEST(FlightRecorder, HangSeesNoHangInAJobThatFinished) {
  TempDir dir;
  const support::LaunchResult r = run_fsdp(dir.path, {}, {}, 60);
  ASSERT_TRUE(r.all_ok()) << r.summary();
  std::vector<std::string> args = {"hang"};
  for (const std::string& f : files_in(dir.path, ".flight")) args.push_back(f);
  ASSERT_EQ(args.size(), 5u);
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 0) << out;
  EXPECT_NE(out.find("no hang seen: 4 ranks issued 31 collectives each, ended"), std::string::npos)
      << out;
}

// MAGI_FLIGHT_RECORDER_COMPLETION=1 under the stand-in: no CUDA driver in the process, so a call
// counts as reached and completed when it returns, and the rings say so.
TEST(FlightRecorder, CompletionOfAFinishedJobEqualsWhatEachRankIssued) {
  TempDir dir;
  const support::LaunchResult r =
      run_fsdp(dir.path, {}, {{"MAGI_FLIGHT_RECORDER_COMPLETION", "1"}}, 60);
  ASSERT_TRUE(r.all_ok()) << r.summary();
  std::vector<std::string> args = {"hang"};
  for (const std::string& f : files_in(dir.path, ".flight")) args.push_back(f);
  ASSERT_EQ(args.size(), 5u);
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 0) << out;
  EXPECT_NE(out.find("no hang seen: 4 ranks issued 31 collectives each, ended"), std::string::npos)
      << out;
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_NE(out.find("rank " + std::to_string(rank) +
                       ": issued 31, returned from 31, completed 31 collectives; last call #30 "),
              std::string::npos)
        << out;
  EXPECT_EQ(out.find("not completed"), std::string::npos) << out;
  args.insert(args.begin() + 1, "--json");
  EXPECT_EQ(run_tool(args, &out), 0) << out;
  size_t watched = 0;
  for (size_t at = 0; (at = out.find("\"completion\":\"return\",\"reached\":31,\"completed\":31",
                                     at)) != std::string::npos;
       ++at)
    ++watched;
  EXPECT_EQ(watched, 4u) << out;
}

// A stalled rank: the others wait inside their last call, which neither returned nor completed.
TEST(FlightRecorder, CompletionShowsTheWaitingRanksLastCallNotCompleted) {
  TempDir dir;
  const support::LaunchResult r = hang_fsdp(
      dir.path, {"--stall-rank", "2", "--stall-step", std::to_string(kStep), "--stall-s", "60"},
      {{"MAGI_FLIGHT_RECORDER_COMPLETION", "1"}}, 4);
  ASSERT_TRUE(r.timed_out) << r.summary();
  std::vector<std::string> args = {"hang"};
  for (const std::string& f : files_in(dir.path, ".flight")) args.push_back(f);
  ASSERT_EQ(args.size(), 5u);
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  const std::string verdict = out.substr(0, out.find('\n'));
  EXPECT_NE(verdict.find("rank 2 never issued collective #" + std::to_string(kCollective)),
            std::string::npos)
      << out;
  const std::string issued = std::to_string(kCollective + 1);
  const std::string done = std::to_string(kCollective);
  for (int rank : {0, 1, 3}) {
    const size_t at =
        out.find("rank " + std::to_string(rank) + ": issued " + issued + ", returned from " + done +
                 ", completed " + done + " collectives; last call #" + done + " AllGather");
    ASSERT_NE(at, std::string::npos) << out;
    const std::string line = out.substr(at, out.find('\n', at) - at);
    EXPECT_NE(line.find(", not returned, not reached"), std::string::npos) << line;
  }
  EXPECT_NE(out.find("rank 2: issued " + done + ", returned from " + done + ", completed " + done +
                     " collectives; last call #" + std::to_string(kCollective - 1) + " AllReduce"),
            std::string::npos)
      << out;
}

// The stand-in blocks on a mismatch as NCCL does; the launcher then kills every rank. Rank 1
// gathers one element less (count) or all-reduces instead (op).
class HangDivergence : public testing::TestWithParam<const char*> {};

TEST_P(HangDivergence, NamesTheFirstCollectiveTheRanksIssuedDifferently) {
  const std::string kind = GetParam();
  TempDir dir;
  const support::LaunchResult r = hang_fsdp(
      dir.path,
      {"--diverge-rank", "1", "--diverge-step", std::to_string(kStep), "--diverge-kind", kind},
      {{"STANDIN_MISMATCH", "block"}}, 4);
  ASSERT_TRUE(r.timed_out) << r.summary();
  std::vector<std::string> args = {"hang"};
  for (const std::string& f : files_in(dir.path, ".flight")) args.push_back(f);
  ASSERT_EQ(args.size(), 5u);
  std::string out;
  EXPECT_EQ(run_tool(args, &out), 1) << out;
  const std::string verdict = out.substr(0, out.find('\n'));
  EXPECT_NE(verdict.find("the ranks issued different collectives at collective #" +
                         std::to_string(kCollective) + ": "),
            std::string::npos)
      << out;
  EXPECT_NE(
      verdict.find(kind == "op" ? "rank 1 AllReduce float32 x " : "rank 1 AllGather float32 x "),
      std::string::npos)
      << out;
  EXPECT_NE(verdict.find("ranks 0,2,3 AllGather float32 x "), std::string::npos) << out;
}

INSTANTIATE_TEST_SUITE_P(FlightRecorder, HangDivergence, testing::Values("count", "op"));

// MAGI_DUMP_SIGNAL=USR2 while ranks wait for a stalled one: each rank's trace holds its calls up
// to the wait (the trace buffer is far from full, so nothing else would write it), and the
// ranks run on (the signal does not stop them; the launcher kills them later).
TEST(FlightRecorder, TheDumpSignalWritesOutTheTraceOfRanksThatWait) {
  TempDir dir;
  TempDir traces;
  std::atomic<bool> signalled{false};
  std::map<std::string, size_t> calls_after_dump;
  std::thread asker([&] {
    // The ranks' trace files appear at their first record; their pids are in the names.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    std::vector<std::string> files;
    while (std::chrono::steady_clock::now() < deadline) {
      files = files_in(traces.path, ".trace");
      if (files.size() == 4) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    if (files.size() != 4) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // they wait by now
    for (const std::string& f : files) {
      const std::string name = fs::path(f).filename().string();  // magice.HOST.PID.trace
      const std::string stem = name.substr(0, name.size() - 6);
      const int pid = std::atoi(stem.substr(stem.rfind('.') + 1).c_str());
      if (pid > 0) ::kill(pid, SIGUSR2);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(700));
    for (const std::string& f : files) calls_after_dump[f] = trace::read_trace(f).calls.size();
    signalled = true;
  });
  const support::LaunchResult r = hang_fsdp(
      dir.path, {"--stall-rank", "2", "--stall-step", std::to_string(kStep), "--stall-s", "60"},
      {{"MAGI_TRACE_DIR", traces.path}, {"MAGI_DUMP_SIGNAL", "USR2"}}, 5);
  asker.join();
  ASSERT_TRUE(signalled.load()) << r.summary();
  ASSERT_TRUE(r.timed_out) << r.summary();
  for (const auto& rank : r.ranks) EXPECT_EQ(rank.signal, SIGKILL) << r.summary();
  ASSERT_EQ(calls_after_dump.size(), 4u);
  // Every rank returned from collectives #0..#(kCollective-1) before the wait: each is a call
  // record in the trace (the waiting call itself is recorded when it returns, so it is not).
  for (const auto& [file, calls] : calls_after_dump)
    EXPECT_EQ(calls, static_cast<size_t>(kCollective)) << file;
}

}  // namespace
}  // namespace magi
