// The one record per communicator: found with one lookup from any thread, replaced when NCCL
// reuses a handle, gone from every thread's cache once removed, and kept alive by a call in
// flight after its removal (an abort from another thread never frees it under that call).
#include "shim/communicators.h"

#include <gtest/gtest.h>

#include <thread>

namespace magi::shim {
namespace {

ncclComm_t handle(uintptr_t n) { return reinterpret_cast<ncclComm_t>(n); }

capture::CommInfo info_with_identity(uint64_t identity) {
  capture::CommInfo info{};
  info.identity = identity;
  info.rank = 0;
  info.nranks = 2;
  info.cuda_device = -1;
  info.origin = capture::CommOrigin::InitRank;
  return info;
}

TEST(Communicators, AJoinedCommunicatorIsFoundFromEveryThreadUntilRemoved) {
  const ncclComm_t comm = handle(0x1001);
  const CommRef added = add_comm(comm, info_with_identity(11), nullptr);
  EXPECT_EQ(find_comm(comm), added);
  EXPECT_EQ(find_comm(comm), added);  // the cached lookup
  std::thread([&] { EXPECT_EQ(find_comm(comm), added); }).join();

  EXPECT_EQ(remove_comm(comm), added);
  EXPECT_EQ(find_comm(comm), nullptr);  // this thread's cache forgot it too
  std::thread([&] { EXPECT_EQ(find_comm(comm), nullptr); }).join();
  EXPECT_EQ(remove_comm(comm), nullptr);
}

TEST(Communicators, AHandleNcclHandsOutAgainMeetsTheNewRecordNotTheOld) {
  const ncclComm_t comm = handle(0x1002);
  const CommRef first = add_comm(comm, info_with_identity(21), nullptr);
  ASSERT_EQ(find_comm(comm), first);  // cached here
  const CommRef second = add_comm(comm, info_with_identity(22), nullptr);
  const CommRef found = find_comm(comm);
  ASSERT_NE(found, nullptr);
  EXPECT_EQ(found->capture.info.identity, 22u);
  EXPECT_EQ(remove_comm(comm), second);
}

TEST(Communicators, ACallInFlightKeepsItsRecordAfterAnotherThreadRemovedIt) {
  const ncclComm_t comm = handle(0x1003);
  add_comm(comm, info_with_identity(31), nullptr);
  const CommRef in_flight = find_comm(comm);
  std::weak_ptr<CommRecord> watch = in_flight;
  std::thread([&] { EXPECT_NE(remove_comm(comm), nullptr); }).join();
  EXPECT_FALSE(watch.expired());  // still usable by the call that holds it
  EXPECT_EQ(in_flight->capture.info.identity, 31u);
}

TEST(Communicators, ACommunicatorCreatedOutOfSightIsRecordedWithARankLocalIdentity) {
  const ncclComm_t comm = handle(0x1004);
  ASSERT_EQ(find_comm(comm), nullptr);
  const CommRef record = comm_of(comm);
  ASSERT_NE(record, nullptr);
  EXPECT_EQ(record->capture.info.origin, capture::CommOrigin::Unknown);
  EXPECT_EQ(record->capture.info.rank, -1);
  EXPECT_EQ(record->agreement, nullptr);  // never agreed on
  EXPECT_EQ(comm_of(comm), record);       // registered once
  EXPECT_EQ(remove_comm(comm), record);
}

}  // namespace
}  // namespace magi::shim
