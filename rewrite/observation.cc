#include "rewrite/observation.h"

#include <algorithm>
#include <cstdint>
#include <map>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace magi::rewrite {

namespace {
size_t aligned(size_t bytes) { return round_up(bytes, kSlotAlignment); }
}  // namespace

void StepObservation::reset(uint32_t period, int rank) {
  positions_.assign(period, PositionSeen{});
  rank_ = rank;
  complete_steps_ = 0;
  step_open_ = false;
  groups_in_step_ = 0;
  group_digest_ = previous_group_digest_ = 0;
  groups_stable_ = false;
  has_gathers_ = false;
}

void StepObservation::begin_step() {
  if (step_open_) {
    ++complete_steps_;
    // FNV-1a over the group indices: this runs once a step, which for a step of one call is
    // every call, where a streaming XXH3's set-up would cost more than the rest of the call.
    uint64_t digest = 0xcbf29ce484222325ull;
    for (const PositionSeen& p : positions_) digest = (digest ^ p.group) * 0x100000001b3ull;
    previous_group_digest_ = group_digest_;
    group_digest_ = digest;
    // One step has nothing to compare with: with MAGI_WARMUP_STEPS=1 it is enough (the ranks'
    // groupings are still compared in the round).
    groups_stable_ = complete_steps_ == 1 || group_digest_ == previous_group_digest_;
  }
  step_open_ = true;
  groups_in_step_ = 0;
  last_group_ordinal_ = 0;
}

CallFacts CallFacts::of(const capture::CallArgs& args, const capture::CallRecord& record) {
  CallFacts f;
  f.op = args.op;
  f.dtype = static_cast<uint8_t>(args.dtype);
  f.flags = record.flags;
  f.group = record.group;
  f.count = args.count;
  f.callsite = record.callsite;
  f.sendbuf = reinterpret_cast<uint64_t>(args.sendbuf);
  f.recvbuf = reinterpret_cast<uint64_t>(args.recvbuf);
  return f;
}

void StepObservation::observe(uint32_t position, const CallFacts& call, ce::Backend backend) {
  if (!step_open_ || position >= positions_.size()) return;
  PositionSeen& p = positions_[position];
  uint16_t group = kNoGroup;
  if (call.flags & trace::kCallInGroup) {
    if (call.group != last_group_ordinal_) {
      last_group_ordinal_ = call.group;
      if (groups_in_step_ < kNoGroup - 1) ++groups_in_step_;
    }
    group = static_cast<uint16_t>(groups_in_step_ - 1);
  }
  const bool gather = call.op == trace::Op::AllGather;
  has_gathers_ = has_gathers_ || gather;
  const bool identify = gather && keyed_on_buffers_;
  const ce::BufferIdentity send =
      identify ? ce::identify_buffer(backend, reinterpret_cast<const void*>(call.sendbuf))
               : ce::BufferIdentity{};
  const bool same_buffer = !keyed_on_buffers_ || (p.sendbuf == call.sendbuf &&
                                                  p.send.allocation_id == send.allocation_id);
  const bool same = p.seen && p.count == call.count && p.dtype == call.dtype &&
                    p.callsite == call.callsite && p.group == group && same_buffer;
  p.stable_steps = same ? p.stable_steps + 1 : 1;
  p.seen = true;
  p.op = static_cast<uint8_t>(call.op);
  p.dtype = call.dtype;
  p.capturing = (call.flags & trace::kCallCapturing) != 0;
  p.group = group;
  p.count = call.count;
  p.callsite = call.callsite;
  p.sendbuf = call.sendbuf;
  p.recvbuf = call.recvbuf;
  p.send_bytes = gather ? call.count * datatype_bytes(call.dtype) : 0;
  p.in_place = gather && p.send_bytes != 0 &&
               p.sendbuf == p.recvbuf + static_cast<uint64_t>(rank_) * p.send_bytes;
  p.send = send;
  p.recv = identify ? ce::identify_buffer(backend, reinterpret_cast<const void*>(call.recvbuf))
                    : ce::BufferIdentity{};
}

uint64_t StepObservation::callsite_digest() const {
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  // Only the all-gathers': other calls' call sites are recorded only when traced (capture).
  for (const PositionSeen& p : positions_)
    if (p.op == static_cast<uint8_t>(trace::Op::AllGather))
      XXH3_64bits_update(&state, &p.callsite, sizeof(p.callsite));
  return XXH3_64bits_digest(&state);
}

namespace {

// Positions (all-gathers with a non-empty send range) whose send range overlaps another's.
std::vector<bool> overlapping_sends(const std::vector<PositionSeen>& positions) {
  std::vector<uint32_t> order;
  for (uint32_t pos = 0; pos < positions.size(); ++pos) {
    const PositionSeen& p = positions[pos];
    if (p.op == static_cast<uint8_t>(trace::Op::AllGather) && p.send_bytes != 0)
      order.push_back(pos);
  }
  std::sort(order.begin(), order.end(),
            [&](uint32_t a, uint32_t b) { return positions[a].sendbuf < positions[b].sendbuf; });
  std::vector<bool> out(positions.size(), false);
  // Sorted by start: a range overlaps an earlier one iff it starts before the furthest end so
  // far; the one holding that end overlaps it too.
  uint64_t furthest_end = 0;
  uint32_t furthest = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const PositionSeen& p = positions[order[i]];
    if (i > 0 && p.sendbuf < furthest_end) {
      out[order[i]] = true;
      out[furthest] = true;
    }
    if (i == 0 || p.sendbuf + p.send_bytes > furthest_end) {
      furthest_end = p.sendbuf + p.send_bytes;
      furthest = order[i];
    }
  }
  return out;
}

Reason memory_refusal(const ce::BufferIdentity& id, ce::Backend backend) {
  if (backend == ce::Backend::Host)
    return id.kind == ce::MemoryKind::Host ? Reason::None : Reason::DeviceMemory;
  switch (id.kind) {
    case ce::MemoryKind::Device: return Reason::None;
    case ce::MemoryKind::Host: return Reason::HostMemory;
    case ce::MemoryKind::Managed: return Reason::ManagedMemory;
    case ce::MemoryKind::Unknown: break;
  }
  return Reason::UnknownMemory;
}

}  // namespace

ce::BufferIdentity StepObservation::identity(const ce::BufferIdentity& seen, uint64_t buffer,
                                             ce::Backend backend) const {
  return keyed_on_buffers_ ? seen
                           : ce::identify_buffer(backend, reinterpret_cast<const void*>(buffer));
}

std::vector<GatherEntry> StepObservation::entries(const Options& options, ce::Backend backend,
                                                  const std::vector<uint32_t>& stale,
                                                  bool at_capture, bool transient) const {
  std::vector<GatherEntry> out;
  // Buckets: the gathers of one group share one; an ungrouped gather is a bucket of its own.
  std::map<uint32_t, uint16_t> bucket_of_key;
  const std::vector<bool> overlaps = overlapping_sends(positions_);
  const uint64_t stable_needed =
      at_capture
          ? 1
          : stable_steps_needed(static_cast<uint64_t>(options.warmup_steps), keyed_on_buffers_);
  for (uint32_t pos = 0; pos < positions_.size(); ++pos) {
    const PositionSeen& p = positions_[pos];
    if (p.op != static_cast<uint8_t>(trace::Op::AllGather)) continue;
    const uint32_t key = p.group != kNoGroup ? p.group : 0x10000u + pos;
    const auto [it, inserted] =
        bucket_of_key.try_emplace(key, static_cast<uint16_t>(bucket_of_key.size()));
    GatherEntry e{};
    e.callsite = p.callsite;
    e.count = p.count;
    e.position = pos;
    e.bucket = it->second;
    e.dtype = p.dtype;
    e.flags =
        (overlaps[pos] || transient ? kEntryBufferReused : 0u) | (p.in_place ? kEntryInPlace : 0u);
    Reason why = Reason::None;
    const uint64_t min_bytes = options.symm_min_shard_bytes;
    if (p.stable_steps < stable_needed)
      why = Reason::NotStable;
    else if (Reason m = memory_refusal(identity(p.send, p.sendbuf, backend), backend);
             m != Reason::None)
      why = m;
    else if (Reason m2 = memory_refusal(identity(p.recv, p.recvbuf, backend), backend);
             m2 != Reason::None)
      why = m2;
    else if (p.capturing && !at_capture && !options.static_weights &&
             options.graph_slots == Options::GraphSlots::Never)
      // Captured last, it moves in its graph on a static plan or on graph slots, which this
      // rank refuses: only then is its capture a reason to stay.
      why = Reason::GraphCapture;
    else if (p.count * datatype_bytes(p.dtype) < min_bytes)
      why = Reason::ShardTooSmall;
    e.reason = static_cast<uint8_t>(why);
    out.push_back(e);
  }
  // A bucket larger than a window's slot may hold stays, all of it.
  const uint64_t max_slot = options.window_max_bytes;
  for (GatherEntry& e : out) {
    if (e.reason == static_cast<uint8_t>(Reason::None) &&
        bucket_bytes(*this, e.bucket, out) > max_slot)
      e.reason = static_cast<uint8_t>(Reason::WindowTooLarge);
  }
  for (GatherEntry& e : out) {
    for (uint32_t p : stale)
      if (e.position == p) e.reason = static_cast<uint8_t>(Reason::BindingChanged);
  }
  // Static weights at a capture: a shard is read where it lies, or not bound at all. A binding's
  // copy needs the program's work on it finished (a device-wide wait, which a capture refuses and
  // would end). A transient shard is neither: it makes the whole plan stage (decide()), on graph
  // slots, as the default mode does, and binds nothing.
  if (options.static_weights && at_capture) {
    for (GatherEntry& e : out) {
      if (e.reason != static_cast<uint8_t>(Reason::None) || (e.flags & kEntryTransient)) continue;
      if (!ce::exportable(backend, reinterpret_cast<const void*>(at(e.position).sendbuf),
                          e.count * datatype_bytes(e.dtype)))
        e.reason = static_cast<uint8_t>(Reason::NotInPlaceAtCapture);
    }
  }
  // Static weights: bindings take memory for good; past the cap (in step order) gathers stay.
  // Shards the peers can read in place (exportable memory) take none, and do not count.
  // Asking which memory is exportable costs driver calls (or a read of /proc/self/maps) per
  // shard, and this runs at a program's call: only when the candidates would not all fit anyway.
  if (options.static_weights) {
    const uint64_t cap = std::min(options.bind_max_bytes, options.window_max_bytes);
    uint64_t total = 0;
    for (const GatherEntry& e : out)
      if (e.reason == static_cast<uint8_t>(Reason::None))
        total += aligned(e.count * datatype_bytes(e.dtype));
    uint64_t bound = 0;
    for (GatherEntry& e : out) {
      if (total <= cap) break;
      if (e.reason != static_cast<uint8_t>(Reason::None)) continue;
      const uint64_t bytes = aligned(e.count * datatype_bytes(e.dtype));
      if (ce::exportable(backend, reinterpret_cast<const void*>(at(e.position).sendbuf),
                         e.count * datatype_bytes(e.dtype)))
        continue;
      if (bound + bytes > cap)
        e.reason = static_cast<uint8_t>(Reason::BindTooLarge);
      else
        bound += bytes;
    }
  }
  return out;
}

uint64_t stable_steps_needed(uint64_t warmup_steps, bool keyed_on_buffers) {
  // A static binding names the buffer a position sent: a step of identical shapes, before it is
  // refined to one position per layer, takes turns with several, which one step cannot show.
  return keyed_on_buffers ? std::max<uint64_t>(warmup_steps, 2) : warmup_steps;
}

namespace {
bool counts(const GatherEntry&) { return true; }
bool counts(const GatherDecision& g) { return g.moves; }
}  // namespace

template <typename Gather>
size_t bucket_bytes(const StepObservation& seen, uint16_t bucket,
                    const std::vector<Gather>& gathers) {
  size_t total = 0;
  for (const Gather& g : gathers) {
    if (!counts(g) || g.bucket != bucket || g.position >= seen.period()) continue;
    total += aligned(seen.at(g.position).count * datatype_bytes(seen.at(g.position).dtype));
  }
  return total;
}
template size_t bucket_bytes(const StepObservation&, uint16_t, const std::vector<GatherEntry>&);
template size_t bucket_bytes(const StepObservation&, uint16_t, const std::vector<GatherDecision>&);

SlotLayout lay_out_slots(const StepObservation& seen, const std::vector<GatherDecision>& gathers,
                         bool bound) {
  SlotLayout layout;
  layout.offset_by_position.assign(seen.period(), SIZE_MAX);
  layout.bucket_by_position.assign(seen.period(), 0);
  std::map<uint16_t, size_t> used;  // bytes of each bucket so far (bound: all in bucket 0's count)
  for (const GatherDecision& g : gathers) {
    if (!g.moves) continue;
    size_t& offset = used[bound ? 0 : g.bucket];
    layout.offset_by_position[g.position] = offset;
    layout.bucket_by_position[g.position] = g.bucket;
    offset += aligned(seen.at(g.position).count * datatype_bytes(seen.at(g.position).dtype));
    layout.slot_bytes = std::max(layout.slot_bytes, offset);
  }
  return layout;
}

}  // namespace magi::rewrite
