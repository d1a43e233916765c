// The agree workload straight over the NCCL stand-in (no shim): every seeded program must run to
// the end with every byte right, draw the same program on every rank, and catch a wrong byte.
// What the shim is later checked against rests on these. Every launch has a timeout.
#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "tests/support/launch.h"

namespace {

std::string workload_binary() {
  const char* dir = std::getenv("TEST_BUILD_DIR");
  return std::string(dir != nullptr && *dir != '\0' ? dir : "build") +
         "/tests/support/magi-workload";
}

// Names this test process's segments, so concurrent runs of other tests do not interfere.
std::string shm_tag() { return "A" + std::to_string(::getpid()); }

bool segments_left(const std::string& tag) {
  bool found = false;
  const std::string prefix = "magi-standin-" + tag + "-";
  if (DIR* d = ::opendir("/dev/shm")) {
    while (dirent* e = ::readdir(d)) found |= std::string(e->d_name).rfind(prefix, 0) == 0;
    ::closedir(d);
  }
  return found;
}

std::string transcript(const LaunchResult& r) {
  std::string text = r.summary() + "\n";
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    if (!r.ranks[i].stderr_text.empty()) {
      text += "--- rank " + std::to_string(i) + " stderr:\n" + r.ranks[i].stderr_text;
    }
  }
  return text;
}

class AgreeScenario : public ::testing::Test {
 protected:
  static LaunchResult agree(int nranks, std::vector<std::string> args, double timeout_s = 30) {
    args.insert(args.begin(), {workload_binary(), "agree"});
    LaunchSpec spec;
    spec.nranks = nranks;
    spec.argv = std::move(args);
    spec.env = {{"STANDIN_SHM_TAG", shm_tag()}};
    spec.timeout_s = timeout_s;
    spec.capture_output = true;
    return launch(spec);
  }

  void TearDown() override {
    EXPECT_FALSE(segments_left(shm_tag())) << "segments left in /dev/shm";
  }
};

// Seeds 1..40 on 2, 3 and 4 ranks, one and two communicators: each run exits 0 on every rank,
// and says nothing but its program (--dump 1), the same line on every rank. Together the seeds
// must draw every perturbation, so none goes untested by accident.
TEST_F(AgreeScenario, EverySeedRunsToTheEndWithEveryByteRightAndTheSameProgramOnEveryRank) {
  std::string programs;
  for (int seed = 1; seed <= 40; ++seed) {
    const int nranks = 2 + seed % 3;
    const std::string comms = seed % 2 == 0 ? "2" : "1";
    const LaunchResult r = agree(
        nranks, {"--seed", std::to_string(seed), "--steps", "8", "--comms", comms, "--dump", "1"});
    ASSERT_FALSE(r.timed_out) << "seed " << seed << ": " << transcript(r);
    ASSERT_TRUE(r.all_ok()) << "seed " << seed << ": " << transcript(r);
    const std::string line = r.ranks.at(0).stderr_text;
    EXPECT_EQ(line.rfind("agree: seed " + std::to_string(seed) + ": prologue [", 0), 0u) << line;
    EXPECT_EQ(line.find('\n'), line.size() - 1) << "more than the program line: " << line;
    EXPECT_EQ(line.find("comm1 step") != std::string::npos, comms == "2") << line;
    for (const RankResult& rank : r.ranks) EXPECT_EQ(rank.stderr_text, line) << "seed " << seed;
    programs += line;
  }
  for (const char* drawn : {"callsite rank", "flap rank", "newbuf rank", "count every rank",
                            "group rank", "comm0 item", "comm1 item", " from step ", "{", " in)",
                            " out)", "ar(int32", "bc(", "rs(int32", "fp8e4m3", "fp8e5m2"}) {
    EXPECT_NE(programs.find(drawn), std::string::npos) << "no seed drew " << drawn;
  }
}

TEST_F(AgreeScenario, SameSeedGivesTheSameProgramOnEveryRunAndOtherSeedsOthers) {
  auto program = [](int seed) {
    const LaunchResult r =
        agree(3, {"--seed", std::to_string(seed), "--steps", "2", "--comms", "2", "--dump", "1"});
    EXPECT_TRUE(r.all_ok()) << transcript(r);
    return r.ranks.at(0).stderr_text;
  };
  const std::string first = program(7);
  EXPECT_FALSE(first.empty());
  EXPECT_EQ(program(7), first);
  std::set<std::string> others;
  for (int seed : {8, 9, 1000003}) others.insert(program(seed));
  EXPECT_EQ(others.size(), 3u);
  EXPECT_EQ(others.count(first), 0u);
}

// A byte flipped on one rank after its step-0 calls (hidden --corrupt-rank) is reported on that
// rank, naming where; the other ranks, left waiting for it, end with an error instead of hanging.
TEST_F(AgreeScenario, PlantedWrongByteIsCaughtAndNamed) {
  for (const char* seed : {"3", "12"}) {
    const LaunchResult r = agree(3, {"--seed", seed, "--steps", "4", "--comms", "2",
                                     "--corrupt-rank", "1", "--corrupt-offset", "1"});
    ASSERT_FALSE(r.timed_out) << transcript(r);
    const RankResult& corrupted = r.ranks.at(1);
    EXPECT_EQ(corrupted.exit_code, 1) << transcript(r);
    EXPECT_NE(corrupted.stderr_text.find("agree: rank 1: step 0 comm0 item "), std::string::npos)
        << transcript(r);
    EXPECT_NE(corrupted.stderr_text.find(": offset 1 (element "), std::string::npos)
        << transcript(r);
    EXPECT_NE(corrupted.stderr_text.find(", expected 0x"), std::string::npos) << transcript(r);
    for (int rank : {0, 2}) EXPECT_NE(r.ranks.at(rank).exit_code, 0) << transcript(r);
  }
}

TEST_F(AgreeScenario, WithoutCorruptionTheSameRunPasses) {
  const LaunchResult r = agree(3, {"--seed", "3", "--steps", "4", "--comms", "2"});
  ASSERT_TRUE(r.all_ok()) << transcript(r);
  for (const RankResult& rank : r.ranks) EXPECT_EQ(rank.stderr_text, "");
}

}  // namespace
