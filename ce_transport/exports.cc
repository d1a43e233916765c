#include "ce_transport/exports.h"

#include <algorithm>
#include <cstring>
#include <map>

#include "base/base.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace magi::ce {

void SourceTable::serialize(std::span<uint8_t> out) const {
  if (out.size() < bytes() + 8) throw Error(ErrorKind::Internal, "a source table overflows");
  const auto exports_count = static_cast<uint32_t>(exports.size());
  const auto sources_count = static_cast<uint32_t>(sources.size());
  uint8_t* at = out.data();
  std::memcpy(at, &exports_count, 4);
  std::memcpy(at + 4, &sources_count, 4);
  at += 8;
  for (const ExportRecord& e : exports) {
    std::memcpy(at, &e, kExportBytes);
    at += kExportBytes;
  }
  for (const ShardSource& s : sources) {
    const uint64_t word = uint64_t{s.allocation} << 48 | (s.offset & kMaxOffset);
    std::memcpy(at, &word, kSourceBytes);
    at += kSourceBytes;
  }
}

SourceTable SourceTable::parse(std::span<const uint8_t> in) {
  uint32_t exports_count = 0, sources_count = 0;
  if (in.size() < 8) throw Error(ErrorKind::Usage, "a source table without its counts");
  std::memcpy(&exports_count, in.data(), 4);
  std::memcpy(&sources_count, in.data() + 4, 4);
  const uint64_t need =
      8 + uint64_t{exports_count} * kExportBytes + uint64_t{sources_count} * kSourceBytes;
  if (need > in.size() || exports_count >= ShardSource::kInWindow)
    throw Error(ErrorKind::Usage, "a source table of " + std::to_string(exports_count) +
                                      " exports and " + std::to_string(sources_count) +
                                      " sources overflows its " + std::to_string(in.size()) +
                                      " bytes");
  SourceTable table;
  const uint8_t* at = in.data() + 8;
  table.exports.resize(exports_count);
  for (ExportRecord& e : table.exports) {
    std::memcpy(&e, at, kExportBytes);
    at += kExportBytes;
    if (e.kind != ExportRecord::Kind::Handle && e.kind != ExportRecord::Kind::ByDescriptor)
      throw Error(ErrorKind::Usage,
                  "an export of unknown kind " + std::to_string(static_cast<uint32_t>(e.kind)));
  }
  table.sources.resize(sources_count);
  for (ShardSource& s : table.sources) {
    uint64_t word = 0;
    std::memcpy(&word, at, kSourceBytes);
    at += kSourceBytes;
    s.allocation = static_cast<uint16_t>(word >> 48);
    s.offset = word & kMaxOffset;
    if (s.allocation != ShardSource::kInWindow && s.allocation >= exports_count)
      throw Error(ErrorKind::Usage, "a source names export " + std::to_string(s.allocation) +
                                        " of " + std::to_string(exports_count));
  }
  return table;
}

namespace exports {

SourcePlan plan_sources(const WindowPlan& plan,
                        const std::function<Exportable(const BindOp&)>& find_export) {
  SourcePlan out;
  const size_t fixed = 8 + plan.bind.size() * SourceTable::kSourceBytes;
  if (fixed > plan.table_room)
    throw Error(ErrorKind::Usage, std::to_string(plan.bind.size()) +
                                      " shards do not fit the source table's " +
                                      std::to_string(plan.table_room) + " bytes");
  size_t room = plan.table_room - fixed;
  std::multimap<uintptr_t, uint16_t> by_base;  // an export may cover more than another of its base
  out.table.sources.resize(plan.bind.size());
  for (size_t i = 0; i < plan.bind.size(); ++i) {
    const BindOp& b = plan.bind[i];
    ShardSource& source = out.table.sources[i];
    std::string refusal;
    if (b.bytes != 0) {
      Exportable e = find_export(b);
      if (e.ok) {
        // A shard of a walked range (cuMemCreate pieces) may end past an export of its base.
        const uint64_t end = reinterpret_cast<uintptr_t>(b.sendbuf) - e.base + b.bytes;
        auto [it, last] = by_base.equal_range(e.base);
        while (it != last && out.table.exports[it->second].bytes < end) ++it;
        if (it == last) it = by_base.end();
        if (it == by_base.end() && room >= SourceTable::kExportBytes &&
            out.table.exports.size() + 1 < ShardSource::kInWindow) {
          room -= SourceTable::kExportBytes;
          it = by_base.emplace(e.base, static_cast<uint16_t>(out.table.exports.size()));
          out.table.exports.push_back(e.record);
          out.identities.push_back(e.identity);
          out.export_bases.push_back(e.base);
        }
        if (it != by_base.end()) {
          source.allocation = it->second;
          source.offset = reinterpret_cast<uintptr_t>(b.sendbuf) - e.base;
          ++out.memory.exported_shards;
          out.memory.exported_bytes += b.bytes;
          continue;
        }
        refusal = "the publish round has no room for another allocation";
      } else {
        refusal = e.refusal;
      }
    }
    source.allocation = ShardSource::kInWindow;
    source.offset = out.region_bytes;
    out.region_bytes += round_up(b.bytes, kSlotAlignment);
    if (b.bytes == 0) continue;
    ++out.memory.bound_shards;
    out.memory.bound_bytes += b.bytes;
    if (out.memory.first_refused < 0) {
      out.memory.first_refused = static_cast<int64_t>(i);
      out.memory.refusal = refusal;
    }
    auto reason = std::find_if(out.memory.refusals.begin(), out.memory.refusals.end(),
                               [&](const WindowMemory::Refusal& r) { return r.why == refusal; });
    if (reason == out.memory.refusals.end())
      reason = out.memory.refusals.insert(reason, {refusal, 0, 0, static_cast<int64_t>(i)});
    ++reason->shards;
    reason->bytes += b.bytes;
  }
  out.memory.exported_allocations = out.table.exports.size();
  return out;
}

SourcePlan symmetric_sources(const WindowPlan& plan) {
  SourcePlan out;
  out.region_bytes = plan.slot_bytes;
  out.table.sources.resize(plan.bind.size());
  for (size_t i = 0; i < plan.bind.size(); ++i) {
    out.table.sources[i].offset = plan.bind[i].slot_offset;
    if (plan.bind[i].bytes == 0) continue;
    ++out.memory.bound_shards;
    out.memory.bound_bytes += plan.bind[i].bytes;
  }
  return out;
}

SourcePlan bound_sources(const WindowPlan& plan,
                         const std::function<Exportable(const BindOp&)>& find_export) {
  return plan.zero_copy ? plan_sources(plan, find_export) : symmetric_sources(plan);
}

std::vector<const uint8_t*> locate_peer_sources(
    int rank, const std::vector<BindOp>& bind, std::span<const SourceTable> tables,
    const std::vector<Span>& regions, const std::function<Span(const ExportRecord&)>& map) {
  const size_t shards = bind.size();
  const int nranks = static_cast<int>(regions.size());
  std::vector<const uint8_t*> sources(regions.size() * shards, nullptr);
  for (int r = 0; r < nranks; ++r) {
    if (r == rank) continue;
    const std::string who = "rank " + std::to_string(r) + "'s ";
    const SourceTable* table = tables.empty() ? nullptr : &tables[static_cast<size_t>(r)];
    if (table != nullptr && table->sources.size() != shards)
      throw Error(ErrorKind::Usage, who + "source table has " +
                                        std::to_string(table->sources.size()) + " shards, " +
                                        std::to_string(shards) + " expected");
    std::vector<Span> mapped;  // by export
    if (table != nullptr)
      for (const ExportRecord& record : table->exports) mapped.push_back(map(record));
    for (size_t i = 0; i < shards; ++i) {
      const ShardSource source = table != nullptr
                                     ? table->sources[i]
                                     : ShardSource{ShardSource::kInWindow, bind[i].slot_offset};
      const Span in = source.allocation == ShardSource::kInWindow ? regions[static_cast<size_t>(r)]
                                                                  : mapped[source.allocation];
      if (source.offset > in.bytes || bind[i].bytes > in.bytes - source.offset)
        throw Error(
            ErrorKind::Usage,
            who + "shard lies outside its " +
                (source.allocation == ShardSource::kInWindow ? "window" : "exported allocation"));
      sources[static_cast<size_t>(r) * shards + i] = in.base + source.offset;
    }
  }
  return sources;
}

void BindIndex::reset(const std::vector<BindOp>& bind) {
  sorted_.clear();
  for (size_t i = 0; i < bind.size(); ++i)
    sorted_.emplace_back(bind[i].slot_offset, static_cast<uint32_t>(i));
  std::sort(sorted_.begin(), sorted_.end());
  count_ = bind.size();
}

int64_t BindIndex::find(size_t slot_offset) const {
  const auto it =
      std::lower_bound(sorted_.begin(), sorted_.end(), std::pair<size_t, uint32_t>{slot_offset, 0});
  if (it == sorted_.end() || it->first != slot_offset) return -1;
  return it->second;
}

namespace {
// What an ExportRecord by descriptor holds in its handle.
struct DescriptorSource {
  static constexpr uint32_t kMagic = 0x4d46'4453;  // "MFDS"
  uint32_t magic;
  uint32_t reserved;
  fd_channel::Address address;
};
static_assert(sizeof(DescriptorSource) <= sizeof(ExportRecord::handle));
}  // namespace

void set_descriptor_source(ExportRecord& record, const fd_channel::Address& address,
                           uint32_t index) {
  const DescriptorSource source{DescriptorSource::kMagic, 0, address};
  std::memset(record.handle, 0, sizeof(record.handle));
  std::memcpy(record.handle, &source, sizeof(source));
  record.kind = ExportRecord::Kind::ByDescriptor;
  record.index = index;
}

fd_channel::Address descriptor_source(const ExportRecord& record) {
  DescriptorSource source{};
  std::memcpy(&source, record.handle, sizeof(source));
  if (record.kind != ExportRecord::Kind::ByDescriptor || source.magic != DescriptorSource::kMagic)
    throw Error(ErrorKind::Usage, "an export by descriptor that does not say where to ask");
  return source.address;
}

uint64_t hash_packed(const uint8_t* packed, const SampleSet& set) {
  return XXH3_64bits(packed, set.bytes());
}

uint64_t hash_lines(const uint8_t* shard, const SampleSet& set, std::vector<uint8_t>& scratch) {
  scratch.resize(set.bytes());
  size_t at = 0;
  for (size_t i = 0; i < set.lines(); ++i) {
    std::memcpy(scratch.data() + at, shard + set.offset(i), set.line_bytes(i));
    at += set.line_bytes(i);
  }
  return hash_packed(scratch.data(), set);
}

}  // namespace exports
}  // namespace magi::ce
