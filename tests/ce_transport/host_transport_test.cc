// The host backend of ce_transport across real processes: N forked ranks prepare windows, swap
// handle blobs through memory they share from before the fork, and run buckets of gathers whose
// every received byte is checked. Also: a rank killed while the others wait makes their gather
// throw instead of hang, and no window name is left in /dev/shm.
//
// Each child reports by its exit status (0: everything it checked held); the parent kills every
// child and fails after a timeout, so a hang fails the test instead of stalling it.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sched.h>
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
#include <string>
#include <thread>
#include <vector>

#include "base/base.h"
#include "ce_transport/backends.h"
#include "ce_transport/ce_transport.h"
#include "ce_transport/host_window.h"
#include "ce_transport/process.h"
#include "ce_transport/sample_plan.h"

#include "tests/support/forked_ranks.h"

namespace magi::ce {
namespace {

// A default-mode window: two staging slots of `slot_bytes`.
WindowPlan staging_plan(size_t slot_bytes) {
  WindowPlan plan;
  plan.slot_bytes = slot_bytes;
  return plan;
}

constexpr int kMaxRanks = 8;
constexpr int kIterations = 24;
constexpr int kBucketGathers[] = {1, 2, 7, 64};
constexpr size_t kShardBytes[] = {1, 3, 1000, 4099, 17, 64, 5, 255, 4096, 2, 63, 65};
constexpr uint64_t kCommIdentity = 0x5eed'c0ff'ee00'0001;

// ---- processes ------------------------------------------------------------------------------

// What the ranks share: made before the fork, so every child maps the same pages.
struct Shared {
  std::atomic<uint32_t> arrived{0};
  std::atomic<uint32_t> generation{0};
  std::atomic<int64_t> pids[kMaxRanks] = {};
  HandleBlob blobs[kMaxRanks];
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

// Every rank waits here until all have arrived. A rank that never arrives hangs the others,
// and the parent's timeout ends the test.
void barrier(Shared& shared, int nranks) {
  const uint32_t generation = shared.generation.load(std::memory_order_acquire);
  if (shared.arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(nranks)) {
    shared.arrived.store(0, std::memory_order_relaxed);
    shared.generation.fetch_add(1, std::memory_order_acq_rel);
    return;
  }
  while (shared.generation.load(std::memory_order_acquire) == generation) sched_yield();
}

using Outcome = support::ForkedRank;
using RankRun = support::ForkedRun;

// Forks `nranks` children running `body(rank, shared)`; its return value is the exit status.
// The rank `reap_last` (if >= 0) is reaped only after every other rank has exited, so while the
// others run it stays a zombie once dead, as a child whose parent is busy elsewhere would.
RankRun run_ranks(int nranks, Shared& shared, double timeout_s,
                  const std::function<int(int rank, Shared& shared)>& body, int reap_last = -1) {
  return support::run_forked_ranks(
      nranks, timeout_s,
      [&](int r) {
        shared.pids[r].store(getpid(), std::memory_order_release);  // before any barrier
        return body(r, shared);
      },
      reap_last);
}

// Window names in /dev/shm that belong to one of `pids` (each name ends in ".<owner pid>").
std::vector<std::string> window_names_of(const std::vector<pid_t>& pids) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(kWindowNamePrefix, 0) != 0) continue;
    for (const pid_t pid : pids) {
      const std::string tail = "." + std::to_string(pid);
      if (name.size() > tail.size() &&
          name.compare(name.size() - tail.size(), tail.size(), tail) == 0)
        found.push_back(name);
    }
  }
  return found;
}

std::vector<pid_t> pids_of(const RankRun& run) {
  std::vector<pid_t> pids;
  for (const Outcome& o : run.ranks) pids.push_back(o.pid);
  return pids;
}

// ---- the plan and its data ------------------------------------------------------------------

struct Gather {
  size_t bytes;
  size_t slot_offset;
  bool in_place;
};
struct Plan {
  std::vector<std::vector<Gather>> buckets;
  size_t slot_bytes = 0;
};

// Odd sizes, offsets packed on 64-byte boundaries (as rewrite/ lays out a slot), in-place and
// out-of-place mixed.
Plan make_plan() {
  Plan plan;
  size_t next_size = 0;
  for (const int gathers : kBucketGathers) {
    std::vector<Gather> bucket;
    size_t end = 0;
    for (int g = 0; g < gathers; ++g) {
      const size_t bytes = kShardBytes[next_size++ % std::size(kShardBytes)];
      const size_t offset = (end + 63) / 64 * 64;
      bucket.push_back({bytes, offset, (g + gathers) % 2 == 1});
      end = offset + bytes;
    }
    plan.slot_bytes = std::max(plan.slot_bytes, end);
    plan.buckets.push_back(std::move(bucket));
  }
  return plan;
}

// The byte rank `rank` contributes at `index` of gather `gather` of bucket `bucket` in
// iteration `iteration`: every one of them changes from one iteration to the next, so a stale
// byte is caught.
uint8_t value(int iteration, int rank, size_t bucket, size_t gather, size_t index) {
  uint32_t x =
      static_cast<uint32_t>(iteration) * 0x9E3779B1u ^ static_cast<uint32_t>(rank) * 0x85EBCA77u ^
      static_cast<uint32_t>(bucket) * 0xC2B2AE3Du ^ static_cast<uint32_t>(gather) * 0x27D4EB2Fu ^
      static_cast<uint32_t>(index) * 0x165667B1u;
  x ^= x >> 15;
  x *= 0x2C1B3C6Du;
  x ^= x >> 12;
  return static_cast<uint8_t>(x);
}

// One rank's buffers for every gather of the plan.
struct Buffers {
  std::vector<std::vector<std::vector<uint8_t>>> send, recv;  // [bucket][gather]
};

Buffers make_buffers(const Plan& plan, int nranks) {
  Buffers buffers;
  for (const auto& bucket : plan.buckets) {
    buffers.send.emplace_back();
    buffers.recv.emplace_back();
    for (const Gather& g : bucket) {
      buffers.send.back().emplace_back(g.bytes);
      buffers.recv.back().emplace_back(g.bytes * static_cast<size_t>(nranks));
    }
  }
  return buffers;
}

// Writes this rank's shards for `iteration`, poisons the rest of the receive buffers and
// returns the bucket's ops.
std::vector<GatherOp> fill_bucket(const Plan& plan, Buffers& buffers, size_t b, int iteration,
                                  int rank) {
  std::vector<GatherOp> ops;
  for (size_t g = 0; g < plan.buckets[b].size(); ++g) {
    const Gather& gather = plan.buckets[b][g];
    uint8_t* recv = buffers.recv[b][g].data();
    std::memset(recv, 0xEE, buffers.recv[b][g].size());
    uint8_t* send = gather.in_place ? recv + static_cast<size_t>(rank) * gather.bytes
                                    : buffers.send[b][g].data();
    for (size_t i = 0; i < gather.bytes; ++i) send[i] = value(iteration, rank, b, g, i);
    ops.push_back({send, recv, gather.bytes, gather.slot_offset});
  }
  return ops;
}

// 0 if every byte of every rank's shard arrived; else says where the first one did not.
int check_bucket(const Plan& plan, const Buffers& buffers, size_t b, int iteration, int rank,
                 int nranks) {
  for (size_t g = 0; g < plan.buckets[b].size(); ++g) {
    const size_t bytes = plan.buckets[b][g].bytes;
    const uint8_t* recv = buffers.recv[b][g].data();
    for (int r = 0; r < nranks; ++r)
      for (size_t i = 0; i < bytes; ++i) {
        const uint8_t want = value(iteration, r, b, g, i);
        const uint8_t got = recv[static_cast<size_t>(r) * bytes + i];
        if (got != want) {
          std::fprintf(
              stderr,
              "rank %d, iteration %d, bucket %zu, gather %zu: byte %zu of rank %d's shard is "
              "%#x, expected %#x\n",
              rank, iteration, b, g, i, r, got, want);
          return 1;
        }
      }
  }
  return 0;
}

// Makes the transport, prepares, swaps blobs through `shared`, attaches.
std::unique_ptr<Transport> join(int rank, int nranks, Shared& shared, size_t slot_bytes) {
  auto transport = make_transport(Backend::Host, rank, nranks, kCommIdentity);
  HandleBlob blob;
  transport->prepare(staging_plan(slot_bytes), blob);
  shared.blobs[rank] = blob;
  barrier(shared, nranks);
  transport->attach(std::span<const HandleBlob>(shared.blobs, static_cast<size_t>(nranks)));
  return transport;
}

// `graph_slots`: the window has them, and every other bucket is served as captured into a CUDA
// graph (Timing::Captured; host memory runs it at once), on the graph slot of its index's
// parity, through the latches of real shared memory: the odd buckets in even iterations, the
// even ones in odd iterations.
int gather_and_check(int rank, int nranks, Shared& shared, bool graph_slots = false) {
  const Plan plan = make_plan();
  Buffers buffers = make_buffers(plan, nranks);
  auto transport = make_transport(Backend::Host, rank, nranks, kCommIdentity);
  if (transport->window_bytes() != 0) {
    std::fprintf(stderr, "rank %d: a window before prepare\n", rank);
    return 1;
  }
  HandleBlob blob;
  WindowPlan window = staging_plan(plan.slot_bytes);
  window.graph_slots = graph_slots;
  transport->prepare(window, blob);
  const size_t slots = graph_slots ? 4 : 2;
  if (transport->window_bytes() < slots * plan.slot_bytes) {
    std::fprintf(stderr, "rank %d: window of %zu bytes for %zu slots of %zu\n", rank,
                 transport->window_bytes(), slots, plan.slot_bytes);
    return 1;
  }
  shared.blobs[rank] = blob;
  barrier(shared, nranks);
  transport->attach(std::span<const HandleBlob>(shared.blobs, static_cast<size_t>(nranks)));
  barrier(shared, nranks);
  // Every peer has opened every window: no name is left to leak if a rank dies from here on.
  if (rank == 0) {
    std::vector<pid_t> pids;
    for (int r = 0; r < nranks; ++r) pids.push_back(static_cast<pid_t>(shared.pids[r].load()));
    for (const std::string& name : window_names_of(pids)) {
      std::fprintf(stderr, "window name %s still in /dev/shm after every rank attached\n",
                   name.c_str());
      return 1;
    }
  }

  for (int iteration = 0; iteration < kIterations; ++iteration)
    for (size_t b = 0; b < plan.buckets.size(); ++b) {
      std::vector<GatherOp> ops = fill_bucket(plan, buffers, b, iteration, rank);
      const bool captured = graph_slots && (b + static_cast<size_t>(iteration)) % 2 == 1;
      for (GatherOp& op : ops) op.bucket = static_cast<uint16_t>(b);
      transport->gather(ops, nullptr,
                        captured ? Transport::Timing::Captured : Transport::Timing::Untimed);
      if (check_bucket(plan, buffers, b, iteration, rank, nranks) != 0) return 1;
    }

  transport->release();
  transport->release();
  if (transport->window_bytes() != 0) {
    std::fprintf(stderr, "rank %d: window_bytes %zu after release\n", rank,
                 transport->window_bytes());
    return 1;
  }
  return 0;
}

// ---- tests --------------------------------------------------------------------------------

class HostTransportRanks : public ::testing::TestWithParam<int> {};

TEST_P(HostTransportRanks, EveryRankReceivesEveryByteOfEveryBucket) {
  const int nranks = GetParam();
  SharedArea area;
  const RankRun run = run_ranks(nranks, area.get(), 30, [nranks](int rank, Shared& shared) {
    return gather_and_check(rank, nranks, shared);
  });
  ASSERT_FALSE(run.timed_out) << "ranks still running after 30 s; killed";
  for (int r = 0; r < nranks; ++r) {
    EXPECT_EQ(run.ranks[static_cast<size_t>(r)].exit_code, 0) << "rank " << r;
    EXPECT_EQ(run.ranks[static_cast<size_t>(r)].signal, 0) << "rank " << r;
  }
  EXPECT_EQ(window_names_of(pids_of(run)), std::vector<std::string>{});
}

TEST_P(HostTransportRanks, CapturedBucketsOnGraphSlotsAmongEagerOnesReceiveEveryByte) {
  const int nranks = GetParam();
  SharedArea area;
  const RankRun run = run_ranks(nranks, area.get(), 30, [nranks](int rank, Shared& shared) {
    return gather_and_check(rank, nranks, shared, true);
  });
  ASSERT_FALSE(run.timed_out) << "ranks still running after 30 s; killed";
  for (int r = 0; r < nranks; ++r) {
    EXPECT_EQ(run.ranks[static_cast<size_t>(r)].exit_code, 0) << "rank " << r;
    EXPECT_EQ(run.ranks[static_cast<size_t>(r)].signal, 0) << "rank " << r;
  }
  EXPECT_EQ(window_names_of(pids_of(run)), std::vector<std::string>{});
}

INSTANTIATE_TEST_SUITE_P(Ranks, HostTransportRanks, ::testing::Values(2, 3, 4, 8));

// Static weights: shards bound once, then pure reads. A shard that changes in place is found at
// the next verification, reported once, and re-bound, so from the call after that peers read the
// new bytes.
int bound_gathers(int rank, int nranks, Shared& shared) {
  constexpr size_t kShards[] = {1000, 3, 4099};
  std::vector<std::vector<uint8_t>> send, recv;
  std::vector<BindOp> binds;
  size_t offset = 0;
  for (size_t g = 0; g < std::size(kShards); ++g) {
    send.emplace_back(kShards[g]);
    recv.emplace_back(kShards[g] * static_cast<size_t>(nranks));
    for (size_t i = 0; i < kShards[g]; ++i)
      send[g][i] = static_cast<uint8_t>(rank * 31 + g * 7 + i);
    binds.push_back({send[g].data(), kShards[g], offset});
    offset += (kShards[g] + 255) / 256 * 256;
  }
  WindowPlan plan;
  plan.slot_bytes = offset;
  plan.bound = true;
  plan.bind = binds;
  plan.verify_first = 1;
  plan.verify_every = 4;
  auto transport = make_transport(Backend::Host, rank, nranks, kCommIdentity);
  HandleBlob blob;
  transport->prepare(plan, blob);
  shared.blobs[rank] = blob;
  barrier(shared, nranks);
  transport->attach(std::span<const HandleBlob>(shared.blobs, static_cast<size_t>(nranks)));
  barrier(shared, nranks);

  auto expected = [&](int r, size_t g, size_t i, int version) {
    return static_cast<uint8_t>(r * 31 + g * 7 + i + (version != 0 && r == 1 && g == 2 ? 100 : 0));
  };
  for (int call = 1; call <= 12; ++call) {
    // Rank 1 breaks its promise before call 6: its third shard changes in place.
    if (rank == 1 && call == 6)
      for (size_t i = 0; i < kShards[2]; ++i) send[2][i] = expected(1, 2, i, 1);
    std::vector<GatherOp> ops;
    for (size_t g = 0; g < std::size(kShards); ++g)
      ops.push_back({send[g].data(), recv[g].data(), kShards[g], binds[g].slot_offset});
    transport->gather(ops, nullptr);
    barrier(shared, nranks);  // every rank has read this call before the next one changes anything
    const std::vector<size_t> stale = transport->take_stale_bindings();
    // Verified on calls 1, 4, 8, 12: the change before call 6 is found on call 8, by rank 1 only.
    const bool should_find = rank == 1 && call == 8;
    if (should_find != (stale.size() == 1 && stale[0] == binds[2].slot_offset) ||
        (!should_find && !stale.empty())) {
      std::fprintf(stderr, "rank %d call %d: %zu stale bindings reported\n", rank, call,
                   stale.size());
      return 1;
    }
    for (int r = 0; r < nranks; ++r)
      for (size_t g = 0; g < std::size(kShards); ++g)
        for (size_t i = 0; i < kShards[g]; ++i) {
          // Peers read the old bytes until the re-binding on call 8; the owner reads its own
          // shard from its send buffer, always current.
          // On call 8 itself the re-binding races with the peers' reads: either byte is fine.
          const int version = r == 1 && (call > 8 || (rank == 1 && call >= 6)) ? 1 : 0;
          const uint8_t got = recv[g][static_cast<size_t>(r) * kShards[g] + i];
          const bool racing = r == 1 && rank != 1 && call == 8 && got == expected(r, g, i, 1);
          if (got != expected(r, g, i, version) && !racing) {
            std::fprintf(stderr,
                         "rank %d call %d: gather %zu byte %zu of rank %d is %#x, expected %#x\n",
                         rank, call, g, i, r, got, expected(r, g, i, version));
            return 1;
          }
        }
    barrier(shared, nranks);
  }
  transport->release();
  return 0;
}

// A shard freed by the program before it was bound: prepare refuses (the commit then fails on
// every rank) instead of the process dying on a read of unmapped memory.
TEST(HostTransport, BindingAFreedBufferIsRefusedNotACrash) {
  // Unreadable as a freed, unmapped buffer is, but still reserved, so that the window's own
  // mapping cannot land on the same address.
  const long page = sysconf(_SC_PAGESIZE);
  void* gone =
      mmap(nullptr, static_cast<size_t>(page), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(gone, MAP_FAILED);
  WindowPlan plan;
  plan.slot_bytes = 4096;
  plan.bound = true;
  plan.bind = {{gone, 1024, 0}};
  auto transport = make_transport(Backend::Host, 0, 2, kCommIdentity);
  HandleBlob blob;
  try {
    transport->prepare(plan, blob);
    ADD_FAILURE() << "bound a freed buffer";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::System);
    EXPECT_NE(std::string(e.what()).find("no longer readable"), std::string::npos) << e.what();
  }
  transport->release();
  munmap(gone, static_cast<size_t>(page));
  EXPECT_EQ(window_names_of({getpid()}), std::vector<std::string>{});
}

TEST(HostTransport, BoundShardsAreReadWithoutHandshakeAndAChangeIsFoundAndRebound) {
  for (const int nranks : {2, 4}) {
    SharedArea area;
    const RankRun run = run_ranks(nranks, area.get(), 30, [nranks](int rank, Shared& shared) {
      return bound_gathers(rank, nranks, shared);
    });
    ASSERT_FALSE(run.timed_out);
    for (int r = 0; r < nranks; ++r)
      EXPECT_EQ(run.ranks[static_cast<size_t>(r)].exit_code, 0) << "rank " << r;
    EXPECT_EQ(window_names_of(pids_of(run)), std::vector<std::string>{});
  }
}

// Static weights checked on sampled lines (ce_transport/sample_plan.h), in one process: two
// ranks over bound windows (a bound gather has no handshake, so one thread runs both). Rank 0's
// shard is checked on its first call and every `every` calls; rank 1 reads it from rank 0's
// binding, so what rank 1 receives shows whether a change was re-bound.
class BoundPair {
 public:
  BoundPair(size_t bytes, uint64_t every) : bytes_(bytes) {
    for (int r = 0; r < 2; ++r) {
      send_[r].resize(bytes);
      for (size_t i = 0; i < bytes; ++i) send_[r][i] = static_cast<uint8_t>(i * 7 + i / 251 + r);
      recv_[r].resize(2 * bytes);
      transports_[r] = make_transport(Backend::Host, r, 2, kCommIdentity);
      WindowPlan plan;
      plan.slot_bytes = bytes;
      plan.bound = true;
      plan.bind = {{send_[r].data(), bytes, 0}};
      plan.verify_first = 1;
      plan.verify_every = every;
      transports_[r]->prepare(plan, blobs_[r]);
    }
    for (auto& t : transports_) t->attach(blobs_);
  }
  ~BoundPair() {
    for (auto& t : transports_) t->release();
  }

  // One call on both ranks, rank 0 first; whether rank 0 found its shard changed.
  bool call() {
    for (int r = 0; r < 2; ++r) {
      const GatherOp op{send_[r].data(), recv_[r].data(), bytes_, 0};
      transports_[r]->gather(std::span<const GatherOp>(&op, 1), nullptr);
    }
    const std::vector<size_t> stale = transports_[0]->take_stale_bindings();
    return !stale.empty();
  }
  // Rank 1's last call received rank 0's shard as it is now.
  bool peer_reads_current() const {
    return std::memcmp(recv_[1].data(), send_[0].data(), bytes_) == 0;
  }
  std::vector<uint8_t>& shard() { return send_[0]; }
  uint64_t checked_bytes() const { return transports_[0]->checked_bytes(); }

 private:
  size_t bytes_;
  std::vector<uint8_t> send_[2], recv_[2];
  std::unique_ptr<Transport> transports_[2];
  HandleBlob blobs_[2];
};

// 1 MiB and a bit: 256 lines 4352 bytes apart, so P = 17 checks, and the sweep's last line is
// short on some checks.
constexpr size_t kSampledShard = (size_t{1} << 20) + 100;

TEST(HostTransport, BoundShardRewrittenWholeIsFoundAtTheNextCheck) {
  BoundPair pair(kSampledShard, 4);  // checks on calls 1, 4, 8, ...
  ASSERT_FALSE(pair.call());
  EXPECT_TRUE(pair.peer_reads_current());
  const uint64_t before = pair.checked_bytes();
  EXPECT_GT(before, 0u);
  EXPECT_LE(before, 2 * SamplePlan::kMaxSetBytes);
  for (uint8_t& b : pair.shard()) b = static_cast<uint8_t>(b ^ 0x5a);  // e.g. an optimizer step
  EXPECT_FALSE(pair.call());                                           // call 2: no check
  EXPECT_FALSE(pair.peer_reads_current());
  EXPECT_FALSE(pair.call());  // call 3
  EXPECT_TRUE(pair.call());   // call 4: the next check finds it and re-binds
  EXPECT_TRUE(pair.peer_reads_current());
  // A check compares the anchor and one sweep set, never the shard.
  EXPECT_GT(pair.checked_bytes(), before);
  EXPECT_LE(pair.checked_bytes() - before, 2 * SamplePlan::kMaxSetBytes);
  EXPECT_FALSE(pair.call());
  EXPECT_FALSE(pair.call());
  EXPECT_FALSE(pair.call());
  EXPECT_FALSE(pair.call());  // call 8 checks again: the re-bound shard matches
}

TEST(HostTransport, BoundShardWithOneLineRewrittenIsFoundWithinPChecks) {
  const SamplePlan plan(kSampledShard);
  const uint64_t p = plan.sweep_period();
  const size_t s = plan.stride();
  ASSERT_EQ(p, 17u);
  // Where a 256-byte run is rewritten: on an anchor line, between anchor lines (unaligned too),
  // just before the end, across the end of the stride, and the shard's last (short) line.
  const size_t starts[] = {0,
                           s + 256,
                           100 * s + 1000,
                           7 * s + s - 300,
                           s - 128,
                           kSampledShard - 256,
                           kSampledShard - 60};
  for (const size_t start : starts) {
    for (const int checks_before : {1, 6}) {
      BoundPair pair(kSampledShard, 1);  // a check on every call
      for (int i = 0; i < checks_before; ++i) ASSERT_FALSE(pair.call()) << start;
      const size_t end = std::min(start + SamplePlan::kLine, kSampledShard);
      for (size_t i = start; i < end; ++i) pair.shard()[i] = static_cast<uint8_t>(~pair.shard()[i]);
      uint64_t checks = 0;
      bool found = false;
      while (!found && checks < p) {
        found = pair.call();
        ++checks;
        if (!found) {
          EXPECT_FALSE(pair.peer_reads_current()) << start;  // still the old line
        }
      }
      EXPECT_TRUE(found) << "a line rewritten at " << start << " not found within " << p
                         << " checks";
      EXPECT_TRUE(pair.peer_reads_current()) << start;
      if (start == 0) {
        EXPECT_EQ(checks, 1u);  // on the anchor: the next check
      }
    }
  }
}

TEST(HostTransport, AnUnchangedBoundShardIsNeverReportedAndEveryByteIsLookedAt) {
  BoundPair pair(kSampledShard, 1);
  const SamplePlan plan(kSampledShard);
  const uint64_t p = plan.sweep_period();
  uint64_t last = 0;
  for (uint64_t call = 1; call <= 5 * p; ++call) {
    ASSERT_FALSE(pair.call()) << "call " << call;
    ASSERT_TRUE(pair.peer_reads_current());
    const uint64_t step = pair.checked_bytes() - last;
    EXPECT_GT(step, 0u);
    EXPECT_LE(step, 2 * SamplePlan::kMaxSetBytes);
    last = pair.checked_bytes();
    // The anchor at every check, and the sweeps of checks 1..P-1 the rest of the shard once.
    if (call == p) {
      EXPECT_EQ(last, (p - 1) * plan.anchor().bytes() + kSampledShard);
    }
  }
}

// The last rank dies by SIGKILL after a few buckets; the others are then waiting for it inside
// gather and must get an error naming it. `zombie`: its parent does not reap it meanwhile.
void peer_killed_while_others_wait(bool zombie) {
  constexpr int kRanks = 3;
  constexpr int kVictim = kRanks - 1;
  constexpr int kGoodBuckets = 5;
  SharedArea area;
  const auto body = [](int rank, Shared& shared) -> int {
    const Plan plan = make_plan();
    Buffers buffers = make_buffers(plan, kRanks);
    auto transport = join(rank, kRanks, shared, plan.slot_bytes);
    for (int i = 0; i < kGoodBuckets; ++i) {
      const std::vector<GatherOp> ops = fill_bucket(plan, buffers, 2, i, rank);
      transport->gather(ops, nullptr);
      if (check_bucket(plan, buffers, 2, i, rank, kRanks) != 0) return 1;
    }
    if (rank == kVictim) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the others are waiting by now
      raise(SIGKILL);
    }
    const std::vector<GatherOp> ops = fill_bucket(plan, buffers, 2, kGoodBuckets, rank);
    const std::string expected = "rank " + std::to_string(kVictim) + " (pid " +
                                 std::to_string(shared.pids[kVictim].load()) + ") is gone";
    try {
      transport->gather(ops, nullptr);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::System && std::string(e.what()) == expected) {
        transport->release();
        transport->release();
        return 0;
      }
      std::fprintf(stderr, "rank %d: \"%s\", expected \"%s\"\n", rank, e.what(), expected.c_str());
      return 1;
    }
    std::fprintf(stderr, "rank %d: gather returned although rank %d is dead\n", rank, kVictim);
    return 1;
  };
  const RankRun run = run_ranks(kRanks, area.get(), 15, body, zombie ? kVictim : -1);
  ASSERT_FALSE(run.timed_out) << "a rank waited for a dead peer for 15 s";
  for (int r = 0; r < kVictim; ++r)
    EXPECT_EQ(run.ranks[static_cast<size_t>(r)].exit_code, 0) << "rank " << r;
  EXPECT_EQ(run.ranks[kVictim].signal, SIGKILL);
  EXPECT_EQ(window_names_of(pids_of(run)), std::vector<std::string>{});
}

TEST(HostTransport, PeerKilledWhileOthersWaitMakesTheirGatherThrow) {
  peer_killed_while_others_wait(false);
}

TEST(HostTransport, PeerKilledAndNotYetReapedMakesTheirGatherThrow) {
  peer_killed_while_others_wait(true);
}

// A peer whose process ended is lost (Transport::lost_peer()) only if it never released its
// window: killed, it is named; released first (the communicator's end, or the process's, which
// releases every window), it is not, though its process is gone all the same.
void peer_ended(bool released) {
  constexpr int kRanks = 3;
  constexpr int kVictim = kRanks - 1;
  SharedArea area;
  const auto body = [released](int rank, Shared& shared) -> int {
    const Plan plan = make_plan();
    auto transport = join(rank, kRanks, shared, plan.slot_bytes);
    barrier(shared, kRanks);  // every rank attached
    if (transport->lost_peer() != "") {
      std::fprintf(stderr, "rank %d: a peer lost while all live\n", rank);
      return 1;
    }
    barrier(shared, kRanks);  // every rank looked
    if (rank == kVictim) {
      if (released) {
        transport->release();
        _exit(0);
      }
      raise(SIGKILL);
    }
    const auto victim = static_cast<pid_t>(shared.pids[kVictim].load());
    for (int i = 0; i < 10'000 && process_alive(victim); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    const std::string lost = transport->lost_peer();
    const std::string expected =
        released ? "" : "rank " + std::to_string(kVictim) + " (pid " + std::to_string(victim) + ")";
    if (lost != expected) {
      std::fprintf(stderr, "rank %d: lost_peer() says '%s', expected '%s'\n", rank, lost.c_str(),
                   expected.c_str());
      return 1;
    }
    transport->release();
    return transport->lost_peer() == "" ? 0 : 1;  // nothing attached
  };
  const RankRun run = run_ranks(kRanks, area.get(), 15, body, kVictim);
  ASSERT_FALSE(run.timed_out);
  for (int r = 0; r < kVictim; ++r)
    EXPECT_EQ(run.ranks[static_cast<size_t>(r)].exit_code, 0) << "rank " << r;
  if (released)
    EXPECT_EQ(run.ranks[kVictim].exit_code, 0);
  else
    EXPECT_EQ(run.ranks[kVictim].signal, SIGKILL);
}

TEST(HostTransport, APeerKilledWithTheCommunicatorInUseIsLost) { peer_ended(false); }

TEST(HostTransport, APeerThatReleasedItsWindowBeforeItEndedIsNotLost) { peer_ended(true); }

// Two ranks of one process, each on a thread: the same handshake without fork.
TEST(HostTransport, TwoThreadsGatherThroughEachOthersWindows) {
  constexpr int kRanks = 2;
  const Plan plan = make_plan();
  std::unique_ptr<Transport> transports[kRanks];
  HandleBlob blobs[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    transports[r] = make_transport(Backend::Host, r, kRanks, kCommIdentity);
    transports[r]->prepare(staging_plan(plan.slot_bytes), blobs[r]);
  }
  for (int r = 0; r < kRanks; ++r) transports[r]->attach(blobs);
  EXPECT_EQ(window_names_of({getpid()}), std::vector<std::string>{});
  int failures[kRanks] = {};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      Buffers buffers = make_buffers(plan, kRanks);
      for (int iteration = 0; iteration < kIterations; ++iteration)
        for (size_t b = 0; b < plan.buckets.size(); ++b) {
          transports[r]->gather(fill_bucket(plan, buffers, b, iteration, r), nullptr);
          failures[r] += check_bucket(plan, buffers, b, iteration, r, kRanks);
        }
    });
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures[0], 0);
  EXPECT_EQ(failures[1], 0);
}

TEST(HostTransport, OneRankGathersItsOwnShardAndLeavesNoName) {
  auto transport = make_transport(Backend::Host, 0, 1, kCommIdentity);
  EXPECT_EQ(transport->window_bytes(), 0u);
  HandleBlob blob;
  transport->prepare(staging_plan(1000), blob);
  EXPECT_GE(transport->window_bytes(), 2000u);
  EXPECT_EQ(window_names_of({getpid()}), std::vector<std::string>{});  // nobody will open it
  transport->attach(std::span<const HandleBlob>(&blob, 1));
  std::vector<uint8_t> send(999), recv(999, 0);
  for (size_t i = 0; i < send.size(); ++i) send[i] = static_cast<uint8_t>(i * 7 + 1);
  const GatherOp op{send.data(), recv.data(), send.size(), 0};
  transport->gather(std::span<const GatherOp>(&op, 1), nullptr);
  EXPECT_EQ(recv, send);
  transport->release();
  EXPECT_EQ(transport->window_bytes(), 0u);
  transport->release();
  EXPECT_EQ(transport->window_bytes(), 0u);
}

ErrorKind kind_of(const std::function<void()>& work) {
  try {
    work();
  } catch (const Error& e) {
    return e.kind();
  }
  ADD_FAILURE() << "nothing thrown";
  return ErrorKind::Internal;
}

TEST(HostTransport, RefusesBlobsOfAnotherPlanAndGathersThatOverflowASlot) {
  auto a = make_transport(Backend::Host, 0, 2, kCommIdentity);
  auto other_comm = make_transport(Backend::Host, 1, 2, kCommIdentity + 1);
  auto other_slots = make_transport(Backend::Host, 1, 2, kCommIdentity);
  auto b = make_transport(Backend::Host, 1, 2, kCommIdentity);
  HandleBlob blob_a, blob_other_comm, blob_other_slots, blob_b;
  EXPECT_EQ(kind_of([&] { a->gather({}, nullptr); }), ErrorKind::Usage);  // before prepare
  a->prepare(staging_plan(256), blob_a);
  other_comm->prepare(staging_plan(256), blob_other_comm);
  other_slots->prepare(staging_plan(512), blob_other_slots);
  b->prepare(staging_plan(256), blob_b);

  const HandleBlob wrong_comm[] = {blob_a, blob_other_comm};
  EXPECT_EQ(kind_of([&] { a->attach(wrong_comm); }), ErrorKind::Usage);
  const HandleBlob wrong_slots[] = {blob_a, blob_other_slots};
  EXPECT_EQ(kind_of([&] { a->attach(wrong_slots); }), ErrorKind::Usage);
  const HandleBlob wrong_rank[] = {blob_b, blob_a};
  EXPECT_EQ(kind_of([&] { a->attach(wrong_rank); }), ErrorKind::Usage);
  EXPECT_EQ(kind_of([&] { a->attach(std::span<const HandleBlob>(&blob_a, 1)); }), ErrorKind::Usage);

  const HandleBlob right[] = {blob_a, blob_b};
  a->attach(right);
  b->attach(right);
  uint8_t send[100] = {}, recv[200] = {};
  const GatherOp overflow{send, recv, 100, 192};
  EXPECT_EQ(kind_of([&] { a->gather(std::span<const GatherOp>(&overflow, 1), nullptr); }),
            ErrorKind::Usage);

  for (auto* t : {&a, &other_comm, &other_slots, &b}) (*t)->release();
  EXPECT_EQ(window_names_of({getpid()}), std::vector<std::string>{});
}

// ---- MAGI_INJECT_FAULT on the host backend (ce_transport/protocol.h's fault points) -------------

using Where = Options::Fault::Where;

std::string injected_error(const std::function<void()>& work) {
  try {
    work();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Cuda) << e.what();
    return e.what();
  }
  return "";
}

TEST(HostTransportFaults, PrepareFaultFailsOnlyThatRanksPrepare) {
  const Options::Fault fault{Where::Prepare, 1};
  auto a = make_host_transport(0, 2, kCommIdentity, fault);
  auto b = make_host_transport(1, 2, kCommIdentity, fault);
  HandleBlob blob_a, blob_b;
  EXPECT_NO_THROW(a->prepare(staging_plan(256), blob_a));
  EXPECT_NE(injected_error([&] {
              b->prepare(staging_plan(256), blob_b);
            }).find("injected by MAGI_INJECT_FAULT"),
            std::string::npos);
  EXPECT_EQ(b->window_bytes(), 0u);  // failed before anything was made
  a->release();
  b->release();
  EXPECT_EQ(window_names_of({getpid()}), std::vector<std::string>{});
}

TEST(HostTransportFaults, AttachFaultFailsThatRanksAttachBeforeItOpensAnyPeer) {
  const Options::Fault fault{Where::Attach, 1};
  auto a = make_host_transport(0, 2, kCommIdentity, fault);
  auto b = make_host_transport(1, 2, kCommIdentity, fault);
  HandleBlob blobs[2];
  a->prepare(staging_plan(256), blobs[0]);
  b->prepare(staging_plan(256), blobs[1]);
  EXPECT_NE(injected_error([&] { b->attach(blobs); }).find("injected by MAGI_INJECT_FAULT"),
            std::string::npos);
  // Rank 1 opened no window: both names wait for their peer, until rank 0 opens rank 1's.
  EXPECT_EQ(window_names_of({getpid()}).size(), 2u);
  EXPECT_NO_THROW(a->attach(blobs));
  EXPECT_EQ(window_names_of({getpid()}).size(), 1u);
  a->release();
  b->release();
  EXPECT_EQ(window_names_of({getpid()}), std::vector<std::string>{});
}

// gather:RANK: that rank publishes "failed" with its ready, so every rank learns of it within the
// same bucket, returns FallBack and moves nothing; the buckets after stay in step (bucket n waits
// for done >= n - 2, which the failed buckets still publish), so none hangs.
TEST(HostTransportFaults, GatherFaultMakesEveryRankFallBackInTheSameBucketAndMoveNothing) {
  constexpr int kRanks = 3;
  constexpr int kBuckets = 5;
  constexpr size_t kShard = 100;
  const Options::Fault fault{Where::Gather, 1};
  std::unique_ptr<Transport> transports[kRanks];
  HandleBlob blobs[kRanks];
  for (int r = 0; r < kRanks; ++r) {
    transports[r] = make_host_transport(r, kRanks, kCommIdentity, fault);
    transports[r]->prepare(staging_plan(kShard), blobs[r]);
  }
  for (int r = 0; r < kRanks; ++r) transports[r]->attach(blobs);
  int fell_back[kRanks] = {};
  bool untouched[kRanks] = {};
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r)
    threads.emplace_back([&, r] {
      std::vector<uint8_t> send(kShard, static_cast<uint8_t>(r + 1));
      std::vector<uint8_t> recv(kRanks * kShard, 0xee);
      const GatherOp op{send.data(), recv.data(), kShard, 0};
      for (int b = 0; b < kBuckets; ++b)
        if (transports[r]->gather(std::span<const GatherOp>(&op, 1), nullptr) ==
            Transport::Served::FallBack)
          ++fell_back[r];
      untouched[r] = std::all_of(recv.begin(), recv.end(), [](uint8_t v) { return v == 0xee; });
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ(fell_back[r], kBuckets) << "rank " << r;
    EXPECT_TRUE(untouched[r]) << "rank " << r << " moved bytes of a bucket that fell back";
    transports[r]->release();
  }
}

// Two levels (ce_transport.h, GatherOp::pieces): one machine's three ranks, each holding the
// shards of its peers of the same local index on two machines (what NCCL gathered between them);
// every rank reads every local rank's pieces to the places of their global ranks, numbered across
// machines (machine 0: ranks 4, 0, 2; machine 1: ranks 5, 1, 3), in place or not: the receive
// buffer is the whole communicator's all-gather. A rank refusing a bucket (its NCCL part failed)
// makes every local rank fall back in that bucket, moving nothing.
TEST(HostTransport, GathersOfPiecesPlaceEveryShardAtItsGlobalRank) {
  constexpr int kLocal = 3;
  constexpr uint32_t kMachines = 2;
  constexpr size_t kShard = 37;
  constexpr int kBuckets = 4;
  const int32_t places[kLocal * kMachines] = {4, 5, 0, 1, 2, 3};  // [local][machine]
  const Options::Fault none{};
  std::unique_ptr<Transport> transports[kLocal];
  HandleBlob blobs[kLocal];
  for (int r = 0; r < kLocal; ++r) {
    transports[r] = make_host_transport(r, kLocal, kCommIdentity, none);
    transports[r]->prepare(staging_plan(kShard * kMachines), blobs[r]);
  }
  for (int r = 0; r < kLocal; ++r) transports[r]->attach(blobs);
  int wrong[kLocal] = {};
  int fell_back[kLocal] = {};
  std::vector<std::thread> threads;
  for (int r = 0; r < kLocal; ++r)
    threads.emplace_back([&, r] {
      constexpr size_t kAll = kShard * kLocal * kMachines;
      std::vector<uint8_t> pieces(kShard * kMachines);
      std::vector<uint8_t> recv(kAll);
      for (int b = 0; b < kBuckets; ++b) {
        for (uint32_t m = 0; m < kMachines; ++m)
          for (size_t i = 0; i < kShard; ++i)
            pieces[m * kShard + i] = value(b, places[r * kMachines + m], 0, 0, i);
        std::fill(recv.begin(), recv.end(), uint8_t{0xee});
        // Rank r's own shard (machine 0's piece) already in place at its global rank, as an
        // in-place gather's send buffer is.
        std::copy_n(pieces.begin(), kShard,
                    recv.begin() + static_cast<ptrdiff_t>(places[r * kMachines]) * kShard);
        GatherOp op{pieces.data(), recv.data(), kShard, 0};
        op.pieces = kMachines;
        op.places = places;
        op.refuse = b == 2 && r == 1;
        if (transports[r]->gather(std::span<const GatherOp>(&op, 1), nullptr) ==
            Transport::Served::FallBack) {
          ++fell_back[r];
          continue;
        }
        for (int32_t g = 0; g < kLocal * static_cast<int32_t>(kMachines); ++g)
          for (size_t i = 0; i < kShard; ++i)
            wrong[r] += recv[static_cast<size_t>(g) * kShard + i] != value(b, g, 0, 0, i);
      }
    });
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < kLocal; ++r) {
    EXPECT_EQ(wrong[r], 0) << "rank " << r << ": bytes not at their global rank's place";
    EXPECT_EQ(fell_back[r], 1) << "rank " << r << ": the refused bucket, and it alone";
    transports[r]->release();
  }
}

// Two levels, as the serving uses them. Default mode: NCCL's part between machines is written
// into each rank's staging slot by the bucket's PartWriter (GatherOp without a send buffer), once
// the slot is free. Static weights: the machines' pieces are held in the window's held region,
// this rank's own piece staged from the call's buffer (own_source); a rank whose own buffer
// changed after the other machines took it is told by take_stale_bindings(), at once on host
// memory, while its own machine reads the call's bytes. Two machines' ranks of local index 0
// and 1 on machine 0 (global ranks 0 and 2; machine 1 holds 1 and 3).
TEST(HostTransport, TwoLevelPartsAreWrittenIntoTheSlotOrStagedFromHeldPieces) {
  constexpr int kLocal = 2;
  constexpr uint32_t kMachines = 2;
  constexpr size_t kShard = 64;
  const int32_t places[kLocal * kMachines] = {0, 1, 2, 3};  // [local][machine]
  struct Writer final : PartWriter {
    int rank = 0;
    int bucket = 0;
    int written = 0;
    bool write_parts(std::span<const GatherOp> ops, uint8_t* slot, void*) override {
      for (const GatherOp& op : ops) {
        EXPECT_EQ(op.sendbuf, nullptr);
        for (uint32_t m = 0; m < op.pieces; ++m)
          for (size_t i = 0; i < op.bytes; ++i)
            slot[op.slot_offset + m * op.bytes + i] =
                value(bucket, op.places[rank * static_cast<int>(op.pieces) + m], 0, 0, i);
        ++written;
      }
      return true;
    }
  };
  for (const bool held : {false, true}) {
    std::unique_ptr<Transport> transports[kLocal];
    HandleBlob blobs[kLocal];
    for (int r = 0; r < kLocal; ++r) {
      transports[r] = make_host_transport(r, kLocal, kCommIdentity, {});
      WindowPlan plan = staging_plan(kShard * kMachines);
      plan.held_bytes = held ? kShard * kMachines : 0;
      transports[r]->prepare(plan, blobs[r]);
      EXPECT_EQ(transports[r]->held_region() != nullptr, held);
    }
    for (int r = 0; r < kLocal; ++r) transports[r]->attach(blobs);
    int wrong[kLocal] = {};
    std::vector<size_t> stale[kLocal];
    Writer writers[kLocal];
    std::vector<std::thread> threads;
    for (int r = 0; r < kLocal; ++r)
      threads.emplace_back([&, r] {
        std::vector<uint8_t> own(kShard), recv(kShard * kLocal * kMachines);
        uint8_t* pieces = transports[r]->held_region();
        if (held)  // what NCCL brought at the first call: bucket 0's bytes, held from then on
          for (uint32_t m = 0; m < kMachines; ++m)
            for (size_t i = 0; i < kShard; ++i)
              pieces[m * kShard + i] = value(0, places[r * kMachines + m], 0, 0, i);
        for (int b = 0; b < 4; ++b) {
          // Held: the weights stay bucket 0's, but rank 0's own changes at bucket 2.
          const int owns = held ? (r == 0 && b >= 2 ? 9 : 0) : b;
          for (size_t i = 0; i < kShard; ++i) own[i] = value(owns, places[r * kMachines], 0, 0, i);
          GatherOp op{held ? pieces : nullptr, recv.data(), kShard, 0};
          op.pieces = kMachines;
          op.places = places;
          if (held) {
            op.own_source = own.data();
            op.own_piece = 0;
          }
          writers[r].rank = r;
          writers[r].bucket = b;
          EXPECT_EQ(transports[r]->gather(std::span<const GatherOp>(&op, 1), nullptr,
                                          Transport::Timing::Untimed, held ? nullptr : &writers[r]),
                    Transport::Served::Moved);
          for (const size_t at : transports[r]->take_stale_bindings()) stale[r].push_back(at);
          for (int32_t g = 0; g < kLocal * static_cast<int32_t>(kMachines); ++g) {
            // Machine 0's ranks (0, 2) read their own buffers' bytes; machine 1's are held.
            const int expected = !held ? b : (g == 0 && b >= 2 ? 9 : 0);
            for (size_t i = 0; i < kShard; ++i)
              wrong[r] += recv[static_cast<size_t>(g) * kShard + i] != value(expected, g, 0, 0, i);
          }
        }
      });
    for (std::thread& t : threads) t.join();
    for (int r = 0; r < kLocal; ++r) {
      EXPECT_EQ(wrong[r], 0) << "held " << held << " rank " << r;
      EXPECT_EQ(writers[r].written, held ? 0 : 4) << "rank " << r;
      // Rank 0's own piece differs from the held one from bucket 2 on: said at each check.
      EXPECT_EQ(stale[r], r == 0 && held ? (std::vector<size_t>{0, 0}) : std::vector<size_t>{})
          << "held " << held << " rank " << r;
      transports[r]->release();
    }
  }
}

// A bound window's call has no handshake to fail (protocol.h): gather:RANK leaves it moving.
TEST(HostTransportFaults, GatherFaultLeavesABoundWindowsReadsAlone) {
  auto transport = make_host_transport(0, 1, kCommIdentity, {Where::Gather, 0});
  std::vector<uint8_t> send(64, 5), recv(64, 0);
  WindowPlan plan = staging_plan(64);
  plan.bound = true;
  plan.bind = {{send.data(), send.size(), 0}};
  HandleBlob blob;
  transport->prepare(plan, blob);
  transport->attach(std::span<const HandleBlob>(&blob, 1));
  const GatherOp op{send.data(), recv.data(), send.size(), 0};
  EXPECT_EQ(transport->gather(std::span<const GatherOp>(&op, 1), nullptr),
            Transport::Served::Moved);
  EXPECT_EQ(recv, send);
  transport->release();
}

TEST(HostTransportFaults, SlowFaultDelaysEveryBucketOfThatRankAndStillMovesIt) {
  auto transport = make_host_transport(0, 1, kCommIdentity, {Where::Slow, 0});
  HandleBlob blob;
  transport->prepare(staging_plan(64), blob);
  transport->attach(std::span<const HandleBlob>(&blob, 1));
  std::vector<uint8_t> send(64, 9), recv(64, 0);
  const GatherOp op{send.data(), recv.data(), send.size(), 0};
  for (int b = 0; b < 2; ++b) {
    const auto started = std::chrono::steady_clock::now();
    EXPECT_EQ(transport->gather(std::span<const GatherOp>(&op, 1), nullptr),
              Transport::Served::Moved);
    EXPECT_GE(std::chrono::steady_clock::now() - started, std::chrono::milliseconds(20))
        << "bucket " << b;
    EXPECT_EQ(recv, send);
  }
  transport->release();
}

// Without a driver in the process the CUDA backend refuses at once, and never loads CUDA itself.
TEST(CudaTransport, RefusesWithoutADriverAndNeverLoadsOne) {
  if (dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY) != nullptr)
    GTEST_SKIP() << "a CUDA driver is loaded";
  try {
    make_transport(Backend::Cuda, 0, 2, kCommIdentity);
    ADD_FAILURE() << "a CUDA transport without a driver";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::System);
  }
  try {
    make_exchange(Backend::Cuda, 1024, 2);
    ADD_FAILURE() << "a CUDA exchange without a driver";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::System);
  }
  EXPECT_FALSE(backend_available(Backend::Cuda));
  EXPECT_TRUE(backend_available(Backend::Host));
  EXPECT_EQ(dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY), nullptr);
}

// ---- memory and locality ----------------------------------------------------------------------

bool cuda_driver_in_process() {
  void* driver = dlopen("libcuda.so.1", RTLD_NOLOAD | RTLD_LAZY);
  if (driver != nullptr) dlclose(driver);
  return driver != nullptr;
}

TEST(Memory, HostBackendCallsEveryBufferHostMemory) {
  std::vector<uint8_t> heap(64);
  int stack = 0;
  for (const void* p : {static_cast<const void*>(heap.data()), static_cast<const void*>(&stack)}) {
    const BufferIdentity id = identify_buffer(Backend::Host, p);
    EXPECT_EQ(id.kind, MemoryKind::Host);
    EXPECT_EQ(id.allocation_id, 0u);
    EXPECT_EQ(id.device, -1);
  }
}

TEST(Memory, CudaBackendWithoutADriverKnowsNothingAndLoadsNoDriver) {
  if (cuda_driver_in_process()) GTEST_SKIP() << "this process has the CUDA driver loaded";
  std::vector<uint8_t> heap(64);
  const BufferIdentity id = identify_buffer(Backend::Cuda, heap.data());
  EXPECT_EQ(id.kind, MemoryKind::Unknown);
  const Locality here = local_locality(Backend::Cuda, 0);
  EXPECT_EQ(here.device, -1);
  EXPECT_EQ(here.peer_access_mask, 0u);
  EXPECT_EQ(here.host, local_locality(Backend::Host, 0).host);
  EXPECT_FALSE(cuda_driver_in_process());
}

TEST(Locality, HostBackendGivesTheSameHostTwiceAndNoDevice) {
  const Locality first = local_locality(Backend::Host, 0);
  const Locality second = local_locality(Backend::Host, 3);
  EXPECT_NE(first.host, 0u);
  EXPECT_EQ(first.host, second.host);
  EXPECT_EQ(first.device, -1);
  EXPECT_EQ(first.peer_access_mask, 0u);
}

// ---- exchange ---------------------------------------------------------------------------------

TEST(HostExchange, ResultIsWhatTheAllGatherWroteOnceIssued) {
  constexpr size_t kBytes = 24;
  constexpr int kRanks = 3;
  auto exchange = make_exchange(Backend::Host, kBytes, kRanks);
  std::vector<uint8_t> contribution(kBytes);
  for (size_t i = 0; i < kBytes; ++i) contribution[i] = static_cast<uint8_t>(i + 1);
  exchange->stage(contribution);
  EXPECT_EQ(std::memcmp(exchange->send_buffer(), contribution.data(), kBytes), 0);
  EXPECT_FALSE(exchange->ready());
  // The all-gather, as the stand-in would do it.
  auto* recv = static_cast<uint8_t*>(exchange->recv_buffer());
  for (int r = 0; r < kRanks; ++r)
    for (size_t i = 0; i < kBytes; ++i)
      recv[static_cast<size_t>(r) * kBytes + i] = static_cast<uint8_t>(r * 100 + i);
  exchange->issued();
  EXPECT_TRUE(exchange->ready());
  const std::span<const uint8_t> result = exchange->result();
  ASSERT_EQ(result.size(), kBytes * kRanks);
  for (size_t i = 0; i < result.size(); ++i)
    EXPECT_EQ(result[i], static_cast<uint8_t>(i / kBytes * 100 + i % kBytes));
  exchange->stage(contribution);
  EXPECT_FALSE(exchange->ready());  // a new round is not ready until issued
}

}  // namespace
}  // namespace magi::ce
