// The machines of a communicator as a pure function of every rank's machine key: ranks grouped by
// machine, machines ordered by their lowest rank, local indices by rank within each.
#include <gtest/gtest.h>

#include <vector>

#include "rewrite/machines.h"

namespace magi::rewrite {
namespace {

using trace::Reason;

TEST(Machines, OneMachineSpansNothing) {
  const std::vector<uint64_t> hosts(4, 5);
  const Machines m = machines_of(hosts);
  EXPECT_FALSE(m.spans());
  EXPECT_EQ(m.count, 1);
  EXPECT_EQ(m.per_machine, 4);
  EXPECT_EQ(m.local_of, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(m.refusal(), Reason::None);
}

TEST(Machines, ConsecutiveRanksMakeMachinesInRankOrder) {
  const std::vector<uint64_t> hosts = {9, 9, 9, 9, 3, 3, 3, 3};  // keys need no order
  const Machines m = machines_of(hosts);
  ASSERT_TRUE(m.spans());
  EXPECT_EQ(m.count, 2);
  EXPECT_EQ(m.per_machine, 4);
  EXPECT_EQ(m.machine_of, (std::vector<int32_t>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(m.local_of, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 2, 3}));
  EXPECT_EQ(m.rank_of(1, 2), 6);
  EXPECT_EQ(m.refusal(), Reason::None);
}

// Machines are ordered by their lowest rank, and a rank's local index is its place among its
// machine's ranks: any numbering.
TEST(Machines, RanksNumberedAcrossMachinesKeepTheirPlaces) {
  const std::vector<uint64_t> hosts = {4, 8, 6, 8, 4, 6};
  const Machines m = machines_of(hosts);
  EXPECT_EQ(m.count, 3);
  EXPECT_EQ(m.per_machine, 2);
  EXPECT_EQ(m.machine_of, (std::vector<int32_t>{0, 1, 2, 1, 0, 2}));
  EXPECT_EQ(m.local_of, (std::vector<int32_t>{0, 0, 0, 1, 1, 1}));
  for (int32_t r = 0; r < 6; ++r)
    EXPECT_EQ(m.rank_of(m.machine_of[static_cast<size_t>(r)], m.local_of[static_cast<size_t>(r)]),
              r);
}

TEST(Machines, UnevenMachinesOrOneRankEachAreRefused) {
  const Machines uneven = machines_of(std::vector<uint64_t>{1, 1, 1, 2});
  EXPECT_EQ(uneven.per_machine, 0);
  EXPECT_TRUE(uneven.rank_at.empty());
  EXPECT_EQ(uneven.refusal(), Reason::MachinesUneven);
  EXPECT_EQ(machines_of(std::vector<uint64_t>{1, 2, 3}).refusal(), Reason::OneRankPerMachine);
}

}  // namespace
}  // namespace magi::rewrite
