// What one rank sees of its step: candidates, their stability over the warmup, the grouping of
// the step's calls, why a gather cannot move here, and where moving gathers lie in a slot.
#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "rewrite/observation.h"
#include "rewrite/serving.h"
#include "tests/support/options_env.h"

namespace magi::rewrite {
namespace {

Options options_with(std::map<std::string, std::string> env) {
  env.emplace("MAGI_BACKEND", "host");
  env.emplace("MAGI_WARMUP_STEPS", "2");
  return test::options_from(env);
}

// One call of a step as the observation takes it.
struct Call {
  trace::Op op = trace::Op::AllGather;
  size_t count = 1000;  // floats
  uint64_t callsite = 1;
  uintptr_t sendbuf = 0x10000;
  uint32_t group = 0;  // outermost group ordinal; 0: not in a group
  bool capturing = false;
  uintptr_t recvbuf = 0;  // 0: sendbuf + 0x100000
};

void observe_step(StepObservation& seen, const std::vector<Call>& calls) {
  seen.begin_step();
  for (uint32_t pos = 0; pos < calls.size(); ++pos) {
    const Call& c = calls[pos];
    capture::CallArgs args{};
    args.op = c.op;
    args.dtype = ncclFloat;
    args.count = c.count;
    args.sendbuf = reinterpret_cast<const void*>(c.sendbuf);
    const uintptr_t recvbuf = c.recvbuf != 0 ? c.recvbuf : c.sendbuf + 0x100000;
    args.recvbuf = reinterpret_cast<void*>(recvbuf);
    capture::CallRecord record{};
    record.callsite = c.callsite;
    record.sendbuf = c.sendbuf;
    record.recvbuf = recvbuf;
    if (c.group != 0) {
      record.flags |= trace::kCallInGroup;
      record.group = c.group;
    }
    if (c.capturing) record.flags |= trace::kCallCapturing;
    seen.observe(pos, args, record, ce::Backend::Host);
  }
}

std::vector<Reason> reasons(const std::vector<GatherEntry>& entries) {
  std::vector<Reason> out;
  for (const GatherEntry& e : entries) out.push_back(static_cast<Reason>(e.reason));
  return out;
}

std::vector<uint8_t> flags(const std::vector<GatherEntry>& entries) {
  std::vector<uint8_t> out;
  for (const GatherEntry& e : entries) out.push_back(static_cast<uint8_t>(e.flags));
  return out;
}

TEST(StepObservation, ASendBufferSharedByGathersIsTransient) {
  const Options options = options_with({});
  StepObservation seen;
  // 4000-byte shards: one buffer refilled for two layers (positions 0 and 2), a view inside
  // another gather's send range (3 inside 1), and a gather of its own (4). An all-reduce
  // reading the same memory does not count: only all-gathers are bound.
  const std::vector<Call> step = {
      {trace::Op::AllGather, 1000, 1, 0x10000}, {trace::Op::AllGather, 1000, 2, 0x20000},
      {trace::Op::AllGather, 1000, 3, 0x10000}, {trace::Op::AllGather, 500, 4, 0x20000 + 2000},
      {trace::Op::AllGather, 1000, 5, 0x30000}, {trace::Op::AllReduce, 1000, 6, 0x30000}};
  seen.reset(6);
  observe_step(seen, step);
  EXPECT_EQ(flags(seen.entries(options, ce::Backend::Host)),
            (std::vector<uint8_t>{kEntryBufferReused, kEntryBufferReused, kEntryBufferReused,
                                  kEntryBufferReused, 0}));
  // Adjacent ranges do not overlap.
  const std::vector<Call> adjacent = {{trace::Op::AllGather, 1000, 1, 0x10000},
                                      {trace::Op::AllGather, 1000, 2, 0x10000 + 4000}};
  seen.reset(2);
  observe_step(seen, adjacent);
  EXPECT_EQ(flags(seen.entries(options, ce::Backend::Host)), (std::vector<uint8_t>{0, 0}));
}

TEST(StepObservation, AnInPlaceGatherIsTransient) {
  const Options options = options_with({});
  StepObservation seen;
  seen.reset(2, 3);  // rank 3
  Call in_place{trace::Op::AllGather, 1000, 1, 0x50000 + 3 * 4000};
  in_place.recvbuf = 0x50000;
  Call elsewhere{trace::Op::AllGather, 1000, 2, 0x90000 + 1 * 4000};  // rank 1's part: not ours
  elsewhere.recvbuf = 0x90000;
  observe_step(seen, {in_place, elsewhere});
  EXPECT_TRUE(seen.at(0).in_place);
  EXPECT_FALSE(seen.at(1).in_place);
  EXPECT_EQ(flags(seen.entries(options, ce::Backend::Host)),
            (std::vector<uint8_t>{kEntryInPlace, 0}));
}

TEST(BoundSources, ACallFindsTheBindingOfTheBufferItSends) {
  // Three bound gathers of 4000 bytes and one of 2000, each from a buffer of its own.
  StepObservation seen;
  seen.reset(4);
  const std::vector<Call> step = {{trace::Op::AllGather, 1000, 1, 0x10000},
                                  {trace::Op::AllGather, 1000, 2, 0x20000},
                                  {trace::Op::AllGather, 1000, 3, 0x30000},
                                  {trace::Op::AllGather, 500, 4, 0x40000}};
  observe_step(seen, step);
  Decision d;
  d.bound = true;
  for (uint32_t p = 0; p < 4; ++p)
    d.gathers.push_back({p, static_cast<uint16_t>(p), true, Reason::None, -1});
  const SlotLayout layout = lay_out_slots(seen, d.gathers, true);
  BoundSources sources;
  sources.reset(d, seen, layout);
  ASSERT_FALSE(sources.empty());
  const auto at = [&](uint32_t p) { return layout.offset_by_position[p]; };

  // Its own buffer: its own binding.
  BoundSources::Found f = sources.find(1, 0x20000, 4000, at(1));
  EXPECT_EQ(f.slot_offset, at(1));
  EXPECT_FALSE(f.verify_now);
  EXPECT_FALSE(f.other_source);
  // Position 0 sends position 2's buffer (layers in another order): position 2's binding,
  // checked the first time position 0 sends it (a block reused in another order looks the same).
  f = sources.find(0, 0x30000, 4000, at(0));
  EXPECT_EQ(f.slot_offset, at(2));
  EXPECT_TRUE(f.verify_now);
  EXPECT_TRUE(f.other_source);
  f = sources.find(0, 0x30000, 4000, at(0));
  EXPECT_EQ(f.slot_offset, at(2));
  EXPECT_FALSE(f.verify_now);
  EXPECT_TRUE(sources.find(2, 0x30000, 4000, at(2)).slot_offset == at(2));
  // The same buffer with another size is not that binding: none, so position 0's shard lives
  // there now (re-homed), checked now; from then on it is position 0's own buffer.
  f = sources.find(0, 0x40000, 4000, at(0));
  EXPECT_EQ(f.slot_offset, at(0));
  EXPECT_TRUE(f.verify_now);
  EXPECT_FALSE(f.other_source);
  f = sources.find(0, 0x40000, 4000, at(0));
  EXPECT_EQ(f.slot_offset, at(0));
  EXPECT_FALSE(f.verify_now);
  EXPECT_FALSE(f.other_source);
  // A re-homed buffer: its own position's binding, checked once; another one checked again,
  // and so is the position's first buffer after it moved away (nobody's: it may hold anything).
  EXPECT_TRUE(sources.find(3, 0x90000, 2000, at(3)).verify_now);
  EXPECT_FALSE(sources.find(3, 0x90000, 2000, at(3)).verify_now);
  EXPECT_TRUE(sources.find(3, 0xa0000, 2000, at(3)).verify_now);
  EXPECT_TRUE(sources.find(3, 0x40000, 2000, at(3)).verify_now);
  EXPECT_FALSE(sources.find(3, 0x40000, 2000, at(3)).verify_now);
  EXPECT_TRUE(sources.find(3, 0xa0000, 2000, at(3)).verify_now);
  // Not bound (default mode): nothing to look up.
  d.bound = false;
  sources.reset(d, seen, layout);
  EXPECT_TRUE(sources.empty());
}

// Four layers bound from their own buffers, as the weights workload's --program move leaves
// them: every layer re-homed in order, each new block the one the layer before had.
struct FourLayers {
  StepObservation seen;
  SlotLayout layout;
  BoundSources sources;
  explicit FourLayers(const std::vector<uint64_t>& buffers) {
    seen.reset(4);
    std::vector<Call> step;
    for (uint32_t p = 0; p < 4; ++p) step.push_back({trace::Op::AllGather, 1000, 1, buffers[p]});
    observe_step(seen, step);
    Decision d;
    d.bound = true;
    for (uint32_t p = 0; p < 4; ++p) d.gathers.push_back({p, 0, true, Reason::None, -1});
    layout = lay_out_slots(seen, d.gathers, true);
    sources.reset(d, seen, layout);
  }
  size_t at(uint32_t p) const { return layout.offset_by_position[p]; }
};

TEST(BoundSources, LayersMovedEachToTheBlockTheLayerBeforeHadReadTheirOwnBindings) {
  FourLayers f({0x10000, 0x20000, 0x30000, 0x40000});
  // Every rank alike, in call order: layer 0 to a fresh block, layer i + 1 to layer i's.
  const std::vector<uint64_t> moved = {0x50000, 0x10000, 0x20000, 0x30000};
  for (int step = 0; step < 3; ++step) {
    for (uint32_t p = 0; p < 4; ++p) {
      const BoundSources::Found found = f.sources.find(p, moved[p], 4000, f.at(p));
      EXPECT_EQ(found.slot_offset, f.at(p)) << "step " << step << " position " << p;
      EXPECT_FALSE(found.other_source) << "step " << step << " position " << p;
      // Checked at the call that re-homes it, and then no more.
      EXPECT_EQ(found.verify_now, step == 0) << "step " << step << " position " << p;
    }
  }
  // Once moved, the layers gathered in another order are still read by tensor.
  const BoundSources::Found swapped = f.sources.find(0, 0x10000, 4000, f.at(0));
  EXPECT_EQ(swapped.slot_offset, f.at(1));
  EXPECT_TRUE(swapped.other_source);
}

TEST(BoundSources, BlocksReusedInReverseOrderLookLikeLayersSwappedAndAreChecked) {
  // All old blocks freed first, then the layers loaded anew: layer i gets layer 3 - i's block.
  // By addresses that is every rank gathering the layers in reverse order; only the bytes can
  // tell, so each such read is checked at its first call (a mismatch is reported on every rank).
  FourLayers f({0x10000, 0x20000, 0x30000, 0x40000});
  const std::vector<uint64_t> reused = {0x40000, 0x30000, 0x20000, 0x10000};
  for (uint32_t p = 0; p < 4; ++p) {
    const BoundSources::Found found = f.sources.find(p, reused[p], 4000, f.at(p));
    EXPECT_EQ(found.slot_offset, f.at(3 - p)) << "position " << p;
    EXPECT_TRUE(found.other_source) << "position " << p;
    EXPECT_TRUE(found.verify_now) << "position " << p;
  }
}

TEST(BoundSources, HomesStayFoundThroughManyMoves) {
  // Each position moves, one at a time, below, between and above the others' homes; after
  // each move every position still finds its own home and nobody else's.
  FourLayers f({0x10000, 0x20000, 0x30000, 0x40000});
  std::vector<uint64_t> home = {0x10000, 0x20000, 0x30000, 0x40000};
  const std::vector<uint64_t> targets = {0x8000, 0x48000, 0x28000, 0x18000, 0x50000,
                                         0x1000, 0x38000, 0x20000, 0x10000, 0x60000};
  for (size_t m = 0; m < targets.size(); ++m) {
    const uint32_t p = static_cast<uint32_t>(m % 4);
    bool taken = false;
    for (uint64_t h : home) taken = taken || h == targets[m];
    if (taken) continue;
    EXPECT_TRUE(f.sources.find(p, targets[m], 4000, f.at(p)).verify_now);
    home[p] = targets[m];
    for (uint32_t q = 0; q < 4; ++q) {
      const BoundSources::Found found = f.sources.find(q, home[q], 4000, f.at(q));
      EXPECT_EQ(found.slot_offset, f.at(q)) << "move " << m << " position " << q;
      EXPECT_FALSE(found.other_source) << "move " << m << " position " << q;
      EXPECT_FALSE(found.verify_now) << "move " << m << " position " << q;
      const BoundSources::Found other =
          f.sources.find((q + 1) % 4, home[q], 4000, f.at((q + 1) % 4));
      EXPECT_EQ(other.slot_offset, f.at(q)) << "move " << m << " position " << q;
    }
  }
}

TEST(StepObservation, GathersAreCandidatesOnceStableForTheWarmup) {
  const Options options = options_with({});
  const std::vector<Call> step = {{trace::Op::AllReduce, 10, 1, 0x1000},
                                  {trace::Op::AllGather, 1000, 2, 0x20000},
                                  {trace::Op::AllGather, 64, 3, 0x30000}};
  StepObservation seen;
  seen.reset(3);
  EXPECT_EQ(seen.period(), 3u);
  observe_step(seen, step);
  EXPECT_EQ(seen.complete_steps(), 0u);
  std::vector<GatherEntry> entries = seen.entries(options, ce::Backend::Host);
  ASSERT_EQ(entries.size(), 2u);  // all-gathers only
  EXPECT_EQ(entries[0].position, 1u);
  EXPECT_EQ(entries[1].position, 2u);
  EXPECT_EQ(entries[0].count, 1000u);
  EXPECT_EQ(entries[1].callsite, 3u);
  EXPECT_EQ(reasons(entries), (std::vector<Reason>{Reason::NotStable, Reason::NotStable}));
  observe_step(seen, step);
  EXPECT_EQ(seen.complete_steps(), 1u);
  EXPECT_EQ(seen.at(1).stable_steps, 2u);
  EXPECT_EQ(reasons(seen.entries(options, ce::Backend::Host)),
            (std::vector<Reason>{Reason::None, Reason::None}));
  // A new send buffer changes nothing in the default mode: its transport copies whatever buffer
  // a call names.
  std::vector<Call> moved = step;
  moved[2].sendbuf = 0x40000;
  observe_step(seen, moved);
  EXPECT_EQ(seen.at(2).stable_steps, 3u);
  EXPECT_EQ(reasons(seen.entries(options, ce::Backend::Host)),
            (std::vector<Reason>{Reason::None, Reason::None}));
  // A new count or call site starts its count over; the other stays a candidate.
  std::vector<Call> other = moved;
  other[1].count = 999;
  observe_step(seen, other);
  EXPECT_EQ(seen.at(1).stable_steps, 1u);
  EXPECT_EQ(seen.at(2).stable_steps, 4u);
  EXPECT_EQ(reasons(seen.entries(options, ce::Backend::Host)),
            (std::vector<Reason>{Reason::NotStable, Reason::None}));
  other[2].callsite = 9;
  observe_step(seen, other);
  EXPECT_EQ(seen.at(1).stable_steps, 2u);
  EXPECT_EQ(seen.at(2).stable_steps, 1u);
  // reset forgets everything.
  seen.reset(3);
  EXPECT_EQ(seen.complete_steps(), 0u);
  EXPECT_FALSE(seen.at(1).seen);
}

// Static weights read shards in place: there a new send buffer starts the count over.
TEST(StepObservation, KeyedOnBuffersANewSendBufferIsNotStable) {
  const Options options = options_with({});
  const std::vector<Call> step = {{trace::Op::AllReduce, 10, 1, 0x1000},
                                  {trace::Op::AllGather, 1000, 2, 0x20000},
                                  {trace::Op::AllGather, 64, 3, 0x30000}};
  StepObservation seen;
  seen.key_on_buffers(true);
  seen.reset(3);  // the key is kept across resets
  EXPECT_TRUE(seen.keyed_on_buffers());
  observe_step(seen, step);
  observe_step(seen, step);
  observe_step(seen, step);
  EXPECT_EQ(reasons(seen.entries(options, ce::Backend::Host)),
            (std::vector<Reason>{Reason::None, Reason::None}));
  std::vector<Call> moved = step;
  moved[2].sendbuf = 0x40000;
  observe_step(seen, moved);
  EXPECT_EQ(seen.at(1).stable_steps, 4u);
  EXPECT_EQ(seen.at(2).stable_steps, 1u);
  EXPECT_EQ(reasons(seen.entries(options, ce::Backend::Host)),
            (std::vector<Reason>{Reason::None, Reason::NotStable}));
}

TEST(StepObservation, CallsBeforeTheFirstStepBeginsAreNotObserved) {
  StepObservation seen;
  seen.reset(2);
  capture::CallArgs args{};
  args.op = trace::Op::AllGather;
  args.dtype = ncclFloat;
  args.count = 4;
  capture::CallRecord record{};
  seen.observe(0, args, record, ce::Backend::Host);
  EXPECT_FALSE(seen.at(0).seen);
  seen.begin_step();
  seen.observe(5, args, record, ce::Backend::Host);  // past the period: ignored
  seen.observe(0, args, record, ce::Backend::Host);
  EXPECT_TRUE(seen.at(0).seen);
}

TEST(StepObservation, GroupDigestAndStability) {
  // Positions 0 and 1 in one group, 2 ungrouped, 3 in the next group.
  std::vector<Call> step(4);
  step[0].group = 7;
  step[1].group = 7;
  step[3].group = 8;
  for (uint32_t p = 0; p < 4; ++p) step[p].sendbuf = 0x10000 * (p + 1);
  StepObservation seen;
  seen.reset(4);
  observe_step(seen, step);
  EXPECT_EQ(seen.at(0).group, 0u);
  EXPECT_EQ(seen.at(1).group, 0u);
  EXPECT_EQ(seen.at(2).group, kNoGroup);
  EXPECT_EQ(seen.at(3).group, 1u);  // numbered within the step, not by the ordinal
  observe_step(seen, step);
  // One complete step: nothing to compare with, so its grouping stands (MAGI_WARMUP_STEPS=1
  // proposes after one step; the ranks' groupings are still compared in the round).
  EXPECT_TRUE(seen.groups_stable());
  const uint64_t digest = seen.group_digest();
  EXPECT_NE(digest, 0u);
  // The same grouping with other ordinals, a step later: the same digest, now stable.
  for (Call& c : step) c.group = c.group == 0 ? 0 : c.group + 10;
  observe_step(seen, step);
  EXPECT_EQ(seen.group_digest(), digest);
  EXPECT_TRUE(seen.groups_stable());
  // Another grouping: a new digest, unstable until it repeats.
  step[2].group = 18;  // joins position 3's group
  observe_step(seen, step);
  observe_step(seen, step);
  EXPECT_NE(seen.group_digest(), digest);
  EXPECT_FALSE(seen.groups_stable());
  observe_step(seen, step);
  EXPECT_TRUE(seen.groups_stable());
  // The buckets follow the groups: positions 0 and 1 share one; 2 and 3 share the next.
  const Options options = options_with({});
  const std::vector<GatherEntry> entries = seen.entries(options, ce::Backend::Host);
  ASSERT_EQ(entries.size(), 4u);
  EXPECT_EQ(entries[0].bucket, 0u);
  EXPECT_EQ(entries[1].bucket, 0u);
  EXPECT_EQ(entries[2].bucket, 1u);
  EXPECT_EQ(entries[3].bucket, 1u);
}

TEST(StepObservation, EntriesSayWhyAGatherCannotMoveHere) {
  // Position 0: small; 1: captured; 2 and 3 in one group, 3 large.
  std::vector<Call> step(4);
  step[0].count = 1000;     // 4000 bytes
  step[1].count = 1 << 20;  // 4 MiB
  step[1].capturing = true;
  step[2].count = 1 << 20;
  step[2].group = 5;
  step[3].count = 3 << 20;  // 12 MiB: the group needs 16 MiB of staging
  step[3].group = 5;
  for (uint32_t p = 0; p < 4; ++p) step[p].sendbuf = 0x1000000 * (p + 1);
  StepObservation seen;
  seen.reset(4);
  for (int i = 0; i < 3; ++i) observe_step(seen, step);
  // A captured position stays only where its graph could not move it: the default mode with
  // graph slots refused (MAGI_GRAPH_SLOTS=never).
  const Options options = options_with({{"MAGI_SYMM_MIN_SHARD_MIB", "1"},
                                        {"MAGI_WINDOW_MAX_MIB", "8"},
                                        {"MAGI_GRAPH_SLOTS", "never"}});
  EXPECT_EQ(reasons(seen.entries(options, ce::Backend::Host)),
            (std::vector<Reason>{Reason::ShardTooSmall, Reason::GraphCapture,
                                 Reason::WindowTooLarge, Reason::WindowTooLarge}));
  // Stale bindings stay, whatever else holds; with graph slots a captured position is a candidate.
  const Options roomy = options_with({{"MAGI_WINDOW_MAX_MIB", "64"}});
  EXPECT_EQ(reasons(seen.entries(roomy, ce::Backend::Host, {0, 3})),
            (std::vector<Reason>{Reason::BindingChanged, Reason::None, Reason::None,
                                 Reason::BindingChanged}));
  // Static weights: bindings past MAGI_BIND_MAX_MIB (in step order) stay.
  const Options bound = options_with(
      {{"MAGI_WINDOW_MAX_MIB", "64"}, {"MAGI_STATIC_WEIGHTS", "1"}, {"MAGI_BIND_MAX_MIB", "6"}});
  EXPECT_EQ(reasons(seen.entries(bound, ce::Backend::Host)),
            (std::vector<Reason>{Reason::None, Reason::None, Reason::BindTooLarge,
                                 Reason::BindTooLarge}));
}

TEST(StepObservation, SlotsArePackedPerBucketAligned) {
  std::vector<Call> step(4);
  step[0].count = 100;   // 400 bytes -> 512
  step[1].count = 64;    // 256 bytes
  step[2].count = 1;     // 4 bytes -> 256
  step[3].count = 1000;  // 4000 bytes -> 4096
  step[0].group = 3;
  step[1].group = 3;
  for (uint32_t p = 0; p < 4; ++p) step[p].sendbuf = 0x10000 * (p + 1);
  StepObservation seen;
  seen.reset(4);
  observe_step(seen, step);
  const std::vector<GatherDecision> gathers = {{0, 0, true, Reason::None, -1},
                                               {1, 0, true, Reason::None, -1},
                                               {2, 1, false, Reason::NotStable, -1},
                                               {3, 2, true, Reason::None, -1}};
  const SlotLayout layout = lay_out_slots(seen, gathers, false);
  ASSERT_EQ(layout.offset_by_position.size(), 4u);
  EXPECT_EQ(layout.offset_by_position[0], 0u);
  EXPECT_EQ(layout.offset_by_position[1], 512u);
  EXPECT_EQ(layout.offset_by_position[2], SIZE_MAX);
  EXPECT_EQ(layout.offset_by_position[3], 0u);  // a bucket of its own starts at 0
  EXPECT_EQ(layout.bucket_by_position[1], 0u);
  EXPECT_EQ(layout.bucket_by_position[3], 2u);
  EXPECT_EQ(layout.slot_bytes, 4096u);  // the largest bucket
  for (const size_t offset : layout.offset_by_position) {
    if (offset != SIZE_MAX) {
      EXPECT_EQ(offset % kSlotAlignment, 0u);
    }
  }
  // Bound: every moving gather has its own place in one region.
  const SlotLayout region = lay_out_slots(seen, gathers, true);
  EXPECT_EQ(region.offset_by_position[0], 0u);
  EXPECT_EQ(region.offset_by_position[1], 512u);
  EXPECT_EQ(region.offset_by_position[3], 768u);
  EXPECT_EQ(region.slot_bytes, 768u + 4096u);
  EXPECT_EQ(region.bucket_by_position[3], 2u);
  // What a bucket needs: its gathers' shards, each aligned.
  const std::vector<GatherEntry> entries = seen.entries(options_with({}), ce::Backend::Host);
  EXPECT_EQ(bucket_bytes(seen, 0, entries), 768u);
  EXPECT_EQ(bucket_bytes(seen, 1, entries), 256u);
}

}  // namespace
}  // namespace magi::rewrite
