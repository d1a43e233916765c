// An agreement round issued outside the program's open group (rewrite/group_flush.h), against
// NCCL calls that note their order: the group so far is launched first and reopened to the same
// depth after the round, what its early launches returned waits for the group's end, and a group
// holding Send or Recv keeps the round inside, said once.
#include "rewrite/group_flush.h"

#include <gtest/gtest.h>

#include <deque>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/has_line.h"

namespace magi::rewrite {
namespace {

// What the fake NCCL saw, in order ("start", "end", and "round" for the launch under test), and
// what its ncclGroupEnd returns, one result per call (ncclSuccess once they run out).
struct Nccl {
  std::vector<std::string> calls;
  std::deque<ncclResult_t> group_end_results;
};
Nccl* g_nccl = nullptr;

ncclResult_t fake_all_gather(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) {
  ADD_FAILURE() << "the round flush issues no all-gather of its own";
  return ncclInternalError;
}
ncclResult_t fake_group_start() {
  g_nccl->calls.push_back("start");
  return ncclSuccess;
}
ncclResult_t fake_group_end() {
  g_nccl->calls.push_back("end");
  if (g_nccl->group_end_results.empty()) return ncclSuccess;
  const ncclResult_t result = g_nccl->group_end_results.front();
  g_nccl->group_end_results.pop_front();
  return result;
}

// The fake NCCL of one test; the calling thread's early launches start and end empty.
struct FakeNccl {
  FakeNccl() {
    g_nccl = &nccl;
    early_launches() = {};
  }
  ~FakeNccl() {
    g_nccl = nullptr;
    early_launches() = {};
  }

  // Issues the round through `flush` within `group`; the round returns `result`.
  ncclResult_t issue(GroupFlush& flush, const GroupView& group, ncclResult_t result = ncclSuccess) {
    return flush.issue_alone(group, [&] {
      nccl.calls.push_back("round");
      return result;
    });
  }

  Nccl nccl;
  const RealNcclCalls real{fake_all_gather, fake_group_start, fake_group_end};
};

TEST(GroupFlush, LaunchesNowOutsideAGroupAndOutOfAGroupWithoutSendOrRecv) {
  EXPECT_TRUE(GroupFlush::launches_now(GroupView{0, false, 0}));
  EXPECT_TRUE(GroupFlush::launches_now(GroupView{2, false, 3}));
  EXPECT_FALSE(GroupFlush::launches_now(GroupView{1, true, 3}));
}

TEST(GroupFlush, OutsideAGroupTheRoundIsIssuedAloneWithNoGroupCall) {
  FakeNccl fake;
  GroupFlush flush(fake.real, 0xc0ffee);
  EXPECT_EQ(fake.issue(flush, GroupView{0, false, 0}, ncclInvalidUsage), ncclInvalidUsage);
  EXPECT_EQ(fake.nccl.calls, (std::vector<std::string>{"round"}));
  EXPECT_EQ(early_launches().calls, 0u);
  EXPECT_EQ(early_launches().error, ncclSuccess);
}

TEST(GroupFlush, TheOpenGroupIsLaunchedFirstAndReopenedToTheSameDepthAfterTheRound) {
  FakeNccl fake;
  GroupFlush flush(fake.real, 0xc0ffee);
  // Two nested ncclGroupStart, five calls so far (the anchor's, which goes after the round,
  // among them).
  EXPECT_EQ(fake.issue(flush, GroupView{2, false, 5}), ncclSuccess);
  EXPECT_EQ(fake.nccl.calls, (std::vector<std::string>{"end", "end", "round", "start", "start"}));
  EXPECT_EQ(early_launches().calls, 4u);
  EXPECT_EQ(early_launches().error, ncclSuccess);
}

TEST(GroupFlush, TheFirstErrorOfTheEarlyLaunchesWaitsForTheGroupsEnd) {
  FakeNccl fake;
  GroupFlush flush(fake.real, 0xc0ffee);
  fake.nccl.group_end_results = {ncclInProgress, ncclSystemError};
  // The round's own result is the round's; the group's error is the program's, at its end.
  EXPECT_EQ(fake.issue(flush, GroupView{2, false, 2}), ncclSuccess);
  EXPECT_EQ(early_launches().error, ncclInProgress);
  // A later round of the same group keeps the first error.
  fake.nccl.group_end_results = {ncclUnhandledCudaError};
  EXPECT_EQ(fake.issue(flush, GroupView{1, false, 3}), ncclSuccess);
  EXPECT_EQ(early_launches().error, ncclInProgress);
  EXPECT_EQ(early_launches().calls, 2u);
}

TEST(GroupFlush, AGroupHoldingSendOrRecvKeepsTheRoundInsideAndSaysSoOncePerCommunicator) {
  FakeNccl fake;
  GroupFlush flush(fake.real, 0xc0ffee);
  GroupFlush other(fake.real, 0xbeef);
  testing::internal::CaptureStderr();
  EXPECT_EQ(fake.issue(flush, GroupView{1, true, 2}), ncclSuccess);
  EXPECT_EQ(fake.issue(flush, GroupView{2, true, 4}), ncclSuccess);
  EXPECT_EQ(fake.issue(other, GroupView{1, true, 2}), ncclSuccess);
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(fake.nccl.calls, (std::vector<std::string>{"round", "round", "round"}));
  EXPECT_EQ(early_launches().calls, 0u);
  const std::string warning =
      "an agreement round was issued inside a group holding Send/Recv, which cannot be launched "
      "in two parts";
  EXPECT_EQ(test::count_lines(log, "comm 000000c0ffee: " + warning), 1u) << log;
  EXPECT_EQ(test::count_lines(log, "comm 00000000beef: " + warning), 1u) << log;
}

TEST(GroupFlush, WhatTheEarlyLaunchesLeftIsTheCallingThreadsOwn) {
  FakeNccl fake;
  GroupFlush flush(fake.real, 0xc0ffee);
  fake.nccl.group_end_results = {ncclSystemError};
  fake.issue(flush, GroupView{1, false, 3});
  ASSERT_EQ(early_launches().error, ncclSystemError);
  EarlyLaunches seen_elsewhere{ncclInternalError, 99};
  std::thread([&] { seen_elsewhere = early_launches(); }).join();
  EXPECT_EQ(seen_elsewhere.error, ncclSuccess);
  EXPECT_EQ(seen_elsewhere.calls, 0u);
}

}  // namespace
}  // namespace magi::rewrite
