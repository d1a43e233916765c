// What a communicator says of its all-gathers at its end, in one process (rewrite/coverage.h).
// The wording is what users and tools read (README, magice-trace decisions): it must not drift.
#include "rewrite/coverage.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/support/info_logged.h"

namespace magi::rewrite {
namespace {

const std::string kCost =
    "3 rounds (12.0 us waiting on them), 8 calls timed, 4 of them the slower way";

// A bucket of `gathers` moved gathers of `count` floats each.
std::vector<NcclGather> bucket(size_t gathers, size_t count) {
  return std::vector<NcclGather>(gathers, NcclGather{nullptr, nullptr, count, ncclFloat});
}

using test::InfoLogged;

TEST(Coverage, CountsWhatTheTransportServedWhatFellBackAndTheFirstCollectiveMoved) {
  Coverage coverage;
  for (int i = 0; i < 6; ++i) coverage.count_gather(4000);
  coverage.count_served(bucket(2, 1000), true, false, 17);
  coverage.count_served(bucket(1, 1000), true, false, 9);  // a group's bucket, served later
  coverage.count_served(bucket(1, 1000), false, false, 21);
  coverage.count_served(bucket(2, 1000), false, true, 25);  // the cost trial's NCCL side
  EXPECT_EQ(coverage.summary(kCost),
            "3 of 6 all-gathers (12000 of 24000 bytes sent) served off NCCL, 1 fell back to "
            "NCCL; the first at collective #9; exploring cost " +
                kCost);
}

TEST(Coverage, NothingMovedNamesNoFirstCollective) {
  Coverage coverage;
  coverage.count_gather(512);
  coverage.count_served(bucket(1, 128), false, false, 3);
  EXPECT_EQ(coverage.summary(kCost),
            "0 of 1 all-gathers (0 of 512 bytes sent) served off NCCL, 1 fell back to NCCL; "
            "exploring cost " +
                kCost);
}

// Gathers captured into a CUDA graph are counted once, at the capture, and the line says so.
TEST(Coverage, SaysHowManyMovedGathersWereCapturedIntoGraphs) {
  Coverage coverage;
  for (int i = 0; i < 3; ++i) coverage.count_gather(64);
  coverage.count_served(bucket(1, 16), true, false, 7);
  coverage.count_served(bucket(2, 16), true, false, 9, /*captured=*/true);
  EXPECT_EQ(coverage.captured, 2u);
  EXPECT_EQ(coverage.summary(kCost),
            "3 of 3 all-gathers (192 of 192 bytes sent) served off NCCL, 0 fell back to NCCL; "
            "the first at collective #7; 2 of them captured into CUDA graphs, moved again at "
            "every replay (replays are not counted: the library sees no call); exploring cost " +
                kCost);
}

TEST(Coverage, IsSaidOnceAtInfoOnlyWhereTheCommunicatorSawAnAllGather) {
  const InfoLogged info;
  Coverage none, some;
  some.count_gather(64);
  testing::internal::CaptureStderr();
  none.say(0x1234567890abcdefull, kCost);
  some.say(0x1234567890abcdefull, kCost);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(log.find("comm "), log.rfind("comm ")) << log;
  EXPECT_NE(log.find(" MAGI INFO REWRITE comm 567890abcdef: 0 of 1 all-gathers (0 of 64 bytes "
                     "sent) served off NCCL, 0 fell back to NCCL; exploring cost " +
                     kCost + "\n"),
            std::string::npos)
      << log;
}

}  // namespace
}  // namespace magi::rewrite
