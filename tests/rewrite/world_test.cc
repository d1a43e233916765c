// What a communicator's agreement reaches outside itself (rewrite/world.h): the backend the
// options name, and the process's world as production_world() builds it for this test program
// (its options are the environment's): the real NCCL handed in, the calling thread's group as
// capture/ keeps it, round buffers a process without the CUDA driver can still use, and the set-up
// costs that choose where a plan is set up.
#include "rewrite/world.h"

#include <gtest/gtest.h>

#include <cstring>
#include <thread>
#include <vector>

#include "base/cuda_driver.h"
#include "rewrite/set_up.h"
#include "tests/support/options_env.h"

namespace magi::rewrite {
namespace {

ncclResult_t no_all_gather(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) {
  return ncclInvalidUsage;
}
ncclResult_t no_group_start() { return ncclInvalidUsage; }
ncclResult_t no_group_end() { return ncclInvalidUsage; }
const RealNcclCalls kNccl{no_all_gather, no_group_start, no_group_end};

TEST(World, TheBackendIsTheMemoryTheOptionsName) {
  EXPECT_EQ(test::options_from({{"MAGI_BACKEND", "host"}}).backend, ce::Backend::Host);
  EXPECT_EQ(test::options_from({{"MAGI_BACKEND", "cuda"}}).backend, ce::Backend::Cuda);
}

TEST(World, TheProductionWorldIssuesRoundsThroughTheRealNcclItIsHanded) {
  const AgreementWorld world = production_world(kNccl);
  EXPECT_EQ(&world.options, &Options::get());
  EXPECT_EQ(world.nccl.all_gather, &no_all_gather);
  EXPECT_EQ(world.nccl.group_start, &no_group_start);
  EXPECT_EQ(world.nccl.group_end, &no_group_end);
}

TEST(World, TheProductionWorldSeesTheCallingThreadsOpenGroup) {
  const AgreementWorld world = production_world(kNccl);
  ASSERT_EQ(world.group().depth, 0);
  capture::Communicator comm(
      capture::CommInfo{0xc0ffee, 0, 0, 2, -1, capture::CommOrigin::InitRank, false}, 64);
  capture::group_start();
  capture::group_start();
  capture::CallArgs send{trace::Op::Send, ncclFloat, 16, 1, -1, nullptr, nullptr, nullptr};
  capture::CallRecord record{};
  capture::begin_call(comm, send, record);
  capture::end_call(record, ncclSuccess);
  const GroupView inside = world.group();
  GroupView elsewhere{-1, true, 99};
  std::thread([&] { elsewhere = world.group(); }).join();
  capture::group_end();
  capture::group_end();
  EXPECT_EQ(inside.depth, 2);
  EXPECT_TRUE(inside.holds_point_to_point);
  EXPECT_EQ(inside.calls, 1u);
  EXPECT_EQ(elsewhere.depth, 0) << "another thread's group is its own";
  EXPECT_FALSE(elsewhere.holds_point_to_point);
  EXPECT_EQ(world.group().depth, 0);
}

TEST(World, WithoutTheCudaDriverTheProductionWorldsRoundsTakeHostMemory) {
  if (cuda_driver_loaded()) GTEST_SKIP() << "this process loaded the CUDA driver";
  const AgreementWorld world = production_world(kNccl);
  const capture::CommInfo info{0xc0ffee, 0, 1, 3, -1, capture::CommOrigin::InitRank, false};
  const std::unique_ptr<ce::Exchange> exchange = world.make.exchange(info, 64);
  std::vector<uint8_t> mine(64);
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = static_cast<uint8_t>(i + 1);
  exchange->stage(mine);
  EXPECT_EQ(std::memcmp(exchange->send_buffer(), mine.data(), mine.size()), 0);
  EXPECT_EQ(exchange->stream(), nullptr);
  exchange->issued();
  EXPECT_TRUE(exchange->ready()) << "host memory: the all-gather completed at its call";
  EXPECT_EQ(exchange->result().size(), 3 * mine.size());
}

TEST(World, TheProductionWorldSetsUpADefaultWindowOfEightRanksAtTheCall) {
  const AgreementWorld world = production_world(kNccl);
  // One mapping per peer: a plan's window on 8 ranks opens 7.
  EXPECT_LE(7 * world.make.mapping_ns, kSetUpAtTheCallNs);
  EXPECT_GT(world.make.mapping_ns, 0u);
}

TEST(World, TheProductionWorldPreparesHundredsOfCudaExportsOffTheCalls) {
  const AgreementWorld world = production_world(kNccl);
  // 256 allocations exported took 45-65 ms at the call on an H200; the host backend finds a
  // plan's in one read of /proc/self/maps.
  const bool cuda = world.options.backend == ce::Backend::Cuda;
  EXPECT_EQ(256 * world.make.export_ns > kSetUpAtTheCallNs, cuda);
  EXPECT_GT(world.make.export_ns, 0u);
}

}  // namespace
}  // namespace magi::rewrite
