// The NCCL stand-in, the launcher and the workloads, run as real processes (no shim): the
// stand-in must implement NCCL's definitions, block like NCCL when ranks disagree, and leave
// nothing behind in /dev/shm. Every launch has a timeout, so a hang fails instead of stalling.
#include <dirent.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/launch.h"
#include "tests/support/workload/arena_name.h"

namespace {

std::string build_dir() {
  const char* dir = std::getenv("TEST_BUILD_DIR");
  return dir != nullptr && *dir != '\0' ? dir : "build";
}

std::string support_binary(const std::string& name) {
  return build_dir() + "/tests/support/" + name;
}

// Names this test process's segments, so concurrent runs of other tests do not interfere.
std::string shm_tag() { return "T" + std::to_string(::getpid()); }

std::vector<std::string> segments_named(const std::string& tag) {
  std::vector<std::string> found;
  const std::string prefix = "magi-standin-" + tag + "-";
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) found.emplace_back(e->d_name);
    }
    ::closedir(d);
  }
  return found;
}

// In one read of the stream's buffer: a character at a time takes seconds per result file under
// a sanitizer.
std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

// A temporary directory, removed with its files.
class ScratchDir {
 public:
  ScratchDir() {
    std::string pattern = "/tmp/standin-test-XXXXXX";
    path_ = ::mkdtemp(pattern.data()) ? pattern : "";
  }
  ~ScratchDir() {
    if (DIR* d = ::opendir(path_.c_str())) {
      while (dirent* e = ::readdir(d)) ::unlink((path_ + "/" + e->d_name).c_str());
      ::closedir(d);
    }
    ::rmdir(path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The launch summary and every rank's stderr: what a failed expectation should show.
std::string transcript(const LaunchResult& r) {
  std::string text = r.summary() + "\n";
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    if (!r.ranks[i].stderr_text.empty()) {
      text += "--- rank " + std::to_string(i) + " stderr:\n" + r.ranks[i].stderr_text;
    }
  }
  return text;
}

bool every_rank_said(const LaunchResult& r, const std::string& needle) {
  for (const auto& rank : r.ranks) {
    if (rank.stderr_text.find(needle) == std::string::npos) return false;
  }
  return !r.ranks.empty();
}

class StandInTest : public ::testing::Test {
 protected:
  LaunchResult run(int nranks, std::vector<std::string> argv,
                   std::vector<std::pair<std::string, std::string>> env = {},
                   double timeout_s = 60) {
    env.emplace_back("STANDIN_SHM_TAG", shm_tag());
    LaunchSpec spec;
    spec.nranks = nranks;
    spec.argv = std::move(argv);
    spec.env = std::move(env);
    spec.timeout_s = timeout_s;
    spec.capture_output = true;
    return launch(spec);
  }

  LaunchResult run_workload(int nranks, std::vector<std::string> args,
                            std::vector<std::pair<std::string, std::string>> env = {},
                            double timeout_s = 60) {
    args.insert(args.begin(), support_binary("magi-workload"));
    return run(nranks, std::move(args), std::move(env), timeout_s);
  }

  // Whatever a test did, finished or killed, its segments must be gone.
  void TearDown() override {
    const auto left = segments_named(shm_tag());
    EXPECT_TRUE(left.empty()) << "left in /dev/shm: " << left.front();
  }
};

class StandInRanks : public StandInTest, public ::testing::WithParamInterface<int> {};

TEST_P(StandInRanks, OpsScenarioMatchesNcclDefinitionsForEveryTypeAndReduction) {
  ScratchDir out;
  const LaunchResult r = run_workload(GetParam(), {"ops", "--out", out.path()});
  ASSERT_TRUE(r.all_ok()) << transcript(r);
  for (int rank = 0; rank < GetParam(); ++rank) {
    EXPECT_FALSE(read_file(out.path() + "/rank" + std::to_string(rank) + ".bin").empty())
        << "rank " << rank << " wrote no results";
  }
}

TEST_P(StandInRanks, FsdpLoopWithGroupedGathersRuns) {
  const LaunchResult r = run_workload(GetParam(), {"fsdp", "--layers", "5", "--steps", "6"});
  EXPECT_TRUE(r.all_ok()) << transcript(r);
}

TEST_P(StandInRanks, SplitAndShrinkGiveNcclRankOrder) {
  const LaunchResult r = run_workload(GetParam(), {"split"});
  EXPECT_TRUE(r.all_ok()) << transcript(r);
}

TEST_P(StandInRanks, InitAllCommunicatorsAreDrivenFromOneThreadInGroups) {
  const LaunchResult r = run_workload(1, {"initall", "--ndev", std::to_string(GetParam())});
  EXPECT_TRUE(r.all_ok()) << transcript(r);
}

// Like NCCL, every rank says its mismatch and then stays inside the call. The ranks are killed
// once every one has said it and has stood still a moment more: a call that came back would have
// said so ("returned", written right after the mismatch line) or ended its rank by then. A rank
// that ends on its own, or ranks that never all say it within the limit, fail the test.
TEST_P(StandInRanks, CountDivergenceBlocksLikeNccl) {
  LaunchSpec spec;
  spec.nranks = GetParam();
  spec.argv = {support_binary("magi-workload"), "fsdp", "--layers", "3", "--steps", "4"};
  for (const char* arg : {"--diverge-rank", "1", "--diverge-step", "2", "--diverge-kind", "count"})
    spec.argv.emplace_back(arg);
  spec.env = {{"STANDIN_SHM_TAG", shm_tag()}};
  spec.capture_output = true;
  spec.hang_expected = true;
  spec.timeout_s = 60;  // long enough for 8 ranks under a sanitizer beside the other suites
  using Clock = std::chrono::steady_clock;
  const auto still = std::chrono::duration<double>(0.5 * magi::support::timeout_scale());
  std::optional<Clock::time_point> all_said;
  spec.hung = [&](const LaunchResult& so_far) {
    for (const auto& rank : so_far.ranks) {
      if (rank.exit_code != -1 || rank.signal != 0) return false;  // it left the call
    }
    if (!every_rank_said(so_far, "mismatch")) return false;
    if (!all_said) all_said = Clock::now();
    return Clock::now() - *all_said >= still;
  };
  const LaunchResult r = launch(spec);
  ASSERT_TRUE(r.hung) << transcript(r);
  EXPECT_TRUE(every_rank_said(r, "mismatch")) << transcript(r);
  for (size_t rank = 0; rank < r.ranks.size(); ++rank) {
    EXPECT_EQ(r.ranks[rank].signal, SIGKILL) << "rank " << rank << "\n" << transcript(r);
    EXPECT_EQ(r.ranks[rank].stderr_text.find("returned"), std::string::npos)
        << "rank " << rank << "'s call came back\n"
        << transcript(r);
  }
}

TEST_P(StandInRanks, CountDivergenceFailsTheCallOnEveryRankUnderMismatchError) {
  const LaunchResult r = run_workload(GetParam(),
                                      {"fsdp", "--layers", "3", "--steps", "4", "--diverge-rank",
                                       "1", "--diverge-step", "2", "--diverge-kind", "count"},
                                      {{"STANDIN_MISMATCH", "error"}});
  // The later steps' gathers are checked by the workload: the communicator still works.
  ASSERT_TRUE(r.all_ok()) << transcript(r);
  EXPECT_TRUE(every_rank_said(r, "collective #")) << transcript(r);
  EXPECT_TRUE(every_rank_said(r, "ncclAllGather returned 5")) << transcript(r);
}

TEST_P(StandInRanks, CallsiteDivergenceKeepsTheSameShapeSoNcclSeesNothing) {
  const LaunchResult r =
      run_workload(GetParam(), {"fsdp", "--layers", "3", "--steps", "4", "--diverge-rank", "1",
                                "--diverge-step", "2", "--diverge-kind", "callsite"});
  ASSERT_TRUE(r.all_ok()) << transcript(r);
  for (const auto& rank : r.ranks) EXPECT_EQ(rank.stderr_text, "");
}

// The file the weights scenario keeps its shards in with --arena 1 (arena_name.h: it carries the
// tag these tests give their ranks).
bool arena_file_left(const RankResult& rank) {
  const std::string file = "/dev/shm/" + workload::arena_file_name(shm_tag(), rank.pid);
  return ::access(file.c_str(), F_OK) == 0;
}

TEST_P(StandInRanks, WeightsProgramsWithShardsInOneSharedFileAreByteExactAndRemoveTheFile) {
  for (const std::vector<std::string>& program :
       {std::vector<std::string>{"--program", "reused"},
        {"--program", "swap", "--swap-step", "4"},
        {"--program", "alternate", "--swap-step", "3"},
        {"--program", "rehome", "--rehome-step", "4"},
        {"--program", "rehome", "--rehome-step", "4", "--rehome-other", "1"}}) {
    std::vector<std::string> args = {"weights", "--layers", "4", "--steps", "8", "--arena", "1"};
    args.insert(args.end(), program.begin(), program.end());
    const LaunchResult r = run_workload(GetParam(), args);
    ASSERT_TRUE(r.all_ok()) << program[1] << "\n" << transcript(r);
    for (const auto& rank : r.ranks) EXPECT_FALSE(arena_file_left(rank)) << program[1];
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, StandInRanks, ::testing::Values(2, 3, 4, 8));

TEST_F(StandInTest, WeightsArenaFileIsRemovedWhenTheScenarioFails) {
  // The only rank of a communicator of 2 gives up waiting for the other, after its shards are
  // in the file: the scenario fails, and the file goes with it.
  const LaunchResult r =
      run_workload(1, {"weights", "--layers", "4", "--steps", "2", "--arena", "1"},
                   {{"STANDIN_NRANKS", "2"}, {"STANDIN_TIMEOUT_S", "1"}}, 30.0);
  ASSERT_FALSE(r.timed_out) << transcript(r);
  EXPECT_EQ(r.ranks.at(0).exit_code, 1) << transcript(r);
  EXPECT_NE(r.ranks[0].stderr_text.find("giving up (STANDIN_TIMEOUT_S)"), std::string::npos)
      << transcript(r);
  EXPECT_FALSE(arena_file_left(r.ranks[0]));
}

TEST_F(StandInTest, ChunkedTransfersGiveTheSameBytesAsWholeOnes) {
  ScratchDir whole, chunked;
  const LaunchResult a = run_workload(3, {"ops", "--out", whole.path()});
  const LaunchResult b =
      run_workload(3, {"ops", "--out", chunked.path()}, {{"STANDIN_SLOT_KIB", "1"}});
  ASSERT_TRUE(a.all_ok()) << transcript(a);
  ASSERT_TRUE(b.all_ok()) << transcript(b);
  for (int rank = 0; rank < 3; ++rank) {
    const std::string file = "/rank" + std::to_string(rank) + ".bin";
    EXPECT_TRUE(read_file(whole.path() + file) == read_file(chunked.path() + file))
        << "rank " << rank << " results differ between slot sizes";
  }
}

TEST_F(StandInTest, RtldLocalLoadingGivesTheSameResults) {
  ScratchDir global, local;
  const LaunchResult a = run_workload(2, {"ops", "--out", global.path()});
  const LaunchResult b =
      run(2, {support_binary("magi-workload-local"), "ops", "--out", local.path()});
  ASSERT_TRUE(a.all_ok()) << transcript(a);
  ASSERT_TRUE(b.all_ok()) << transcript(b);
  EXPECT_TRUE(read_file(global.path() + "/rank1.bin") == read_file(local.path() + "/rank1.bin"));
}

TEST_F(StandInTest, TimeoutTurnsABlockedCollectiveIntoSystemError) {
  const LaunchResult r = run_workload(2,
                                      {"fsdp", "--layers", "3", "--steps", "4", "--diverge-rank",
                                       "0", "--diverge-step", "1", "--diverge-kind", "count"},
                                      {{"STANDIN_TIMEOUT_S", "1"}}, 30.0);
  ASSERT_FALSE(r.timed_out) << transcript(r);
  EXPECT_TRUE(every_rank_said(r, "giving up (STANDIN_TIMEOUT_S)")) << transcript(r);
  EXPECT_TRUE(every_rank_said(r, "ncclAllGather returned 2")) << transcript(r);
}

TEST_F(StandInTest, PeerThatExitedEndsTheWaitWithRemoteError) {
  // Rank 1 stops after one step; the others wait for it in the next one and must not hang.
  const LaunchResult r = run(3,
                             {"/bin/sh", "-c",
                              "if [ \"$STANDIN_RANK\" = 1 ]; then steps=1; else steps=4; fi; "
                              "exec \"$0\" fsdp --layers 3 --steps $steps",
                              support_binary("magi-workload")},
                             {}, 30.0);
  ASSERT_FALSE(r.timed_out) << transcript(r);
  EXPECT_EQ(r.ranks.at(1).exit_code, 0) << transcript(r);
  for (int rank : {0, 2}) {
    EXPECT_EQ(r.ranks.at(rank).exit_code, 1) << transcript(r);
    EXPECT_NE(r.ranks[rank].stderr_text.find("rank 1 exited while"), std::string::npos)
        << transcript(r);
  }
}

TEST_F(StandInTest, ProcessWithoutNcclFindsNoAllReduce) {
  const LaunchResult none = run(1, {support_binary("magi-workload-local"), "--no-nccl"});
  EXPECT_EQ(none.ranks.at(0).exit_code, 3) << transcript(none);
  EXPECT_NE(none.ranks[0].stderr_text.find("no ncclAllReduce in the process"), std::string::npos);

  // A sanitizer build names its runtime in TEST_PRELOAD_FIRST: it must be loaded first.
  const char* first = std::getenv("TEST_PRELOAD_FIRST");
  const std::string preload = (first != nullptr && *first != '\0' ? std::string(first) + " " : "") +
                              support_binary("libnccl.so.2");
  const LaunchResult preloaded =
      run(1, {support_binary("magi-workload-local"), "--no-nccl"}, {{"LD_PRELOAD", preload}});
  EXPECT_EQ(preloaded.ranks.at(0).exit_code, 0) << transcript(preloaded);
}

TEST(MagiLaunch, TimeoutRemovesSegmentsOfRanksThatNeverAllJoined) {
  // Both ranks believe in a third that never comes, so the segment is never complete and its
  // name stays until the launcher cleans up after killing them: they are killed once it is there.
  LaunchSpec spec;
  spec.nranks = 2;
  spec.argv = {"/bin/sh", "-c", "STANDIN_NRANKS=3 exec \"$0\" split",
               support_binary("magi-workload")};
  spec.hung = [](const LaunchResult& so_far) { return !segments_named(so_far.shm_tag).empty(); };
  spec.timeout_s = 30;
  spec.hang_expected = true;
  spec.capture_output = true;
  const LaunchResult r = launch(spec);
  EXPECT_TRUE(r.hung) << transcript(r);
  ASSERT_FALSE(r.shm_tag.empty());
  EXPECT_TRUE(segments_named(r.shm_tag).empty());
}

// A rank killed by a signal cannot unlink its arena's file; the file carries the launch's tag
// (arena_name.h), so the launcher removes it with the segments. The rank believes in a peer that
// never comes and waits with its shards in the file; it is killed once the file is there.
TEST(LaunchLibrary, AKilledRanksArenaFileIsRemovedByTheLauncher) {
  LaunchSpec spec;
  spec.nranks = 1;
  spec.argv = {"/bin/sh", "-c", "STANDIN_NRANKS=2 exec \"$0\" weights --layers 4 --arena 1",
               support_binary("magi-workload")};
  std::string file;
  spec.hung = [&file](const LaunchResult& so_far) {
    file = "/dev/shm/" + workload::arena_file_name(so_far.shm_tag, so_far.ranks.at(0).pid);
    return ::access(file.c_str(), F_OK) == 0;
  };
  spec.hang_expected = true;
  spec.timeout_s = 30;
  spec.capture_output = true;
  const LaunchResult r = launch(spec);
  ASSERT_TRUE(r.hung) << transcript(r);
  EXPECT_EQ(r.ranks.at(0).signal, SIGKILL) << transcript(r);
  EXPECT_NE(::access(file.c_str(), F_OK), 0) << file << " is left behind";
}

TEST(MagiLaunch, ExitStatusSaysAllOkSomeFailedOrTimedOut) {
  auto magi_launch = [](std::vector<std::string> args) {
    args.insert(args.begin(), support_binary("magi-launch"));
    LaunchSpec spec;
    spec.argv = std::move(args);
    spec.timeout_s = 30;
    spec.capture_output = true;
    return launch(spec).ranks.at(0);
  };
  EXPECT_EQ(magi_launch({"-n", "2", "--", "/bin/true"}).exit_code, 0);

  const RankResult failed = magi_launch({"-n", "3", "--", "/bin/sh", "-c", "exit $STANDIN_RANK"});
  EXPECT_EQ(failed.exit_code, 1);
  EXPECT_NE(failed.stderr_text.find("rank 2 exited 2"), std::string::npos) << failed.stderr_text;

  const RankResult timed_out =
      magi_launch({"-n", "2", "--timeout", "0.5", "--", "/bin/sleep", "30"});
  EXPECT_EQ(timed_out.exit_code, 124);
  EXPECT_NE(timed_out.stderr_text.find("timed out"), std::string::npos) << timed_out.stderr_text;
}

TEST(LaunchLibrary, EachRankGetsItsRankTheRankCountAndTheExtraEnvironment) {
  LaunchSpec spec;
  spec.nranks = 3;
  spec.argv = {"/bin/sh", "-c", "echo \"$STANDIN_RANK/$STANDIN_NRANKS $COLOR\"; echo oops >&2"};
  spec.env = {{"COLOR", "blue"}};
  spec.timeout_s = 30;
  spec.capture_output = true;
  const LaunchResult r = launch(spec);
  ASSERT_TRUE(r.all_ok()) << transcript(r);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(r.ranks[rank].stdout_text, std::to_string(rank) + "/3 blue\n");
    EXPECT_EQ(r.ranks[rank].stderr_text, "oops\n");
  }
}

// A process the ranks started must die with them: else a hung workload outlives its test.
TEST(LaunchLibrary, TimeoutKillsWhatTheRanksStarted) {
  LaunchSpec spec;
  spec.nranks = 1;
  spec.argv = {"/bin/sh", "-c", "sleep 30 & echo $!; wait"};
  // Killed once it has said its child's pid (then it only waits).
  spec.hung = [](const LaunchResult& so_far) {
    return so_far.ranks.at(0).stdout_text.find('\n') != std::string::npos;
  };
  spec.timeout_s = 30;
  spec.hang_expected = true;
  spec.capture_output = true;
  const LaunchResult r = launch(spec);
  ASSERT_TRUE(r.hung) << transcript(r);
  const pid_t grandchild = std::atoi(r.ranks.at(0).stdout_text.c_str());
  ASSERT_GT(grandchild, 0) << r.ranks[0].stdout_text;
  // Dead means gone, or a zombie nobody has reaped yet.
  bool dead = false;
  for (int i = 0; i < 200 && !dead; ++i) {
    const std::string stat = read_file("/proc/" + std::to_string(grandchild) + "/stat");
    const size_t close_paren = stat.rfind(')');
    dead = (::kill(grandchild, 0) != 0 && errno == ESRCH) ||
           (close_paren != std::string::npos && stat.compare(close_paren + 2, 1, "Z") == 0);
    if (!dead) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(dead) << "pid " << grandchild << " survived the launch";
}

}  // namespace
