// The flight recorder and `magice-trace hang` on real ranks of the stand-in under the shim: ranks
// made to hang are SIGKILLed by the launcher once their recorder files show them where the test
// wants them (however slow the machine), and the report, read from the files the killed
// processes left, must name the rank and the collective. And the dump signal writes out a
// live, waiting rank's trace.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "capture/flight_recorder.h"
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

support::LaunchSpec fsdp_spec(
    const std::string& dir, std::vector<std::string> extra,
    std::vector<std::pair<std::string, std::string>> env, double timeout_s,
    std::vector<std::vector<std::pair<std::string, std::string>>> rank_env = {}) {
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
  spec.capture_output = true;
  return spec;
}

support::LaunchResult run_fsdp(
    const std::string& dir, std::vector<std::string> extra,
    std::vector<std::pair<std::string, std::string>> env, double timeout_s,
    std::vector<std::vector<std::pair<std::string, std::string>>> rank_env = {}) {
  return support::launch(
      fsdp_spec(dir, std::move(extra), std::move(env), timeout_s, std::move(rank_env)));
}

// Where one rank of the 4-rank world stands, as its recorder file shows it while it runs.
struct Standing {
  uint64_t issued = 0;    // collectives issued
  uint64_t returned = 0;  // the collectives up to the last one that returned
  bool joining = false;   // inside the communicator's init
};
using Standings = std::map<int, Standing>;  // by rank; a rank with no file yet is absent

Standings world_standings(const std::string& dir) {
  Standings out;
  for (const std::string& f : files_in(dir, ".flight")) {
    capture::flight::FileView view;
    try {
      view = capture::flight::read_file(f);
    } catch (const std::exception&) {
      continue;  // its first segment is still being written
    }
    for (const capture::flight::RingView& ring : view.rings) {
      if (ring.header.nranks != 4) continue;  // a split communicator
      Standing& s = out[ring.header.rank];
      s.joining = ring.header.joined == capture::flight::kJoining;
      for (const capture::flight::Record& record : ring.records) {
        s.issued = std::max(s.issued, record.collective);
        if (record.returned == record.seq + 1) s.returned = std::max(s.returned, record.collective);
      }
    }
  }
  return out;
}

// `stalled` stopped after returning from collective #(kCollective - 1); the others issued
// collective #kCollective and wait in it.
std::function<bool(const Standings&)> waiting_for(int stalled) {
  return [stalled](const Standings& ranks) {
    if (ranks.size() != 4) return false;
    for (const auto& [rank, s] : ranks) {
      const bool there = rank == stalled ? s.issued == kCollective && s.returned == kCollective
                                         : s.issued == kCollective + 1;
      if (!there) return false;
    }
    return true;
  };
}

// Every rank issued collective #kCollective (differently, on one rank) and waits in it.
bool all_wait_in_the_divergent_collective(const Standings& ranks) {
  if (ranks.size() != 4) return false;
  for (const auto& [rank, s] : ranks)
    if (s.issued != kCollective + 1) return false;
  return true;
}

// A run the test makes hang: killed once `there` holds of what the ranks' files show, or after
// `timeout_s` (then r.hung is false, and the test fails saying so).
support::LaunchResult hang_fsdp(const std::string& dir, std::vector<std::string> extra,
                                std::vector<std::pair<std::string, std::string>> env,
                                std::function<bool(const Standings&)> there,
                                double timeout_s = 60) {
  support::LaunchSpec spec = fsdp_spec(dir, std::move(extra), std::move(env), timeout_s);
  spec.hang_expected = true;
  spec.hung = [dir, there = std::move(there)](const support::LaunchResult&) {
    return there(world_standings(dir));
  };
  return support::launch(spec);
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
      waiting_for(2));
  ASSERT_TRUE(r.hung) << r.summary();
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
                                            {}, waiting_for(1));
  ASSERT_TRUE(r.hung) << r.summary();
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
      dir.path, {"--stall-rank", "2", "--stall-step", std::to_string(kStep), "--stall-s", "60"},
      {{"MAGI_CALLSITES", "1"}},  // on, whatever the suite's default (TSan's is off, Makefile)
      waiting_for(2));
  ASSERT_TRUE(r.hung) << r.summary();
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
        {{"MAGI_CALLSITES", level}}, waiting_for(2));
    ASSERT_TRUE(r.hung) << r.summary();
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
  const support::LaunchResult r = hang_fsdp(
      dir.path, {"--stall-rank", "2", "--stall-init", "1", "--stall-s", "60"}, {},
      [](const Standings& ranks) {
        return ranks.size() == 3 && !ranks.contains(2) &&
               std::ranges::all_of(ranks, [](const auto& rank) { return rank.second.joining; });
      });
  ASSERT_TRUE(r.hung) << r.summary();
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
      {{"MAGI_FLIGHT_RECORDER_COMPLETION", "1"}}, waiting_for(2));
  ASSERT_TRUE(r.hung) << r.summary();
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
      {{"STANDIN_MISMATCH", "block"}}, all_wait_in_the_divergent_collective);
  ASSERT_TRUE(r.hung) << r.summary();
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
  // Once the ranks wait (their recorder files say so), USR2 to each; then, once every trace
  // holds at least the calls before the wait (or 10 s passed), what each holds.
  std::map<std::string, size_t> calls_after_dump;
  std::optional<std::chrono::steady_clock::time_point> signalled;
  auto dumped = [&](const Standings& ranks) {
    if (!signalled) {
      const std::vector<std::string> files = files_in(traces.path, ".trace");
      if (!waiting_for(2)(ranks) || files.size() != 4) return false;
      for (const std::string& f : files) {
        const std::string name = fs::path(f).filename().string();  // magice.HOST.PID.trace
        const std::string stem = name.substr(0, name.size() - 6);
        const int pid = std::atoi(stem.substr(stem.rfind('.') + 1).c_str());
        if (pid > 0) ::kill(pid, SIGUSR2);
      }
      signalled = std::chrono::steady_clock::now();
      return false;
    }
    calls_after_dump.clear();
    for (const std::string& f : files_in(traces.path, ".trace")) {
      try {
        calls_after_dump[f] = trace::read_trace(f).calls.size();
      } catch (const std::exception&) {
        calls_after_dump[f] = 0;  // being written
      }
    }
    const bool all = std::ranges::all_of(calls_after_dump, [](const auto& file_calls) {
      return file_calls.second >= static_cast<size_t>(kCollective);
    });
    return all || std::chrono::steady_clock::now() - *signalled > std::chrono::seconds(10);
  };
  const support::LaunchResult r = hang_fsdp(
      dir.path, {"--stall-rank", "2", "--stall-step", std::to_string(kStep), "--stall-s", "60"},
      {{"MAGI_TRACE_DIR", traces.path}, {"MAGI_DUMP_SIGNAL", "USR2"}}, dumped);
  ASSERT_TRUE(signalled.has_value()) << r.summary();
  ASSERT_TRUE(r.hung) << r.summary();
  for (const auto& rank : r.ranks) EXPECT_EQ(rank.signal, SIGKILL) << r.summary();
  ASSERT_EQ(calls_after_dump.size(), 4u);
  // Every rank returned from collectives #0..#(kCollective-1) before the wait: each is a call
  // record in the trace (the waiting call itself is recorded when it returns, so it is not).
  for (const auto& [file, calls] : calls_after_dump)
    EXPECT_EQ(calls, static_cast<size_t>(kCollective)) << file;
}

}  // namespace
}  // namespace magi
