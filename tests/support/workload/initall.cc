// initall --ndev D: one process, D communicators from ncclCommInitAll, all driven from this
// thread inside groups (a grouped all-reduce, a grouped all-gather plus a Send/Recv ring across
// the communicators, and a grouped split), each checked.
#include <vector>

#include "tests/support/workload/scenario.h"

namespace workload {
namespace {

void expect(bool ok, const std::string& message) {
  if (!ok) throw ScenarioFailure(message);
}

}  // namespace

int run_initall(const ScenarioOptions& options) {
  const int ndev = static_cast<int>(options.number("ndev", 4));
  if (ndev < 1) throw ScenarioFailure("--ndev must be positive");
  const size_t count = 1001;
  std::vector<ncclComm_t> comms(ndev, nullptr);
  WORKLOAD_CHECK(ncclCommInitAll(comms.data(), ndev, nullptr));
  std::vector<OwnedComm> owned_comms(comms.begin(), comms.end());
  for (int d = 0; d < ndev; ++d) {
    int rank = -1, nranks = -1, device = -1;
    WORKLOAD_CHECK(ncclCommUserRank(comms[d], &rank));
    WORKLOAD_CHECK(ncclCommCount(comms[d], &nranks));
    WORKLOAD_CHECK(ncclCommCuDevice(comms[d], &device));
    expect(rank == d && nranks == ndev && device == d,
           format("communicator %d: rank %d of %d on device %d", d, rank, nranks, device));
  }

  // Grouped all-reduce: communicator d contributes d + 1 + i at element i.
  std::vector<std::vector<double>> send(ndev, std::vector<double>(count)), recv = send;
  for (int d = 0; d < ndev; ++d) {
    for (size_t i = 0; i < count; ++i) send[d][i] = d + 1 + static_cast<double>(i);
  }
  WORKLOAD_CHECK(ncclGroupStart());
  for (int d = 0; d < ndev; ++d) {
    WORKLOAD_CHECK(ncclAllReduce(send[d].data(), recv[d].data(), count, ncclFloat64, ncclSum,
                                 comms[d], nullptr));
  }
  WORKLOAD_CHECK(ncclGroupEnd());
  for (int d = 0; d < ndev; ++d) {
    for (size_t i = 0; i < count; ++i) {
      const double expected = ndev * (ndev + 1) / 2.0 + ndev * static_cast<double>(i);
      expect(recv[d][i] == expected,
             format("communicator %d: all-reduce element %zu is %g, expected %g", d, i, recv[d][i],
                    expected));
    }
  }

  // Grouped all-gather and a ring of Send/Recv across the communicators.
  std::vector<int> ids(ndev);
  std::vector<std::vector<int>> gathered(ndev, std::vector<int>(ndev, -1));
  std::vector<int> from_prev(ndev, -1);
  WORKLOAD_CHECK(ncclGroupStart());
  for (int d = 0; d < ndev; ++d) {
    ids[d] = 100 + d;
    WORKLOAD_CHECK(ncclAllGather(&ids[d], gathered[d].data(), 1, ncclInt32, comms[d], nullptr));
    WORKLOAD_CHECK(ncclSend(&ids[d], 1, ncclInt32, (d + 1) % ndev, comms[d], nullptr));
    WORKLOAD_CHECK(ncclRecv(&from_prev[d], 1, ncclInt32, (d + ndev - 1) % ndev, comms[d], nullptr));
  }
  WORKLOAD_CHECK(ncclGroupEnd());
  for (int d = 0; d < ndev; ++d) {
    for (int j = 0; j < ndev; ++j) {
      expect(gathered[d][j] == 100 + j,
             format("communicator %d: all-gather slot %d is %d", d, j, gathered[d][j]));
    }
    const int prev = (d + ndev - 1) % ndev;
    expect(from_prev[d] == 100 + prev,
           format("communicator %d: received %d from %d", d, from_prev[d], prev));
  }

  // A grouped split by parity, then a grouped all-reduce on the children.
  std::vector<ncclComm_t> children(ndev, nullptr);
  WORKLOAD_CHECK(ncclGroupStart());
  for (int d = 0; d < ndev; ++d) {
    WORKLOAD_CHECK(ncclCommSplit(comms[d], d % 2, d, &children[d], nullptr));
  }
  const ncclResult_t split_result = ncclGroupEnd();
  std::vector<OwnedComm> owned_children(children.begin(), children.end());
  check(split_result, "ncclGroupEnd after ncclCommSplit");
  std::vector<int> one(ndev, 1), members(ndev, 0);
  WORKLOAD_CHECK(ncclGroupStart());
  for (int d = 0; d < ndev; ++d) {
    WORKLOAD_CHECK(
        ncclAllReduce(&one[d], &members[d], 1, ncclInt32, ncclSum, children[d], nullptr));
  }
  WORKLOAD_CHECK(ncclGroupEnd());
  for (int d = 0; d < ndev; ++d) {
    const int expected = (ndev - d % 2 + 1) / 2;  // how many of 0..ndev-1 share d's parity
    expect(members[d] == expected, format("child of communicator %d counts %d members, expected %d",
                                          d, members[d], expected));
    owned_children[d].destroy();
  }
  for (OwnedComm& c : owned_comms) c.destroy();
  return 0;
}

}  // namespace workload
