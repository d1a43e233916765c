// split: derived communicators, checked against what NCCL defines.
//   1. ncclCommSplit by color = rank % 2 with key = nranks - rank: each child orders its members
//      by key, so child ranks run opposite to parent ranks. Collectives on parent and child,
//      interleaved.
//   2. ncclCommSplit where the last rank passes NCCL_SPLIT_NOCOLOR: it gets NULL.
//   3. ncclCommShrink excluding the last rank (which does not call it): survivors keep order.
//   4. Two threads, each driving its own communicator (parent and child) at the same time.
#include <algorithm>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tests/support/workload/scenario.h"

namespace workload {
namespace {

void expect(bool ok, const std::string& message) {
  if (!ok) throw ScenarioFailure(message);
}

int sum_of(ncclComm_t comm, int value) {
  int total = 0;
  WORKLOAD_CHECK(ncclAllReduce(&value, &total, 1, ncclInt32, ncclSum, comm, nullptr));
  return total;
}

void expect_shape(ncclComm_t comm, int nranks, int rank, const char* what) {
  int count = -1, user_rank = -1;
  WORKLOAD_CHECK(ncclCommCount(comm, &count));
  WORKLOAD_CHECK(ncclCommUserRank(comm, &user_rank));
  expect(count == nranks && user_rank == rank,
         format("%s: rank %d of %d, expected rank %d of %d", what, user_rank, count, rank, nranks));
}

}  // namespace

int run_split(const ScenarioOptions&) {
  const Bootstrap boot = bootstrap_from_env();
  const int n = boot.nranks;
  const int me = boot.rank;
  OwnedComm parent_comm;
  WORKLOAD_CHECK(ncclCommInitRank(parent_comm.out(), n, boot.id, me));
  const ncclComm_t parent = parent_comm.get();

  // 1. By parity, reversed order.
  const int color = me % 2;
  std::vector<int> members;  // parent ranks of my child, in child-rank order (key ascending)
  for (int r = n - 1; r >= 0; --r) {
    if (r % 2 == color) members.push_back(r);
  }
  const int child_rank =
      static_cast<int>(std::find(members.begin(), members.end(), me) - members.begin());
  OwnedComm child_comm;
  WORKLOAD_CHECK(ncclCommSplit(parent, color, n - me, child_comm.out(), nullptr));
  const ncclComm_t child = child_comm.get();
  expect(child != nullptr, format("rank %d: split gave no communicator", me));
  expect_shape(child, static_cast<int>(members.size()), child_rank, "parity child");

  expect(sum_of(parent, me + 1) == n * (n + 1) / 2,
         format("rank %d: parent all-reduce is wrong", me));
  std::vector<int> gathered(members.size(), -1);
  WORKLOAD_CHECK(ncclAllGather(&me, gathered.data(), 1, ncclInt32, child, nullptr));
  expect(gathered == members,
         format("rank %d: child all-gather does not list the members in key order", me));
  const int member_sum = std::accumulate(members.begin(), members.end(), 0);
  expect(sum_of(child, me) == member_sum, format("rank %d: child all-reduce is wrong", me));
  expect(sum_of(parent, 1) == n,
         format("rank %d: parent all-reduce after the child's is wrong", me));

  // 2. The last rank opts out.
  const bool opted_out = me == n - 1;
  OwnedComm rest;
  WORKLOAD_CHECK(
      ncclCommSplit(parent, opted_out ? NCCL_SPLIT_NOCOLOR : 0, me, rest.out(), nullptr));
  if (opted_out) {
    expect(rest.get() == nullptr,
           format("rank %d: NCCL_SPLIT_NOCOLOR still gave a communicator", me));
  } else {
    expect(rest.get() != nullptr, format("rank %d: split gave no communicator", me));
    expect_shape(rest.get(), n - 1, me, "split without the last rank");
    expect(sum_of(rest.get(), me) == (n - 1) * (n - 2) / 2,
           format("rank %d: all-reduce without the last rank is wrong", me));
    rest.destroy();
  }

  // 3. Shrink: the excluded rank is presumed gone and does not take part.
  if (!opted_out) {
    int excluded = n - 1;
    OwnedComm shrunk;
    WORKLOAD_CHECK(
        ncclCommShrink(parent, &excluded, 1, shrunk.out(), nullptr, NCCL_SHRINK_DEFAULT));
    expect_shape(shrunk.get(), n - 1, me, "shrunk communicator");
    expect(sum_of(shrunk.get(), 1) == n - 1,
           format("rank %d: all-reduce on the shrunk communicator is wrong", me));
    shrunk.destroy();
  }

  // 4. Different communicators from different threads at once.
  auto repeated_sums = [me](ncclComm_t comm, int members_count, const char* which) -> std::string {
    try {
      for (int i = 0; i < 200; ++i) {
        if (sum_of(comm, i) != i * members_count) {
          return format("rank %d: %s all-reduce %d is wrong", me, which, i);
        }
      }
    } catch (const std::exception& e) {
      return e.what();
    }
    return "";
  };
  std::string child_failure;
  std::thread child_thread([&] {
    child_failure = repeated_sums(child, static_cast<int>(members.size()), "child (second thread)");
  });
  const std::string parent_failure = repeated_sums(parent, n, "parent");
  child_thread.join();
  expect(parent_failure.empty(), parent_failure);
  expect(child_failure.empty(), child_failure);

  child_comm.destroy();
  parent_comm.destroy();
  return 0;
}

}  // namespace workload
