// Zero-copy static weights: which shards the peers read where the program keeps them, and the
// checks that stand in for a binding. Private to ce_transport/.
//
// What a peer's mapping of an exported allocation sees when the owner lets go of the memory
// (measured on an H200 for CUDA IPC, and the same for a shared file mapping): after the owner
// frees the allocation, the peer's mapping keeps the old pages (they are freed when the peer
// unmaps), so it reads the old bytes, which the static-weights promise says are the right ones,
// even when the owner's allocator hands the same address out again. What a mapping cannot survive
// is reuse inside a live allocation: a caching allocator (PyTorch's) gives a freed block of a
// segment to another tensor without freeing the segment, and the peers then read that tensor.
// The owner's checks look for it (ZeroCopyCheck): the memory its peers read must still hold what
// its first check saw.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ce_transport/ce_transport.h"
#include "ce_transport/fd_channel.h"
#include "ce_transport/sample_plan.h"

namespace magi::ce::exports {

// One shard's allocation, as its backend found it.
struct Exportable {
  bool ok = false;
  uintptr_t base = 0;  // the allocation's start; the shard lies at sendbuf - base
  ExportRecord record{};
  uint64_t identity = 0;  // what tells this allocation from a later one at the same address
  std::string refusal;    // !ok: why the peers cannot read it in place
  // record.kind ByDescriptor: the physical allocations mapped one after the other from `base`
  // (start, size), which the peers map in the same order, so they see record.bytes contiguous.
  std::vector<std::pair<uintptr_t, size_t>> pieces;
};

// Which shards of a zero-copy plan are exported and which are copied into the region, packed at
// 256-byte offsets; every allocation exported once (a shard inside an export already made, one
// with its base that covers it, reads that one). Sources past the table's room are bound.
struct SourcePlan {
  SourceTable table;
  size_t region_bytes = 0;              // the bound shards, packed
  std::vector<uint64_t> identities;     // by export: Exportable::identity
  std::vector<uintptr_t> export_bases;  // by export
  WindowMemory memory;                  // everything but window_bytes and peer_mappings
};
SourcePlan plan_sources(const WindowPlan& plan,
                        const std::function<Exportable(const BindOp&)>& find_export);

// The symmetric layout of a plan that is not zero-copy: every shard at its slot offset.
SourcePlan symmetric_sources(const WindowPlan& plan);
// A bound plan's sources on this rank: plan_sources when the plan is zero-copy, else
// symmetric_sources.
SourcePlan bound_sources(const WindowPlan& plan,
                         const std::function<Exportable(const BindOp&)>& find_export);

// Where every peer's shard of each binding is read, found at attach: in the peer's window
// region, or in one of its exported allocations, mapped once through `map` (which returns its
// base and size). `tables` by rank (empty: the plan is symmetric). [peer * shards + bind index].
struct Span {
  const uint8_t* base;
  size_t bytes;
};
std::vector<const uint8_t*> locate_peer_sources(
    int rank, const std::vector<BindOp>& bind, std::span<const SourceTable> tables,
    const std::vector<Span>& regions, const std::function<Span(const ExportRecord&)>& map);

// Hot-path lookup: the bind index of the gather at `slot_offset` (binary search; -1: none).
class BindIndex {
 public:
  void reset(const std::vector<BindOp>& bind);
  int64_t find(size_t slot_offset) const;
  size_t size() const { return count_; }

 private:
  std::vector<std::pair<size_t, uint32_t>> sorted_;
  size_t count_ = 0;
};

// The sample sets' hashes a zero-copy shard's first check saw: there is no binding to compare a
// later check with, so the reference is what the memory the peers read held then (the anchor at
// the shard's first check, each sweep set at its first visit). A rewrite is caught when it lands
// between two looks at a set; one made before the shard's first check is what the peers read
// too, so it is not a wrong byte.
class SampleReferences {
 public:
  void reset(size_t shards) { references_.assign(shards, {}); }
  // True when `hash` is the reference of shard `index`'s set at `first`, or it had none yet.
  // `hash` becomes the reference either way: a change is reported once, not at every check.
  bool matches(size_t index, size_t first, uint64_t hash) {
    auto [it, inserted] = references_[index].emplace(first, hash);
    return inserted || std::exchange(it->second, hash) == hash;
  }
  // Whether a reference of the set at `first` exists (so a re-homed shard can be compared).
  bool has(size_t index, size_t first) const { return references_[index].count(first) != 0; }

 private:
  std::vector<std::unordered_map<size_t, uint64_t>> references_;
};

// Whether `op` sends its shard from another buffer than `binding`'s (a re-homed shard) or reads
// `binding` for another position (keyed by tensor: rewrite/serving.h, BoundSources). Its check
// then compares two things that the static-weights promise alone does not make equal, and a
// mismatch means the peers read bytes this call does not send: never a rewrite in place, always
// reported on every rank (source_log.h). And the binding, another position's or the one the
// buffer was re-homed from, is never re-bound from this buffer.
inline bool sent_elsewhere(const GatherOp& op, const BindOp& binding) {
  return op.sendbuf != binding.sendbuf || op.own_offset != GatherOp::kOwn;
}

// An export by descriptor (ExportRecord::Kind::ByDescriptor): its handle bytes say where the
// owner's descriptor channel listens, its index which offer there hands the descriptors.
void set_descriptor_source(ExportRecord& record, const fd_channel::Address& address,
                           uint32_t index);
// Throws Error(Usage) on a record that is not by descriptor or does not say where to ask.
fd_channel::Address descriptor_source(const ExportRecord& record);

// XXH3 of the lines of `set`, packed one after the other as the CUDA backend copies them.
uint64_t hash_packed(const uint8_t* packed, const SampleSet& set);
// The same hash, of the lines read in place from a shard.
uint64_t hash_lines(const uint8_t* shard, const SampleSet& set, std::vector<uint8_t>& scratch);

}  // namespace magi::ce::exports

namespace magi::ce::exports {

// ---- the host backend's exports: a shard in a shared mapping of a named file in /dev/shm ----
// The peers open the file by name (the inode must still be the owner's) and map the same file
// range. Shared memory no peer can open by name (a memfd_create file, a /dev/shm file removed)
// is exported by descriptor (kind ByDescriptor, the mapping its one piece): its owner's backend
// offers a descriptor of the file (host_memory_ops.cc). Memory from malloc, anonymous mappings
// and files elsewhere are not exportable.
Exportable find_host_export(const void* ptr, size_t bytes);
// For an export by descriptor: a new descriptor (close-on-exec) of the file mapped at `base`
// with inode `identity`, from a descriptor this process still holds of it, or else from
// /proc/self/map_files; `file_offset` gets the mapping's offset in the file. Throws
// Error(System) saying why there is none.
int host_export_descriptor(uintptr_t base, size_t bytes, uint64_t identity, uint64_t& file_offset);
// find_host_export over this process's mappings as they are now, read once: for a whole plan.
std::function<Exportable(const void* ptr, size_t bytes)> host_export_finder();
// Whether the mapping that holds `base` is still the exported one (`identity`: its inode,
// `bytes`: the exported mapping's size, ExportRecord::bytes).
bool host_export_alive(uintptr_t base, size_t bytes, uint64_t identity);

// ---- the CUDA backend's exports ----
// A cudaMalloc allocation, by the IPC handle of its base (kind Handle); else cuMemCreate memory
// (PyTorch's expandable segments) made shareable as a POSIX file descriptor: the physical
// allocations mapped under the shard, walked in order (kind ByDescriptor, `pieces`; the record's
// handle and index are filled by the backend that offers them: cuda_memory_ops.cc). Refused:
// cuMemCreate memory made without that handle type, pools, managed memory. Only once the
// program has loaded the driver.
Exportable find_cuda_export(const void* sendbuf, size_t bytes);

// A peer's exported allocation, mapped read-only into this process; unmapped when destroyed.
class HostImport {
 public:
  // By name, or by descriptor from the owner's channel (a failure to get it throws
  // Error(System)).
  static HostImport open(const ExportRecord& record);
  HostImport() = default;
  HostImport(HostImport&& other) noexcept;
  HostImport& operator=(HostImport&& other) noexcept;
  ~HostImport();
  const uint8_t* data() const { return static_cast<const uint8_t*>(base_); }
  size_t size() const { return bytes_; }

 private:
  void* base_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace magi::ce::exports
