// The round board (ce_transport/round_board.h) across real processes: N forked ranks open the
// board of one identity and run rounds whose every byte is checked; a rank that never comes, one
// that is killed, sizes that differ, a waiter giving up just as the last rank comes; and no board
// name left in /dev/shm afterwards.
//
// Each child reports by its exit status (0: everything it checked held) and writes what it read
// into memory shared from before the fork, which the parent compares across ranks; the parent
// kills every child and fails after a timeout, so a hang fails the test instead of stalling it.
#include "ce_transport/round_board.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <new>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "base/base.h"

#include "tests/support/forked_ranks.h"

namespace magi::ce {
namespace {

using std::chrono::milliseconds;

constexpr int kMaxRanks = 8;
constexpr int kMaxRounds = 400;
constexpr milliseconds kPatient{10'000};  // a deadline no round of a healthy test comes near

// What one rank read in one round.
struct Record {
  std::atomic<int> outcome{0};  // 0: not run; 1: Agreed; 2: Abandoned
  std::atomic<int64_t> elapsed_us{0};
  std::atomic<int64_t> started_us{0};  // steady clock: one clock for every process
  std::atomic<int64_t> ended_us{0};
  char why[120] = {};
};
// What the ranks share: made before the fork, so every child maps the same pages.
struct Shared {
  std::atomic<int> stage{0};
  std::atomic<pid_t> pids[kMaxRanks] = {};
  Record records[kMaxRanks][kMaxRounds];
};

class SharedArea {
 public:
  SharedArea() {
    void* p =
        mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("mmap of the shared area failed");
    shared_ = ::new (p) Shared{};
  }
  ~SharedArea() { munmap(shared_, sizeof(Shared)); }
  Shared& get() { return *shared_; }

 private:
  Shared* shared_;
};

using Outcome = support::ForkedRank;
using RankRun = support::ForkedRun;

// Forks `nranks` children running `body(rank)`, each with its pid in `shared` before it starts;
// the body's return value is the exit status. The rank
// `reap_last` (if >= 0) is reaped only after every other rank has exited, so while the others
// run it stays a zombie once dead, as a child whose parent is busy elsewhere would.
RankRun run_ranks(int nranks, Shared& shared, double timeout_s,
                  const std::function<int(int rank)>& body, int reap_last = -1) {
  return support::run_forked_ranks(
      nranks, timeout_s,
      [&](int r) {
        shared.pids[r].store(getpid());
        return body(r);
      },
      reap_last);
}

void expect_every_rank_succeeded(const RankRun& run) {
  EXPECT_FALSE(run.timed_out) << "a rank hung";
  for (size_t r = 0; r < run.ranks.size(); ++r)
    EXPECT_EQ(run.ranks[r].exit_code, 0)
        << "rank " << r << " (signal " << run.ranks[r].signal << ")";
}

// A communicator identity no other test (nor another run of this one) uses.
uint64_t fresh_identity() {
  std::random_device random;
  return (uint64_t{random()} << 32 | random()) | 1;
}

bool board_file_exists(uint64_t identity) {
  return std::filesystem::exists("/dev/shm/" + board_name(identity));
}

// The bytes rank `rank` contributes to round `round`: different for every rank, round and place.
uint8_t byte_of(int rank, int round, size_t at) {
  const uint64_t mixed = (at + 1) * 0x9e3779b97f4a7c15ull ^ static_cast<uint64_t>(rank) << 40 ^
                         static_cast<uint64_t>(round) << 20;
  return static_cast<uint8_t>(mixed >> 29);
}
std::vector<uint8_t> contribution(int rank, int round, size_t bytes) {
  std::vector<uint8_t> out(bytes);
  for (size_t at = 0; at < bytes; ++at) out[at] = byte_of(rank, round, at);
  return out;
}

// Whether an Agreed round holds every rank's contribution of `bytes`, in rank order.
bool holds_every_contribution(const BoardRound& got, int nranks, int round, size_t bytes) {
  if (got.all.size() != bytes * static_cast<size_t>(nranks)) {
    std::fprintf(stderr, "round %d: %zu bytes, %zu expected\n", round, got.all.size(),
                 bytes * static_cast<size_t>(nranks));
    return false;
  }
  for (int r = 0; r < nranks; ++r)
    for (size_t at = 0; at < bytes; ++at)
      if (got.all[static_cast<size_t>(r) * bytes + at] != byte_of(r, round, at)) {
        std::fprintf(stderr, "round %d: rank %d's byte %zu is wrong\n", round, r, at);
        return false;
      }
  return true;
}

// Runs this rank's exchange and writes what it read into the shared records.
BoardRound exchange_recorded(RoundBoard& board, Shared& shared, int rank, int round,
                             std::span<const uint8_t> mine, milliseconds deadline) {
  const auto us = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
  };
  const auto start = std::chrono::steady_clock::now();
  BoardRound got = board.exchange(mine, deadline);
  const auto end = std::chrono::steady_clock::now();
  Record& record = shared.records[rank][round];
  record.elapsed_us.store(us(end) - us(start));
  record.started_us.store(us(start));
  record.ended_us.store(us(end));
  std::snprintf(record.why, sizeof(record.why), "%s", got.why.c_str());
  record.outcome.store(got.outcome == BoardRound::Outcome::Agreed ? 1 : 2);
  return got;
}

// Waits (bounded) until the shared stage reaches `stage`.
bool wait_for_stage(Shared& shared, int stage) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (shared.stage.load() < stage) {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

// The state letter of `pid` in /proc/<pid>/stat ('R', 'S', 'T', ...); '?' when unreadable.
char process_state(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%ld/stat", static_cast<long>(pid));
  FILE* stat = std::fopen(path, "re");
  if (stat == nullptr) return '?';
  char text[512];
  const size_t n = std::fread(text, 1, sizeof(text) - 1, stat);
  std::fclose(stat);
  text[n] = '\0';
  const char* close_paren = std::strrchr(text, ')');
  return close_paren != nullptr && close_paren[1] == ' ' ? close_paren[2] : '?';
}

// Waits (bounded) until `pid` is seen asleep.
bool wait_until_asleep(pid_t pid) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(15);
  while (process_state(pid) != 'S') {
    if (std::chrono::steady_clock::now() > give_up) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  return true;
}

// ---- every rank present ---------------------------------------------------------------------

// Sizes that change from round to round, from nothing to 100 KiB (a publish of 1,000 shards).
size_t size_of_round(int round) {
  constexpr size_t kSizes[] = {1, 7, 64, 4096, 100'000, 0, 3, 255, 65'536, 33};
  return kSizes[static_cast<size_t>(round) % std::size(kSizes)];
}

void every_round_agrees(int nranks, int rounds) {
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const RankRun run = run_ranks(nranks, shared, 30, [&](int rank) {
    auto board = open_round_board(identity, rank, nranks);
    for (int round = 0; round < rounds; ++round) {
      const size_t bytes = size_of_round(round);
      const std::vector<uint8_t> mine = contribution(rank, round, bytes);
      const BoardRound got = exchange_recorded(*board, shared, rank, round, mine, kPatient);
      if (got.outcome != BoardRound::Outcome::Agreed) {
        std::fprintf(stderr, "rank %d, round %d abandoned: %s\n", rank, round, got.why.c_str());
        return 1;
      }
      if (!holds_every_contribution(got, nranks, round, bytes)) return 1;
      // Every rank joined once a round agreed: the last to join removed the name.
      if (round == 0 && board_file_exists(identity)) {
        std::fprintf(stderr, "rank %d: the board's name is left once every rank joined\n", rank);
        return 1;
      }
    }
    return 0;
  });
  expect_every_rank_succeeded(run);
  EXPECT_FALSE(board_file_exists(identity));
  std::vector<int64_t> times;
  for (int round = 0; round < rounds; ++round)
    times.push_back(shared.records[0][round].elapsed_us.load());
  std::sort(times.begin(), times.end());
  std::printf("[ %d ranks ] round time: median %lld us, 90th percentile %lld us\n", nranks,
              static_cast<long long>(times[times.size() / 2]),
              static_cast<long long>(times[times.size() * 9 / 10]));
}

TEST(RoundBoard, OneRankAgreesWithItself) { every_round_agrees(1, 20); }
TEST(RoundBoard, TwoRanksAgreeOnEveryRoundWithEveryByteInRankOrder) { every_round_agrees(2, 150); }
TEST(RoundBoard, ThreeRanksAgreeOnEveryRoundWithEveryByteInRankOrder) {
  every_round_agrees(3, 120);
}
TEST(RoundBoard, FourRanksAgreeOnEveryRoundWithEveryByteInRankOrder) { every_round_agrees(4, 120); }
TEST(RoundBoard, EightRanksAgreeOnEveryRoundWithEveryByteInRankOrder) {
  every_round_agrees(8, 100);
}

// Two ranks of one process (one thread each, as a program driving two GPUs may have): the same
// rounds, with a deadline so long it must not overflow.
TEST(RoundBoard, TwoRanksOfOneProcessAgreeFromTheirOwnThreads) {
  constexpr int kRanks = 2;
  constexpr int kRounds = 60;
  const uint64_t identity = fresh_identity();
  std::atomic<int> failures{0};
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < kRanks; ++rank)
    ranks.emplace_back([&, rank] {
      auto board = open_round_board(identity, rank, kRanks);
      for (int round = 0; round < kRounds; ++round) {
        const size_t bytes = size_of_round(round);
        const BoardRound got =
            board->exchange(contribution(rank, round, bytes), milliseconds::max());
        if (got.outcome != BoardRound::Outcome::Agreed ||
            !holds_every_contribution(got, kRanks, round, bytes))
          failures.fetch_add(1);
      }
    });
  for (std::thread& rank : ranks) rank.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_FALSE(board_file_exists(identity));
}

TEST(RoundBoard, ContributionsOfFourMebibytesArriveWhole) {
  constexpr int kRanks = 4;
  constexpr int kRounds = 3;
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const RankRun run = run_ranks(kRanks, shared, 30, [&](int rank) {
    auto board = open_round_board(identity, rank, kRanks);
    for (int round = 0; round < kRounds; ++round) {
      const size_t bytes = (size_t{4} << 20) - static_cast<size_t>(round);  // 4 MiB, then less
      const BoardRound got = board->exchange(contribution(rank, round, bytes), kPatient);
      if (got.outcome != BoardRound::Outcome::Agreed) {
        std::fprintf(stderr, "rank %d, round %d abandoned: %s\n", rank, round, got.why.c_str());
        return 1;
      }
      if (!holds_every_contribution(got, kRanks, round, bytes)) return 1;
    }
    return 0;
  });
  expect_every_rank_succeeded(run);
  EXPECT_FALSE(board_file_exists(identity));
}

// ---- rounds that are abandoned --------------------------------------------------------------

// Round 0: rank 2 comes once the others gave up, and reads the decided round. Round 2: it comes
// once the others gave up and went on to round 3, and reads what replaced the round.
TEST(RoundBoard, ARankThatNeverComesLeavesTheOthersAbandonedAtTheirDeadlineAndItselfAtOnce) {
  constexpr int kRanks = 3;
  constexpr int kLate = 2;
  constexpr milliseconds kDeadline{300};
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const auto agreed = [&](const BoardRound& got, int round) {
    return got.outcome == BoardRound::Outcome::Agreed &&
           holds_every_contribution(got, kRanks, round, 8);
  };
  const RankRun run = run_ranks(kRanks, shared, 30, [&](int rank) {
    const bool late = rank == kLate;
    if (late && !wait_for_stage(shared, 2)) return 1;
    auto board = open_round_board(identity, rank, kRanks);
    exchange_recorded(*board, shared, rank, 0, contribution(rank, 0, 8), kDeadline);
    if (late) shared.stage.store(3);
    if (!late) shared.stage.fetch_add(1);
    if (!wait_for_stage(shared, 3)) return 1;
    if (!agreed(exchange_recorded(*board, shared, rank, 1, contribution(rank, 1, 8), kPatient), 1))
      return 1;
    if (late) {
      if (!wait_for_stage(shared, 5)) return 1;
      exchange_recorded(*board, shared, rank, 2, contribution(rank, 2, 8), kPatient);
    } else {
      exchange_recorded(*board, shared, rank, 2, contribution(rank, 2, 8), kDeadline);
      shared.stage.fetch_add(1);
    }
    return agreed(exchange_recorded(*board, shared, rank, 3, contribution(rank, 3, 8), kPatient), 3)
               ? 0
               : 1;
  });
  expect_every_rank_succeeded(run);
  for (const int round : {0, 2}) {
    // The first of the waiting ranks to come reaches its deadline first, and decides for both.
    const int64_t first_deadline_us =
        std::min(shared.records[0][round].started_us.load(),
                 shared.records[1][round].started_us.load()) +
        std::chrono::duration_cast<std::chrono::microseconds>(kDeadline).count();
    for (int rank = 0; rank < kRanks; ++rank) {
      const Record& record = shared.records[rank][round];
      EXPECT_EQ(record.outcome.load(), 2) << "rank " << rank << ", round " << round;
      const std::string why = record.why;
      if (rank == kLate) {
        EXPECT_LT(record.elapsed_us.load(), 100'000) << "the late rank waited for a round over";
        EXPECT_TRUE(why == "rank 2 did not come within rank 0's deadline" ||
                    why == "rank 2 did not come within rank 1's deadline")
            << why;
      } else {
        // The first to reach its deadline decides for both: the other may have started later, so
        // neither gives up before the earlier one's deadline.
        EXPECT_GE(record.ended_us.load(), first_deadline_us) << "rank " << rank << " gave up early";
        EXPECT_LT(record.elapsed_us.load(), 5'000'000) << "rank " << rank;
        EXPECT_NE(why.find("rank 2 did not come within"), std::string::npos) << why;
      }
    }
    EXPECT_GE(std::max(shared.records[0][round].elapsed_us.load(),
                       shared.records[1][round].elapsed_us.load()),
              300'000)
        << "nobody waited until its deadline";
  }
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(shared.records[rank][1].outcome.load(), 1) << "rank " << rank;
    EXPECT_EQ(shared.records[rank][3].outcome.load(), 1) << "rank " << rank;
  }
  EXPECT_FALSE(board_file_exists(identity));
}

TEST(RoundBoard, ARankKilledWhileTheOthersWaitAbandonsTheirRoundLongBeforeTheDeadline) {
  constexpr int kRanks = 3;
  constexpr int kVictim = 2;
  constexpr int kRoundsBefore = 5;
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const RankRun run = run_ranks(
      kRanks, shared, 30,
      [&](int rank) {
        auto board = open_round_board(identity, rank, kRanks);
        for (int round = 0; round < kRoundsBefore; ++round) {
          const BoardRound got = board->exchange(contribution(rank, round, 100), kPatient);
          if (got.outcome != BoardRound::Outcome::Agreed) return 1;
        }
        if (rank == kVictim) {
          std::this_thread::sleep_for(milliseconds(50));  // the others are waiting by now
          raise(SIGKILL);
        }
        const BoardRound got = exchange_recorded(*board, shared, rank, kRoundsBefore,
                                                 contribution(rank, kRoundsBefore, 100), kPatient);
        return got.outcome == BoardRound::Outcome::Abandoned ? 0 : 1;
      },
      kVictim);
  EXPECT_FALSE(run.timed_out);
  EXPECT_EQ(run.ranks[kVictim].signal, SIGKILL);
  const std::string gone = "rank 2 (pid " + std::to_string(run.ranks[kVictim].pid) + ") is gone";
  for (int rank = 0; rank < kRanks; ++rank) {
    if (rank == kVictim) continue;
    EXPECT_EQ(run.ranks[static_cast<size_t>(rank)].exit_code, 0) << "rank " << rank;
    const Record& record = shared.records[rank][kRoundsBefore];
    EXPECT_EQ(record.outcome.load(), 2);
    EXPECT_LT(record.elapsed_us.load(), 2'000'000) << "waited on a dead rank";
    EXPECT_EQ(std::string(record.why), gone);
  }
  // The killed rank never removed anything; every rank joined, so the last one to join did.
  EXPECT_FALSE(board_file_exists(identity));
}

TEST(RoundBoard, ContributionsOfDifferentSizesAbandonTheRoundOnEveryRank) {
  constexpr int kRanks = 4;
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const RankRun run = run_ranks(kRanks, shared, 30, [&](int rank) {
    auto board = open_round_board(identity, rank, kRanks);
    exchange_recorded(*board, shared, rank, 0, contribution(rank, 0, rank == 2 ? 4096 : 2048),
                      kPatient);
    const BoardRound got =
        exchange_recorded(*board, shared, rank, 1, contribution(rank, 1, 2048), kPatient);
    return got.outcome == BoardRound::Outcome::Agreed &&
                   holds_every_contribution(got, kRanks, 1, 2048)
               ? 0
               : 1;
  });
  expect_every_rank_succeeded(run);
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(shared.records[rank][0].outcome.load(), 2) << "rank " << rank;
    EXPECT_STREQ(shared.records[rank][0].why, "rank 2 contributed 4096 bytes, rank 0 2048");
    EXPECT_LT(shared.records[rank][0].elapsed_us.load(), 2'000'000) << "rank " << rank;
    EXPECT_EQ(shared.records[rank][1].outcome.load(), 1) << "rank " << rank;
  }
  EXPECT_FALSE(board_file_exists(identity));
}

TEST(RoundBoard, AContributionLargerThanTheBoardTakesAbandonsTheRoundOnEveryRankAtOnce) {
  constexpr int kRanks = 2;
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const RankRun run = run_ranks(kRanks, shared, 30, [&](int rank) {
    auto board = open_round_board(identity, rank, kRanks);
    const size_t bytes = rank == 1 ? kMaxBoardContribution + 1 : 64;
    exchange_recorded(*board, shared, rank, 0, std::vector<uint8_t>(bytes, 7), kPatient);
    const BoardRound got =
        exchange_recorded(*board, shared, rank, 1, contribution(rank, 1, 64), kPatient);
    return got.outcome == BoardRound::Outcome::Agreed &&
                   holds_every_contribution(got, kRanks, 1, 64)
               ? 0
               : 1;
  });
  expect_every_rank_succeeded(run);
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(shared.records[rank][0].outcome.load(), 2) << "rank " << rank;
    EXPECT_LT(shared.records[rank][0].elapsed_us.load(), 2'000'000) << "rank " << rank;
    EXPECT_EQ(shared.records[rank][1].outcome.load(), 1) << "rank " << rank;
  }
  EXPECT_STREQ(shared.records[0][0].why, "rank 1 could not contribute");
  EXPECT_NE(std::string(shared.records[1][0].why).find("is larger than a round board takes"),
            std::string::npos)
      << shared.records[1][0].why;
  EXPECT_FALSE(board_file_exists(identity));
}

// The race the decision word settles: in every round one rank comes about when the others'
// deadline passes, so the last arrival and a waiter giving up meet, across processes, round after
// round. Every rank must read the same outcome of every round, and an agreed round every byte.
TEST(RoundBoard, AWaiterGivingUpJustAsTheLastRankComesNeverSplitsTheOutcome) {
  constexpr int kRanks = 3;
  constexpr int kRounds = 300;
  constexpr milliseconds kDeadline{2};
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const RankRun run = run_ranks(kRanks, shared, 60, [&](int rank) {
    auto board = open_round_board(identity, rank, kRanks);
    std::mt19937 random(static_cast<uint32_t>(identity) + static_cast<uint32_t>(rank));
    std::uniform_int_distribution<int> delay_us(0, 4'000);
    for (int round = 0; round < kRounds; ++round) {
      if (round % kRanks == rank) {
        const timespec nap{0, delay_us(random) * 1000L};
        nanosleep(&nap, nullptr);
      }
      const BoardRound got =
          exchange_recorded(*board, shared, rank, round, contribution(rank, round, 64), kDeadline);
      if (got.outcome == BoardRound::Outcome::Agreed &&
          !holds_every_contribution(got, kRanks, round, 64))
        return 1;
    }
    return 0;
  });
  expect_every_rank_succeeded(run);
  int agreed = 0, abandoned = 0, split = 0;
  for (int round = 0; round < kRounds; ++round) {
    const int first = shared.records[0][round].outcome.load();
    bool same = true;
    for (int rank = 1; rank < kRanks; ++rank)
      same = same && shared.records[rank][round].outcome.load() == first;
    if (!same) {
      ++split;
      ADD_FAILURE() << "round " << round << ": rank 0 read " << first << ", rank 1 "
                    << shared.records[1][round].outcome.load() << ", rank 2 "
                    << shared.records[2][round].outcome.load();
    }
    agreed += first == 1;
    abandoned += first == 2;
  }
  EXPECT_EQ(split, 0);
  // Both outcomes came often, so the race was run, not avoided.
  EXPECT_GE(agreed, 10);
  EXPECT_GE(abandoned, 10);
  std::printf("[ race ] %d rounds agreed, %d abandoned\n", agreed, abandoned);
  EXPECT_FALSE(board_file_exists(identity));
}

// A rank stopped after it contributed, while its peers agree and go on: they must not write
// the buffer that held the agreed round until it has read it, and it reads that round's bytes
// whole once it runs again, though the decision word has moved on twice.
TEST(RoundBoard, ASlowReaderReadsTheAgreedBytesWholeAfterItsPeersMovedOn) {
  constexpr int kRanks = 2;
  constexpr int kSlow = 0;
  constexpr size_t kBytes = 4096;
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const RankRun run = run_ranks(kRanks, shared, 30, [&](int rank) {
    auto board = open_round_board(identity, rank, kRanks);
    if (rank == kSlow) {
      shared.stage.store(1);
      const BoardRound first =
          exchange_recorded(*board, shared, rank, 0, contribution(rank, 0, kBytes), kPatient);
      if (first.outcome != BoardRound::Outcome::Agreed ||
          !holds_every_contribution(first, kRanks, 0, kBytes))
        return 1;
    } else {
      // Stopped in its wait for rank 1: asleep in it (between two looks at the board) means it
      // contributed, as nothing before its contribution sleeps.
      if (!wait_for_stage(shared, 1) || !wait_until_asleep(shared.pids[kSlow].load())) return 1;
      kill(shared.pids[kSlow].load(), SIGSTOP);
      const BoardRound first =
          exchange_recorded(*board, shared, rank, 0, contribution(rank, 0, kBytes), kPatient);
      if (first.outcome != BoardRound::Outcome::Agreed ||
          !holds_every_contribution(first, kRanks, 0, kBytes))
        return 1;
      exchange_recorded(*board, shared, rank, 1, contribution(rank, 1, kBytes), milliseconds(50));
      // Round 2 writes the buffer round 0 is still to be read from.
      exchange_recorded(*board, shared, rank, 2, contribution(rank, 2, kBytes), milliseconds(200));
      kill(shared.pids[kSlow].load(), SIGCONT);
    }
    if (rank == kSlow) {
      exchange_recorded(*board, shared, rank, 1, contribution(rank, 1, kBytes), kPatient);
      exchange_recorded(*board, shared, rank, 2, contribution(rank, 2, kBytes), kPatient);
    }
    const BoardRound last =
        exchange_recorded(*board, shared, rank, 3, contribution(rank, 3, kBytes), kPatient);
    return last.outcome == BoardRound::Outcome::Agreed &&
                   holds_every_contribution(last, kRanks, 3, kBytes)
               ? 0
               : 1;
  });
  expect_every_rank_succeeded(run);
  for (int round = 1; round <= 2; ++round)
    for (int rank = 0; rank < kRanks; ++rank)
      EXPECT_EQ(shared.records[rank][round].outcome.load(), 2)
          << "rank " << rank << ", round " << round;
  EXPECT_LT(shared.records[kSlow][1].elapsed_us.load(), 100'000) << "a round long over";
  EXPECT_STREQ(shared.records[1][2].why,
               "rank 0 had not finished reading an earlier round within 200 ms");
  EXPECT_FALSE(board_file_exists(identity));
}

// ---- names and processes --------------------------------------------------------------------

TEST(RoundBoard, ARankComingAfterTheNameWasRemovedMakesAFreshBoardAndGivesUpAtItsDeadline) {
  constexpr int kRanks = 2;
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const RankRun run = run_ranks(kRanks, shared, 30, [&](int rank) {
    if (rank == 1 && !wait_for_stage(shared, 1)) return 1;
    {
      auto board = open_round_board(identity, rank, kRanks);
      exchange_recorded(*board, shared, rank, 0, contribution(rank, 0, 16), milliseconds(100));
    }
    if (rank == 0) {
      // Rank 0 made the board and is gone from it: the name went with it.
      if (board_file_exists(identity)) return 1;
      shared.stage.store(1);
    }
    return 0;
  });
  expect_every_rank_succeeded(run);
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_EQ(shared.records[rank][0].outcome.load(), 2) << "rank " << rank;
    EXPECT_GE(shared.records[rank][0].elapsed_us.load(), 100'000) << "rank " << rank;
    EXPECT_LT(shared.records[rank][0].elapsed_us.load(), 5'000'000) << "rank " << rank;
  }
  EXPECT_STREQ(shared.records[1][0].why, "rank 0 did not come within 100 ms");
  EXPECT_FALSE(board_file_exists(identity));
}

TEST(RoundBoard, ARankThatLeftTheBoardEndsTheRoundsOfThoseWaitingForIt) {
  constexpr int kRanks = 2;
  SharedArea area;
  Shared& shared = area.get();
  const uint64_t identity = fresh_identity();
  const RankRun run = run_ranks(kRanks, shared, 30, [&](int rank) {
    auto board = open_round_board(identity, rank, kRanks);
    const BoardRound first = board->exchange(contribution(rank, 0, 16), kPatient);
    if (first.outcome != BoardRound::Outcome::Agreed) return 1;
    if (rank == 1) {
      board.reset();
      return wait_for_stage(shared, 1) ? 0 : 1;  // alive, but done with the board
    }
    exchange_recorded(*board, shared, rank, 1, contribution(rank, 1, 16), kPatient);
    shared.stage.store(1);
    return 0;
  });
  expect_every_rank_succeeded(run);
  EXPECT_EQ(shared.records[0][1].outcome.load(), 2);
  EXPECT_LT(shared.records[0][1].elapsed_us.load(), 2'000'000);
  EXPECT_STREQ(shared.records[0][1].why, "rank 1 left the round board");
}

TEST(RoundBoard, AForkedChildNeitherUsesNorRemovesItsParentsBoard) {
  const uint64_t identity = fresh_identity();
  {
    auto board = open_round_board(identity, 0, 2);  // rank 1 never comes: the name stays
    ASSERT_TRUE(board_file_exists(identity));
    std::fflush(nullptr);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      int status = 1;
      try {
        board->exchange(contribution(0, 0, 8), kPatient);
      } catch (const Error& e) {
        status = std::string(e.what()).find("forked child") != std::string::npos ? 0 : 1;
      }
      board.reset();
      _exit(status);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    EXPECT_TRUE(board_file_exists(identity)) << "the child removed its parent's board";
  }
  EXPECT_FALSE(board_file_exists(identity));
}

TEST(RoundBoard, ARankAlreadyOnTheBoardCannotJoinItTwice) {
  const uint64_t identity = fresh_identity();
  auto board = open_round_board(identity, 0, 2);
  EXPECT_THROW(open_round_board(identity, 0, 2), Error);
  EXPECT_THROW(open_round_board(identity, 1, 3), Error);  // a board of another size
  EXPECT_THROW(open_round_board(identity, 2, 2), Error);
  board.reset();
  EXPECT_FALSE(board_file_exists(identity));
}

}  // namespace
}  // namespace magi::ce
