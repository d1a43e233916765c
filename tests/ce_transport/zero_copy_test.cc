// Zero-copy static weights on the host backend, in one process (a bound gather has no handshake,
// so one thread runs every rank): shards in a shared mapping of a /dev/shm file are read by the
// peers where they lie, shards elsewhere are bound; the source table travels as the publish round
// carries it; a change in place is found; a freed export keeps its pages for the peers.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "base/base.h"
#include "ce_transport/ce_transport.h"
#include "ce_transport/exports.h"

namespace magi::ce {
namespace {

constexpr uint64_t kCommIdentity = 0x5eed'c0ff'ee00'0077;

// One file in /dev/shm, mapped shared: what a program's exportable allocation is here.
class SharedFile {
 public:
  explicit SharedFile(size_t bytes) : bytes_(bytes) {
    static int serial = 0;
    name_ = "/magice-test-zc-" + std::to_string(getpid()) + "-" + std::to_string(serial++);
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    base_ = static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
  }
  ~SharedFile() {
    unmap();
    shm_unlink(name_.c_str());
  }
  // The program frees it: unmapped and its name removed.
  void unmap() {
    if (base_ == nullptr) return;
    munmap(base_, bytes_);
    shm_unlink(name_.c_str());
    base_ = nullptr;
  }
  uint8_t* data() const { return base_; }

 private:
  size_t bytes_;
  std::string name_;
  uint8_t* base_ = nullptr;
};

uint8_t pattern(int rank, size_t shard, size_t i) {
  return static_cast<uint8_t>(rank * 31 + shard * 7 + i * 13 + i / 251);
}

// Two shards of each rank in one shared file (one export), a third on the heap (bound).
class ZeroCopyRanks {
 public:
  static constexpr size_t kBytes[] = {5000, 70000, 3000};

  explicit ZeroCopyRanks(int nranks) : nranks_(nranks) {
    tables_.resize(static_cast<size_t>(nranks));
    blobs_.resize(static_cast<size_t>(nranks));
    for (int r = 0; r < nranks; ++r) {
      files_.push_back(std::make_unique<SharedFile>(size_t{1} << 20));
      heap_.emplace_back(kBytes[2]);
      recv_.emplace_back();
      std::vector<const uint8_t*> shards = {files_.back()->data() + 4096,
                                            files_.back()->data() + 65536, heap_.back().data()};
      WindowPlan plan;
      plan.bound = true;
      plan.zero_copy = true;
      plan.table_room = 24 * 1024;
      plan.verify_first = 1;
      plan.verify_every = 2;
      size_t offset = 0;
      for (size_t g = 0; g < 3; ++g) {
        auto* at = const_cast<uint8_t*>(shards[g]);
        for (size_t i = 0; i < kBytes[g]; ++i) at[i] = pattern(r, g, i);
        plan.bind.push_back({at, kBytes[g], offset});
        offset += (kBytes[g] + 255) / 256 * 256;
        recv_.back().emplace_back(kBytes[g] * static_cast<size_t>(nranks));
      }
      plan.slot_bytes = offset;
      send_.push_back(shards);
      plans_.push_back(plan);
      transports_.push_back(make_transport(Backend::Host, r, nranks, kCommIdentity));
      transports_.back()->prepare(plan, blobs_[static_cast<size_t>(r)]);
      // As the publish round carries it: serialized, parsed on the other side.
      const SourceTable& table = transports_.back()->sources();
      std::vector<uint8_t> bytes(table.bytes() + 8);
      table.serialize(bytes);
      tables_[static_cast<size_t>(r)] = SourceTable::parse(bytes);
    }
    for (auto& t : transports_) t->attach(blobs_, tables_);
  }
  ~ZeroCopyRanks() {
    for (auto& t : transports_) t->release();
  }

  // One call of every gather on every rank; the stale bindings rank 0 reported.
  size_t call() {
    size_t stale = 0;
    for (int r = 0; r < nranks_; ++r) {
      std::vector<GatherOp> ops;
      for (size_t g = 0; g < 3; ++g)
        ops.push_back({send_[static_cast<size_t>(r)][g], recv_[static_cast<size_t>(r)][g].data(),
                       kBytes[g], plans_[static_cast<size_t>(r)].bind[g].slot_offset});
      transports_[static_cast<size_t>(r)]->gather(ops, nullptr);
      const size_t found = transports_[static_cast<size_t>(r)]->take_stale_bindings().size();
      if (r == 0) stale = found;
    }
    return stale;
  }
  // Wrong bytes that rank `reader` received of `owner`'s shard `g`, against `expected`.
  size_t wrong(int reader, int owner, size_t g, const std::function<uint8_t(size_t)>& expected) {
    const uint8_t* part =
        recv_[static_cast<size_t>(reader)][g].data() + static_cast<size_t>(owner) * kBytes[g];
    size_t n = 0;
    for (size_t i = 0; i < kBytes[g]; ++i) n += part[i] != expected(i) ? 1 : 0;
    return n;
  }
  Transport& transport(int r) { return *transports_[static_cast<size_t>(r)]; }
  uint8_t* shard(int r, size_t g) { return const_cast<uint8_t*>(send_[static_cast<size_t>(r)][g]); }
  SharedFile& file(int r) { return *files_[static_cast<size_t>(r)]; }

 private:
  int nranks_;
  std::vector<std::unique_ptr<SharedFile>> files_;
  std::vector<std::vector<uint8_t>> heap_;
  std::vector<std::vector<const uint8_t*>> send_;
  std::vector<std::vector<std::vector<uint8_t>>> recv_;
  std::vector<WindowPlan> plans_;
  std::vector<std::unique_ptr<Transport>> transports_;
  std::vector<HandleBlob> blobs_;
  std::vector<SourceTable> tables_;
};

TEST(ZeroCopy, ExportableShardsAreReadInPlaceAndOnlyTheOthersAreCopied) {
  ZeroCopyRanks ranks(3);
  for (int r = 0; r < 3; ++r) {
    const WindowMemory m = ranks.transport(r).memory();
    EXPECT_EQ(m.exported_shards, 2u);
    EXPECT_EQ(m.exported_allocations, 1u);  // two shards, one file: exported once
    EXPECT_EQ(m.exported_bytes, ZeroCopyRanks::kBytes[0] + ZeroCopyRanks::kBytes[1]);
    EXPECT_EQ(m.bound_shards, 1u);
    EXPECT_EQ(m.bound_bytes, ZeroCopyRanks::kBytes[2]);
    EXPECT_EQ(m.first_refused, 2);
    EXPECT_NE(m.refusal.find("/dev/shm"), std::string::npos) << m.refusal;
    EXPECT_EQ(m.peer_mappings, 2u);  // one allocation of each peer
    // The window holds its head, flags and the one bound shard, not the 75 KB exported.
    EXPECT_LT(m.window_bytes, 8192u);
  }
  EXPECT_EQ(ranks.call(), 0u);
  for (int reader = 0; reader < 3; ++reader)
    for (int owner = 0; owner < 3; ++owner)
      for (size_t g = 0; g < 3; ++g)
        EXPECT_EQ(ranks.wrong(reader, owner, g, [&](size_t i) { return pattern(owner, g, i); }), 0u)
            << reader << " reading " << owner << " shard " << g;
}

TEST(ZeroCopy, AChangeInPlaceIsReadByThePeersAndFoundByItsOwner) {
  ZeroCopyRanks ranks(2);
  EXPECT_EQ(ranks.call(), 0u);  // the first check: the references
  // A broken promise: rank 0 rewrites a line of the anchor of its second shard.
  ranks.shard(0, 1)[0] ^= 0xff;
  // Zero-copy: the peer reads the memory itself, so it sees the change at once, and the owner's
  // next check (call 2: every 2 calls) reports it, once: call 4's check finds nothing new.
  EXPECT_EQ(ranks.call(), 1u);
  const auto changed = [&](size_t i) {
    return static_cast<uint8_t>(i == 0 ? pattern(0, 1, i) ^ 0xff : pattern(0, 1, i));
  };
  EXPECT_EQ(ranks.wrong(1, 0, 1, changed), 0u);
  EXPECT_EQ(ranks.call(), 0u);
  EXPECT_EQ(ranks.call(), 0u);
  EXPECT_EQ(ranks.wrong(1, 0, 1, changed), 0u);
}

TEST(ZeroCopy, AFreedExportKeepsItsPagesForThePeers) {
  ZeroCopyRanks ranks(2);
  EXPECT_EQ(ranks.call(), 0u);
  // Rank 0 frees its allocation (unmaps the file, removes its name): rank 1's mapping keeps the
  // pages, and reads the shard as it was. Rank 0 itself now sends from a copy elsewhere.
  std::vector<uint8_t> moved(ranks.shard(0, 0), ranks.shard(0, 0) + ZeroCopyRanks::kBytes[0]);
  ranks.file(0).unmap();
  // Only rank 1 gathers here: rank 0's own send buffers are gone with its file.
  std::vector<std::vector<uint8_t>> recv;
  std::vector<GatherOp> ops;
  for (size_t g = 0; g < 3; ++g) recv.emplace_back(2 * ZeroCopyRanks::kBytes[g]);
  size_t offset = 0;
  for (size_t g = 0; g < 3; ++g) {
    ops.push_back({ranks.shard(1, g), recv[g].data(), ZeroCopyRanks::kBytes[g], offset});
    offset += (ZeroCopyRanks::kBytes[g] + 255) / 256 * 256;
  }
  ranks.transport(1).gather(ops, nullptr);
  for (size_t g = 0; g < 2; ++g)
    for (size_t i = 0; i < ZeroCopyRanks::kBytes[g]; ++i)
      ASSERT_EQ(recv[g][i], pattern(0, g, i)) << "shard " << g << " byte " << i;
}

TEST(SourceTable, RoundTripsAndRefusesWhatDoesNotParse) {
  SourceTable t;
  ExportRecord e{};
  e.handle[0] = 7;
  e.bytes = 1 << 20;
  t.exports = {e};
  t.sources = {{0, 4096}, {ShardSource::kInWindow, 256}, {0, SourceTable::kMaxOffset}};
  std::vector<uint8_t> bytes(t.bytes() + 8);
  t.serialize(bytes);
  const SourceTable back = SourceTable::parse(bytes);
  ASSERT_EQ(back.exports.size(), 1u);
  EXPECT_EQ(back.exports[0].handle[0], 7);
  EXPECT_EQ(back.exports[0].bytes, uint64_t{1} << 20);
  ASSERT_EQ(back.sources.size(), 3u);
  EXPECT_EQ(back.sources[0].allocation, 0);
  EXPECT_EQ(back.sources[0].offset, 4096u);
  EXPECT_EQ(back.sources[1].allocation, ShardSource::kInWindow);
  EXPECT_EQ(back.sources[2].offset, SourceTable::kMaxOffset);
  // A source naming an export that is not there, and a table longer than its bytes.
  std::vector<uint8_t> bad = bytes;
  const uint64_t word = uint64_t{3} << 48;
  std::memcpy(bad.data() + 8 + SourceTable::kExportBytes, &word, 8);
  EXPECT_THROW(SourceTable::parse(bad), Error);
  EXPECT_THROW(SourceTable::parse(std::span<const uint8_t>(bytes.data(), bytes.size() - 1)), Error);
  // An export of a kind this build does not know.
  std::vector<uint8_t> unknown = bytes;
  const uint32_t kind = 9;
  std::memcpy(unknown.data() + 8 + offsetof(ExportRecord, kind), &kind, 4);
  EXPECT_THROW(SourceTable::parse(unknown), Error);
}

TEST(SourceTable, ARecordByDescriptorKeepsItsKindAndIndex) {
  SourceTable t;
  ExportRecord e{};
  e.kind = ExportRecord::Kind::ByDescriptor;
  e.index = 41;
  e.bytes = 6 << 20;
  t.exports = {e};
  t.sources = {{0, 0}};
  std::vector<uint8_t> bytes(t.bytes() + 8);
  t.serialize(bytes);
  const SourceTable back = SourceTable::parse(bytes);
  ASSERT_EQ(back.exports.size(), 1u);
  EXPECT_EQ(back.exports[0].kind, ExportRecord::Kind::ByDescriptor);
  EXPECT_EQ(back.exports[0].index, 41u);
}

// Expandable segments map granules one after the other: a shard that lies in the first only is
// exported as that granule; a later shard of the same base that runs into the second needs an
// export of both, not the first's (its peers would find it outside the allocation).
TEST(SourceTable, AShardPastAnExportOfItsBaseGetsAnExportThatCoversIt) {
  static uint8_t memory[4 << 20];
  const auto base = reinterpret_cast<uintptr_t>(memory);
  WindowPlan plan;
  plan.bound = true;
  plan.zero_copy = true;
  plan.table_room = 1 << 16;
  plan.bind = {
      {memory, 1 << 20, 0}, {memory + (1 << 20), 2 << 20, 1 << 20}, {memory + 256, 256, 3 << 20}};
  const exports::SourcePlan p = exports::plan_sources(plan, [&](const BindOp& b) {
    exports::Exportable e;
    e.ok = true;
    e.base = base;
    const size_t end = reinterpret_cast<uintptr_t>(b.sendbuf) - base + b.bytes;
    e.record.bytes = end <= (2 << 20) ? 2 << 20 : 4 << 20;  // the granules under the shard
    e.record.kind = ExportRecord::Kind::ByDescriptor;
    return e;
  });
  ASSERT_EQ(p.table.exports.size(), 2u);
  EXPECT_EQ(p.table.sources[0].allocation, 0);
  EXPECT_EQ(p.table.sources[1].allocation, 1);
  EXPECT_EQ(p.table.sources[1].offset, 1u << 20);
  EXPECT_EQ(p.table.sources[2].allocation, 0);  // inside the first export: read there
  EXPECT_EQ(p.memory.bound_shards, 0u);
}

// Every reason a shard is bound for is counted, with its shards' bytes and the first of them
// (the INFO line and the trace's windows table say each): not only the first reason met.
TEST(SourceTable, EveryReasonShardsAreBoundForIsCounted) {
  static uint8_t memory[1 << 16];
  WindowPlan plan;
  plan.bound = true;
  plan.zero_copy = true;
  plan.table_room = 1 << 16;
  plan.bind = {{memory, 100, 0},
               {memory + 512, 200, 256},
               {memory + 1024, 300, 512},
               {memory + 2048, 400, 1024},
               {memory + 4096, 500, 2048}};
  const exports::SourcePlan p = exports::plan_sources(plan, [&](const BindOp& b) {
    exports::Exportable e;
    const size_t at = static_cast<size_t>(static_cast<const uint8_t*>(b.sendbuf) - memory);
    if (at == 0) {  // the one exportable shard
      e.ok = true;
      e.base = reinterpret_cast<uintptr_t>(memory);
      e.record.bytes = sizeof(memory);
      return e;
    }
    e.refusal = at == 1024 || at == 4096 ? "from a pool" : "managed memory";
    return e;
  });
  EXPECT_EQ(p.memory.exported_shards, 1u);
  EXPECT_EQ(p.memory.bound_shards, 4u);
  ASSERT_EQ(p.memory.refusals.size(), 2u);
  EXPECT_EQ(p.memory.refusals[0].why, "managed memory");  // in the order first met
  EXPECT_EQ(p.memory.refusals[0].shards, 2u);
  EXPECT_EQ(p.memory.refusals[0].bytes, 200u + 400u);
  EXPECT_EQ(p.memory.refusals[0].first, 1);
  EXPECT_EQ(p.memory.refusals[1].why, "from a pool");
  EXPECT_EQ(p.memory.refusals[1].shards, 2u);
  EXPECT_EQ(p.memory.refusals[1].bytes, 300u + 500u);
  EXPECT_EQ(p.memory.refusals[1].first, 2);
}

TEST(SourceTable, ShardsPastTheTablesRoomAreBound) {
  SharedFile a(1 << 16), b(1 << 16);
  WindowPlan plan;
  plan.bound = true;
  plan.zero_copy = true;
  plan.bind = {{a.data(), 100, 0}, {b.data(), 100, 256}};
  plan.slot_bytes = 512;
  // Room for the counts, both sources and one export only.
  plan.table_room = 8 + 2 * SourceTable::kSourceBytes + SourceTable::kExportBytes;
  const exports::SourcePlan p = exports::plan_sources(
      plan, [](const BindOp& op) { return exports::find_host_export(op.sendbuf, op.bytes); });
  EXPECT_EQ(p.memory.exported_shards, 1u);
  EXPECT_EQ(p.memory.bound_shards, 1u);
  EXPECT_EQ(p.memory.first_refused, 1);
  EXPECT_NE(p.memory.refusal.find("no room"), std::string::npos) << p.memory.refusal;
  EXPECT_LE(p.table.bytes() + 8, plan.table_room);
}

}  // namespace
}  // namespace magi::ce
