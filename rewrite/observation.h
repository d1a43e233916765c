// What this rank saw at each position of its communicator's step, step after step: the facts a
// candidate needs (the same count, type, call site and group for MAGI_WARMUP_STEPS steps; with
// static weights the same send buffer too), how the step's calls are grouped, and the buckets and
// staging offsets that follow from it.
//
// Why the default mode ignores buffers: its transport copies each call's shard from whatever
// buffer the call names and writes whatever buffer it names, so a gather's addresses may differ
// at every call (nccl-tests shifts them by the message size; a caching allocator hands out
// copy-in and output buffers anew each step) and its bytes stay exact. Static weights read
// shards in place, so there a buffer's identity is part of what must be stable; and only there
// is each gather's buffer identified at every call (a driver query, the largest part of a
// watched gather's cost). Elsewhere the last buffers are identified when a propose needs them.
#pragma once

#include <cstdint>
#include <vector>

#include "base/base.h"
#include "capture/capture.h"
#include "ce_transport/ce_transport.h"
#include "rewrite/contribution.h"

namespace magi::rewrite {

inline constexpr uint16_t kNoGroup = 0xffff;
using ce::kSlotAlignment;

// What the observation keeps of one collective: its shape and this rank's own facts (call site,
// buffers, grouping, capture). Held for recent calls too, to seed a step just found
// (RecentCalls).
struct CallFacts {
  trace::Op op = trace::Op::AllGather;
  uint8_t dtype = 0;
  uint32_t flags = 0;  // trace::kCall* of its record
  uint32_t group = 0;  // the record's group ordinal
  uint64_t count = 0;
  uint64_t callsite = 0;
  uint64_t sendbuf = 0;
  uint64_t recvbuf = 0;

  static CallFacts of(const capture::CallArgs& args, const capture::CallRecord& record);
};

struct PositionSeen {
  bool seen = false;
  uint8_t op = 0;
  uint8_t dtype = 0;
  bool capturing = false;
  uint16_t group = kNoGroup;  // index of its ncclGroupStart/End within the step, or kNoGroup
  uint64_t count = 0;
  uint64_t callsite = 0;
  uint64_t sendbuf = 0;
  uint64_t recvbuf = 0;
  uint64_t send_bytes = 0;  // the send range is [sendbuf, sendbuf + send_bytes)
  bool in_place = false;    // sendbuf == recvbuf + rank × send_bytes
  ce::BufferIdentity send;  // identified at each call only when keyed on buffers
  ce::BufferIdentity recv;
  uint32_t stable_steps = 0;  // consecutive steps with the same key (count, type, call site, ...)
};

class StepObservation {
 public:
  // Static weights: a gather's send buffer (and the allocation holding it) is part of its key.
  // Kept across reset().
  void key_on_buffers(bool keyed) { keyed_on_buffers_ = keyed; }
  bool keyed_on_buffers() const { return keyed_on_buffers_; }
  // Starts over for a step of `period` collectives (step found, lost or changed). `rank`: this
  // rank in the communicator (what makes a gather in place).
  void reset(uint32_t period, int rank = 0);
  // At position 0: the step that just ended becomes the one decisions are made from.
  void begin_step();
  void observe(uint32_t position, const CallFacts& call, ce::Backend backend);
  void observe(uint32_t position, const capture::CallArgs& args, const capture::CallRecord& record,
               ce::Backend backend) {
    observe(position, CallFacts::of(args, record), backend);
  }

  // Complete steps observed since reset.
  uint64_t complete_steps() const { return complete_steps_; }
  uint64_t callsite_digest() const;
  uint64_t group_digest() const { return group_digest_; }
  bool groups_stable() const { return groups_stable_; }
  uint32_t period() const { return static_cast<uint32_t>(positions_.size()); }
  // Whether the step holds an all-gather (a shape: alike on every rank). A step without one
  // needs no round.
  bool has_gathers() const { return has_gathers_; }
  const PositionSeen& at(uint32_t position) const { return positions_[position]; }

  // This rank's entries for a propose round: every all-gather of the step, with its bucket and,
  // if it cannot move on this rank, why.
  // `stale`: positions whose static binding was found changed (they stay until the step changes).
  // An entry is flagged transient (kEntryBufferReused, kEntryInPlace) when its send buffer holds
  // its shard only around its own call: in place, or a send range that overlaps another
  // all-gather's of the step (one buffer refilled for each layer, views of one scratch). A copy
  // of it taken at any other moment (a static binding at the anchor) holds another layer's bytes.
  // A position captured into a CUDA graph at its last look is a candidate (its graph moves it on
  // a static plan or on graph slots), but where this rank refuses graph slots in the default
  // mode. `at_capture`: a propose made while the program captures (rewrite/capture_rounds.cc):
  // a captured call's facts are what every replay repeats, so one look at a position suffices.
  // `transient`: every entry is flagged transient (a step of one call, whose one position may
  // name another send buffer at every call), so a static plan stages.
  std::vector<GatherEntry> entries(const Options& options, ce::Backend backend,
                                   const std::vector<uint32_t>& stale = {}, bool at_capture = false,
                                   bool transient = false) const;

 private:
  // A position's buffer as entries() judges it: identified at its call when keyed on buffers,
  // else now (its last call's).
  ce::BufferIdentity identity(const ce::BufferIdentity& seen, uint64_t buffer,
                              ce::Backend backend) const;

  std::vector<PositionSeen> positions_;
  bool keyed_on_buffers_ = false;
  int rank_ = 0;
  uint64_t complete_steps_ = 0;
  bool step_open_ = false;
  uint32_t last_group_ordinal_ = 0;
  uint16_t groups_in_step_ = 0;
  uint64_t group_digest_ = 0;
  uint64_t previous_group_digest_ = 0;
  bool groups_stable_ = false;
  bool has_gathers_ = false;
};

// Where each moving gather's shard lies in a staging slot: packed per bucket from the shapes (so
// equal on every rank), and the slot size the plan needs (its largest bucket).
struct SlotLayout {
  std::vector<size_t> offset_by_position;  // SIZE_MAX for positions that do not move
  std::vector<uint16_t> bucket_by_position;
  size_t slot_bytes = 0;
};
// Bound (static weights): every moving gather has its own place in one region instead.
SlotLayout lay_out_slots(const StepObservation& seen, const std::vector<GatherDecision>& gathers,
                         bool bound);

// Steps a position must repeat unchanged before it may move: MAGI_WARMUP_STEPS, and at least two
// when keyed on buffers (static weights), since one look cannot tell a buffer of a position's own
// from one of several it takes turns with. The first propose waits for as many whole steps.
uint64_t stable_steps_needed(uint64_t warmup_steps, bool keyed_on_buffers);

// Staging a bucket needs: its gathers' shards, each aligned. Shapes only, so equal on every rank.
// `gathers`: a rank's entries (GatherEntry: each counts) or a decision's (GatherDecision: those
// that move).
template <typename Gather>
size_t bucket_bytes(const StepObservation& seen, uint16_t bucket,
                    const std::vector<Gather>& gathers);

}  // namespace magi::rewrite
