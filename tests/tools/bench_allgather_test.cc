// The all-gather benchmark's arithmetic (tools/bench/allgather_plan.h) and the barrier its ranks
// share (tools/bench/rank_barrier.h): nccl-tests' sizes and shifts, the FSDP-like pool.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/tool_run.h"
#include "tools/bench/allgather_plan.h"
#include "tools/bench/rank_barrier.h"

namespace magi::bench {
namespace {

TEST(AllgatherPlan, ParsesSizesAsNcclTestsDoes) {
  EXPECT_EQ(parse_size("4096"), 4096u);
  EXPECT_EQ(parse_size("4K"), 4096u);
  EXPECT_EQ(parse_size("4k"), 4096u);
  EXPECT_EQ(parse_size("256M"), 256u << 20);
  EXPECT_EQ(parse_size("1G"), size_t{1} << 30);
  EXPECT_FALSE(parse_size(""));
  EXPECT_FALSE(parse_size("K"));
  EXPECT_FALSE(parse_size("4KB"));
  EXPECT_FALSE(parse_size("-4K"));
}

TEST(AllgatherPlan, VisitsSizesByTheFactorUpToTheLargest) {
  EXPECT_EQ(size_sequence(4096, 256u << 20, 4),
            (std::vector<size_t>{4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20,
                                 256 << 20}));
  EXPECT_EQ(size_sequence(4096, 20000, 4), (std::vector<size_t>{4096, 16384}));
  EXPECT_EQ(size_sequence(4096, 4096, 1), (std::vector<size_t>{4096}));
  EXPECT_TRUE(size_sequence(8192, 4096, 2).empty());
  EXPECT_TRUE(size_sequence(4096, 8192, 1).empty());
  // A factor that would overflow past the largest size ends the list instead.
  EXPECT_EQ(size_sequence(size_t{1} << 62, SIZE_MAX, 4), (std::vector<size_t>{size_t{1} << 62}));
}

TEST(AllgatherPlan, SplitsTheMessageEvenlyOverTheRanks) {
  const GatherLayout l = gather_layout(4096, 4, 8);
  EXPECT_EQ(l.count, 128u);
  EXPECT_EQ(l.send_bytes, 512u);
  EXPECT_EQ(l.recv_bytes, 4096u);
  // What does not divide is dropped, as nccl-tests' count / nranks drops it.
  const GatherLayout odd = gather_layout(4096, 4, 3);
  EXPECT_EQ(odd.count, 341u);
  EXPECT_EQ(odd.recv_bytes, 341u * 4 * 3);
}

TEST(AllgatherPlan, ShiftsEachCallByOneMessageUntilTheBufferIsFull) {
  const size_t max = 16 << 20;
  const GatherLayout small = gather_layout(4096, 4, 2);
  EXPECT_EQ(call_shift(small, max, 0), 0u);
  EXPECT_EQ(call_shift(small, max, 1), 4096u);
  EXPECT_EQ(call_shift(small, max, 39), 39u * 4096);
  EXPECT_EQ(distinct_buffers(small, max, 40), 40u);
  // 4 MiB messages: four fit in 16 MiB, so call 4 is back at the start.
  const GatherLayout large = gather_layout(4 << 20, 4, 2);
  EXPECT_EQ(call_shift(large, max, 3), 3u << 20 << 2);
  EXPECT_EQ(call_shift(large, max, 4), 0u);
  EXPECT_EQ(distinct_buffers(large, max, 40), 4u);
  // The largest size never shifts: every call has the same buffers.
  const GatherLayout largest = gather_layout(max, 4, 2);
  for (int iter = 0; iter < 5; ++iter) EXPECT_EQ(call_shift(largest, max, iter), 0u);
  EXPECT_EQ(distinct_buffers(largest, max, 40), 1u);
}

TEST(AllgatherPlan, EveryShiftedCallStaysInsideItsBuffers) {
  const size_t max = 16 << 20;
  for (const int nranks : {1, 2, 3, 8}) {
    for (const size_t size : size_sequence(4096, max, 4)) {
      const GatherLayout l = gather_layout(size, 4, nranks);
      for (int iter = 0; iter < 100; ++iter) {
        for (const bool in_place : {false, true}) {
          const CallBuffers b = call_buffers(l, max, iter, nranks - 1, in_place);
          EXPECT_LE(b.recv_offset + l.recv_bytes, max);
          EXPECT_LE(b.send_offset + l.send_bytes, max);
        }
      }
    }
  }
}

TEST(AllgatherPlan, InPlaceSendsThisRanksPartOfTheShiftedReceiveBuffer) {
  const size_t max = 1 << 20;
  const GatherLayout l = gather_layout(65536, 4, 4);
  const CallBuffers oop = call_buffers(l, max, 3, 2, false);
  EXPECT_FALSE(oop.send_in_recv);
  EXPECT_EQ(oop.send_offset, 3u * 65536);
  EXPECT_EQ(oop.recv_offset, 3u * 65536);
  const CallBuffers ip = call_buffers(l, max, 3, 2, true);
  EXPECT_TRUE(ip.send_in_recv);
  EXPECT_EQ(ip.recv_offset, 3u * 65536);
  EXPECT_EQ(ip.send_offset, 3u * 65536 + 2 * l.send_bytes);
}

TEST(AllgatherPlan, FsdpLayersAreAnEmbeddingIdenticalBlocksAndAHead) {
  EXPECT_EQ(fsdp_shard_bytes(4, 1024), (std::vector<size_t>{2048, 1024, 1024, 1536}));
  EXPECT_EQ(fsdp_shard_bytes(1, 1024), (std::vector<size_t>{2048}));
}

TEST(AllgatherPlan, PoolBuffersDifferFromOneStepToTheNextAndNeverOverlapInAStep) {
  const std::vector<size_t> shards = fsdp_shard_bytes(5, 4000);
  for (const bool in_place : {true, false}) {
    const int nranks = 4, rank = 3, frames = 3;
    const PoolLayout pool = pool_layout(shards, nranks, rank, in_place, frames);
    ASSERT_EQ(pool.layers.size(), shards.size());
    EXPECT_EQ(pool.total_bytes(), 3 * pool.frame_bytes);
    for (int step = 1; step < 10; ++step) {
      EXPECT_NE(pool.frame_offset(step), pool.frame_offset(step - 1));
      EXPECT_EQ(pool.frame_offset(step), pool.frame_offset(step + frames));
      EXPECT_LE(pool.frame_offset(step) + pool.frame_bytes, pool.total_bytes());
    }
    // Within a frame the outputs follow each other, aligned; the copy-in buffer is this rank's
    // part of the output (in place) or lies apart from every output.
    size_t end = 0;
    for (size_t l = 0; l < shards.size(); ++l) {
      const PoolLayout::Layer& layer = pool.layers[l];
      EXPECT_EQ(layer.output % kPoolAlignment, 0u);
      EXPECT_GE(layer.output, end);
      if (in_place) {
        EXPECT_EQ(layer.copy_in, layer.output + shards[l] * rank);
      } else {
        EXPECT_EQ(layer.copy_in % kPoolAlignment, 0u);
        EXPECT_GE(layer.copy_in, end);
        EXPECT_LE(layer.copy_in + shards[l], layer.output);
      }
      end = layer.output + shards[l] * nranks;
    }
    EXPECT_LE(end, pool.frame_bytes);
  }
}

// Ranks are processes: each of 4 forks arrives at the barrier at a different time and records,
// in memory they all share, how many had arrived when it left. None may leave early.
TEST(RankBarrier, NoRankLeavesBeforeEveryRankArrivedAndSumsAreEveryRanks) {
  test::TempDir dir;
  const std::string path = dir.path + "/barrier";
  constexpr int kRanks = 4, kRounds = 20;
  auto* arrivals = static_cast<std::atomic<int>*>(mmap(nullptr, sizeof(std::atomic<int>) * 2,
                                                       PROT_READ | PROT_WRITE,
                                                       MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(arrivals, MAP_FAILED);
  new (&arrivals[0]) std::atomic<int>(0);  // arrivals so far
  new (&arrivals[1]) std::atomic<int>(0);  // departures that saw fewer than all arrived
  std::vector<pid_t> children;
  for (int rank = 0; rank < kRanks; ++rank) {
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int status = 0;
      try {
        RankBarrier barrier(path, rank, kRanks);
        for (int round = 0; round < kRounds; ++round) {
          std::this_thread::sleep_for(std::chrono::microseconds(200 * ((rank + round) % kRanks)));
          arrivals[0].fetch_add(1);
          barrier.wait();
          if (arrivals[0].load() < (round + 1) * kRanks) arrivals[1].fetch_add(1);
          const double total = barrier.sum(rank + round);
          if (total != kRanks * (kRanks - 1) / 2.0 + kRanks * round) status = 3;
          if (barrier.mean(rank) != (kRanks - 1) / 2.0) status = 4;
        }
      } catch (...) {
        status = 2;
      }
      _exit(status);
    }
    children.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  for (const pid_t pid : children) {
    int status = -1;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        for (const pid_t p : children) kill(p, SIGKILL);
        FAIL() << "a rank is still waiting after 60 s";
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  }
  EXPECT_EQ(arrivals[1].load(), 0) << "ranks left a barrier before every rank arrived";
  munmap(arrivals, sizeof(std::atomic<int>) * 2);
}

TEST(RankBarrier, RefusesARankOutsideTheLaunch) {
  test::TempDir dir;
  EXPECT_THROW(RankBarrier(dir.path + "/b", 2, 2), std::runtime_error);
  EXPECT_THROW(RankBarrier(dir.path + "/b", 0, 0), std::runtime_error);
  EXPECT_THROW(RankBarrier(dir.path + "/missing/b", 0, 1), std::runtime_error);
}

}  // namespace
}  // namespace magi::bench
