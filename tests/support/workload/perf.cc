// perf [--sizes B1,B2,...] [--warmup W] [--iters N] [--device 1]
//
// The loop nccl-tests' all_gather_perf runs (-c 1), as a user first tries the library: for each
// size B (bytes gathered in all, split evenly over the ranks), out of place and then in place,
// W warmup calls from one call site, N timed calls from a second, then one check call from a
// third after the send buffer was rewritten. Every call of one size has one shape, so the step
// is one call, found again after each change of size. Silent unless wrong: the result of the
// last timed call and of the check call are checked element by element.
#include <cstdint>
#include <cstring>
#include <sstream>
#include <vector>

#include "tests/support/bootstrap.h"
#include "tests/support/workload/scenario.h"

namespace workload {
namespace {

std::vector<size_t> sizes_of(const std::string& text) {
  std::vector<size_t> out;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) out.push_back(std::stoull(item));
  return out;
}

struct Phase {
  const Placement& placement;
  ncclComm_t comm;
  int rank, nranks;
  size_t count;  // uint32 elements per rank
  bool in_place;
  Buffer& own;
  Buffer& out;

  size_t shard() const { return count * sizeof(uint32_t); }
  static uint32_t value(uint32_t seed, int rank, size_t i) {
    return seed * 2654435761u ^ static_cast<uint32_t>(rank * 40503 + i);
  }
  const Buffer& send_side() const { return in_place ? out : own; }
  size_t send_at() const { return in_place ? shard() * static_cast<size_t>(rank) : 0; }
  void* send() const { return static_cast<unsigned char*>(send_side().nccl()) + send_at(); }

  void fill(uint32_t seed) const {
    unsigned char* into = send_side().host() + send_at();
    for (size_t i = 0; i < count; ++i) {
      const uint32_t v = value(seed, rank, i);
      std::memcpy(into + i * sizeof v, &v, sizeof v);
    }
    send_side().upload(send_at(), shard());
  }
  void check(uint32_t seed, const char* what) const {
    placement.synchronize();
    out.download(0, shard() * static_cast<size_t>(nranks));
    for (int r = 0; r < nranks; ++r) {
      for (size_t i = 0; i < count; ++i) {
        uint32_t got = 0;
        std::memcpy(&got, out.host() + shard() * static_cast<size_t>(r) + i * sizeof got,
                    sizeof got);
        if (got != value(seed, r, i))
          throw ScenarioFailure(
              format("rank %d: %zu bytes %s, %s: element %zu from rank %d is "
                     "%u, expected %u",
                     rank, shard() * static_cast<size_t>(nranks),
                     in_place ? "in place" : "out of place", what, i, r, got, value(seed, r, i)));
      }
    }
  }
};

// Each a call site of its own, as nccl-tests' warmup loop, timed loop and check are.
void warmup_calls(const Phase& p, int n) {
  for (int i = 0; i < n; ++i)
    WORKLOAD_CHECK(
        ncclAllGather(p.send(), p.out.nccl(), p.count, ncclUint32, p.comm, p.placement.stream()));
}
void timed_calls(const Phase& p, int n) {
  for (int i = 0; i < n; ++i)
    WORKLOAD_CHECK(
        ncclAllGather(p.send(), p.out.nccl(), p.count, ncclUint32, p.comm, p.placement.stream()));
}
void check_call(const Phase& p) {
  WORKLOAD_CHECK(
      ncclAllGather(p.send(), p.out.nccl(), p.count, ncclUint32, p.comm, p.placement.stream()));
}

}  // namespace

int run_perf(const ScenarioOptions& options) {
  const std::vector<size_t> sizes = sizes_of(options.text("sizes", "4096,65536,1048576"));
  const int warmup = static_cast<int>(options.number("warmup", 1));
  const int iters = static_cast<int>(options.number("iters", 40));
  if (sizes.empty() || warmup < 0 || iters < 1)
    throw ScenarioFailure("--sizes needs at least one size, --iters a positive count");
  const Placement placement(options);
  const Bootstrap boot = bootstrap_from_env();
  OwnedComm comm;
  WORKLOAD_CHECK(ncclCommInitRank(comm.out(), boot.nranks, boot.id, boot.rank));
  for (size_t s = 0; s < sizes.size(); ++s) {
    const size_t count = std::max<size_t>(sizes[s] / sizeof(uint32_t) / boot.nranks, 1);
    Buffer own(placement, count * sizeof(uint32_t));
    Buffer out(placement, count * sizeof(uint32_t) * static_cast<size_t>(boot.nranks));
    for (const bool in_place : {false, true}) {
      const Phase p{placement, comm.get(), boot.rank, boot.nranks, count, in_place, own, out};
      const uint32_t seed = static_cast<uint32_t>(s * 4 + (in_place ? 2 : 0));
      p.fill(seed);
      warmup_calls(p, warmup);
      timed_calls(p, iters);
      p.check(seed, "after the timed calls");
      p.fill(seed + 1);
      check_call(p);
      p.check(seed + 1, "the check call");
    }
  }
  comm.destroy();
  return 0;
}

}  // namespace workload
