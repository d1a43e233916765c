// groupskew --configs C --steps S [--device 1] [--simulate 1] [--p2p 1]
//
// The grouping skew of tests/gpu/multi/allgather_check.py, without PyTorch: C configurations
// one after the other (the shard's size and in-place or not change with each, so the step is
// lost and found again), each S steps of one all-gather followed by a small all-reduce. Even
// ranks issue the all-gather inside two nested groups of its own, as PyTorch's coalescing
// manager does (one group from starting the coalescing, one around the coalesced call); odd
// ranks issue it plainly. Silent unless wrong: every gathered element is checked.
// --simulate 1: every rank ends each step with a group of two small all-gathers that it ends
// with ncclGroupSimulateEnd, so that agreement rounds meet a group that must not run (rounds
// are issued at the position where the step was found when the warmup is complete there, as
// with MAGI_WARMUP_STEPS=1: from a clean start, the last one here).
// --p2p 1: every rank issues, between the gather and the all-reduce, a group of a Send to the
// next rank, a Recv from the previous one and a small all-gather, alike on every rank, so that
// rounds (from a clean start, at the step's second position) meet a group that cannot be
// launched in two parts.
#include <cstdint>
#include <cstring>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tests/support/workload/scenario.h"

namespace workload {

int run_groupskew(const ScenarioOptions& options) {
  const int configs = static_cast<int>(options.number("configs", 6));
  const int steps = static_cast<int>(options.number("steps", 16));
  if (configs < 1 || steps < 1) throw ScenarioFailure("--configs and --steps must be positive");
  const Placement placement(options);
  const Bootstrap boot = bootstrap_from_env();
  OwnedComm comm;
  WORKLOAD_CHECK(ncclCommInitRank(comm.out(), boot.nranks, boot.id, boot.rank));
  const bool grouped = boot.rank % 2 == 0;
  const bool simulate = options.number("simulate", 0) != 0;
  const bool p2p = options.number("p2p", 0) != 0;
  const int next = (boot.rank + 1) % boot.nranks,
            prev = (boot.rank + boot.nranks - 1) % boot.nranks;
  Buffer to_next(placement, sizeof(uint32_t)), from_prev(placement, sizeof(uint32_t));
  Buffer tick(placement, 64 * sizeof(float));
  // The small all-gather of --simulate and --p2p, in place.
  constexpr size_t kSide = 128;
  Buffer side(placement, kSide * sizeof(float) * static_cast<size_t>(boot.nranks));
  void* side_mine = static_cast<unsigned char*>(side.nccl()) +
                    kSide * sizeof(float) * static_cast<size_t>(boot.rank);
  for (int c = 0; c < configs; ++c) {
    const size_t count = size_t{256} << (c % 8);  // 1 KiB to 128 KiB: below and above a round
    const bool in_place = c % 2 == 1;
    const size_t shard = count * sizeof(uint32_t);
    Buffer out(placement, shard * static_cast<size_t>(boot.nranks));
    Buffer own(placement, shard);
    for (int s = 0; s < steps; ++s) {
      const uint32_t seed = static_cast<uint32_t>(c * 1000 + s);
      auto value = [&](int rank, size_t i) {
        return seed * 2654435761u ^ static_cast<uint32_t>(rank * 40503 + i);
      };
      unsigned char* into =
          in_place ? out.host() + shard * static_cast<size_t>(boot.rank) : own.host();
      for (size_t i = 0; i < count; ++i) {
        const uint32_t v = value(boot.rank, i);
        std::memcpy(into + i * sizeof v, &v, sizeof v);
      }
      const Buffer& send_side = in_place ? out : own;
      const size_t send_at = in_place ? shard * static_cast<size_t>(boot.rank) : 0;
      send_side.upload(send_at, shard);
      void* send = static_cast<unsigned char*>(send_side.nccl()) + send_at;
      if (grouped) {
        WORKLOAD_CHECK(ncclGroupStart());
        WORKLOAD_CHECK(ncclGroupStart());
      }
      WORKLOAD_CHECK(
          ncclAllGather(send, out.nccl(), count, ncclUint32, comm.get(), placement.stream()));
      if (grouped) {
        WORKLOAD_CHECK(ncclGroupEnd());
        WORKLOAD_CHECK(ncclGroupEnd());
      }
      if (p2p) {
        const uint32_t token = seed * 31u + static_cast<uint32_t>(boot.rank);
        std::memcpy(to_next.host(), &token, sizeof token);
        to_next.upload(0, sizeof token);
        WORKLOAD_CHECK(ncclGroupStart());
        WORKLOAD_CHECK(
            ncclSend(to_next.nccl(), 1, ncclUint32, next, comm.get(), placement.stream()));
        WORKLOAD_CHECK(
            ncclRecv(from_prev.nccl(), 1, ncclUint32, prev, comm.get(), placement.stream()));
        WORKLOAD_CHECK(ncclAllGather(side_mine, side.nccl(), kSide, ncclFloat32, comm.get(),
                                     placement.stream()));
        WORKLOAD_CHECK(ncclGroupEnd());
        placement.synchronize();
        from_prev.download(0, sizeof token);
        uint32_t got = 0;
        std::memcpy(&got, from_prev.host(), sizeof got);
        if (got != seed * 31u + static_cast<uint32_t>(prev))
          throw ScenarioFailure(format("rank %d: config %d step %d: received %u from rank %d",
                                       boot.rank, c, s, got, prev));
      }
      // Its count changes with the configuration too, so each new step begins at the gather.
      WORKLOAD_CHECK(ncclAllReduce(tick.nccl(), tick.nccl(), static_cast<size_t>(1 + c % 64),
                                   ncclFloat32, ncclSum, comm.get(), placement.stream()));
      if (simulate) {
        WORKLOAD_CHECK(ncclGroupStart());
        for (int k = 0; k < 2; ++k)
          WORKLOAD_CHECK(ncclAllGather(side_mine, side.nccl(), kSide, ncclFloat32, comm.get(),
                                       placement.stream()));
        ncclSimInfo_t info = NCCL_SIM_INFO_INITIALIZER;
        WORKLOAD_CHECK(ncclGroupSimulateEnd(&info));
      }
      placement.synchronize();
      out.download(0, out.bytes());
      for (int r = 0; r < boot.nranks; ++r) {
        for (size_t i = 0; i < count; ++i) {
          uint32_t got = 0;
          std::memcpy(&got, out.host() + shard * static_cast<size_t>(r) + i * sizeof got,
                      sizeof got);
          if (got != value(r, i)) {
            throw ScenarioFailure(
                format("rank %d: config %d step %d: element %zu from rank %d is %u, "
                       "expected %u",
                       boot.rank, c, s, i, r, got, value(r, i)));
          }
        }
      }
    }
  }
  comm.destroy();
  return 0;
}

}  // namespace workload
