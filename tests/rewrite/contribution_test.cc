// The agreement ladder as a pure function: contributions in, one decision out, equal from every
// rank's point of view.
#include <gtest/gtest.h>

#include <vector>

#include "rewrite/contribution.h"

namespace magi::rewrite {
namespace {

// A step of `gathers` all-gathers, each its own bucket unless `buckets` says otherwise.
Contribution propose(int rank, int nranks, int gathers, std::vector<uint16_t> buckets = {}) {
  Contribution c;
  ContributionHeader& h = c.header;
  h.magic = kContributionMagic;
  h.version = kContributionVersion;
  h.round = 1;
  h.kind = static_cast<uint8_t>(RoundKind::Propose);
  h.backend = static_cast<uint8_t>(ce::Backend::Host);
  h.rank = rank;
  h.nranks = nranks;
  h.step_digest = 0xabcdef;
  h.callsite_digest = 0x1234;
  h.group_digest = 0x77;
  h.period = static_cast<uint32_t>(gathers + 1);
  h.gathers = static_cast<uint32_t>(gathers);
  h.host = 42;
  for (int g = 0; g < gathers; ++g) {
    GatherEntry e{};
    e.callsite = 1000 + static_cast<uint64_t>(g);
    e.count = 256;
    e.position = static_cast<uint32_t>(g);
    e.bucket = buckets.empty() ? static_cast<uint16_t>(g) : buckets[static_cast<size_t>(g)];
    e.dtype = 7;
    c.entries.push_back(e);
  }
  return c;
}

std::vector<uint8_t> gather_all(const std::vector<Contribution>& all,
                                size_t each = kContributionBytes) {
  std::vector<uint8_t> bytes(all.size() * each);
  for (size_t r = 0; r < all.size(); ++r)
    all[r].serialize(std::span<uint8_t>(bytes).subspan(r * each, each));
  return bytes;
}

std::vector<Contribution> ranks(int n, int gathers, std::vector<uint16_t> buckets = {}) {
  std::vector<Contribution> all;
  for (int r = 0; r < n; ++r) all.push_back(propose(r, n, gathers, buckets));
  return all;
}

// Decides from every rank's point of view and checks that they reach the same plan.
Decision decide_everywhere(const std::vector<Contribution>& all) {
  const std::vector<uint8_t> bytes = gather_all(all);
  const int n = static_cast<int>(all.size());
  const Decision first = decide(bytes, n, 0);
  for (int r = 1; r < n; ++r) {
    const Decision d = decide(bytes, n, r);
    EXPECT_EQ(d.mode, first.mode) << "rank " << r;
    EXPECT_EQ(d.hash, first.hash) << "rank " << r;
    EXPECT_EQ(d.moved, first.moved) << "rank " << r;
    // Under abort each rank lists its own gathers, which may be other ones: none moves.
    if (d.mode != AgreementMode::Abort) {
      EXPECT_EQ(d.gathers.size(), first.gathers.size());
    }
    for (size_t g = 0; g < d.gathers.size() && g < first.gathers.size(); ++g)
      EXPECT_EQ(d.gathers[g].moves, first.gathers[g].moves) << "rank " << r << " gather " << g;
  }
  return first;
}

TEST(Ladder, IdenticalWhenStepsAndCallsitesAreEqual) {
  const Decision d = decide_everywhere(ranks(4, 5));
  EXPECT_EQ(d.mode, AgreementMode::Identical);
  EXPECT_EQ(d.moved, 5u);
  EXPECT_NE(d.hash, 0u);
  for (const GatherDecision& g : d.gathers) EXPECT_TRUE(g.moves);
}

TEST(Ladder, SlotWhenOnlyCallsitesDiffer) {
  auto all = ranks(3, 4);
  all[2].header.callsite_digest = 0x9999;
  all[2].entries[1].callsite = 5;
  const Decision d = decide_everywhere(all);
  EXPECT_EQ(d.mode, AgreementMode::Slot);
  EXPECT_EQ(d.moved, 4u);
}

TEST(Ladder, IdenticalAndSlotPlansDiffer) {
  auto all = ranks(2, 3);
  const Decision identical = decide_everywhere(all);
  all[1].header.callsite_digest = 0x5555;
  const Decision slot = decide_everywhere(all);
  EXPECT_NE(identical.hash, slot.hash);  // a plan names its mode: a new mode means a new commit
}

TEST(Ladder, AbortWhenStepsDiffer) {
  auto all = ranks(4, 3);
  all[3].header.step_digest = 0xdead;
  const Decision d = decide_everywhere(all);
  EXPECT_EQ(d.mode, AgreementMode::Abort);
  EXPECT_EQ(d.reason, Reason::StepsDiffer);
  EXPECT_EQ(d.moved, 0u);
  EXPECT_EQ(d.hash, 0u);
  ASSERT_EQ(d.gathers.size(), 3u);
  for (const GatherDecision& g : d.gathers) EXPECT_EQ(g.reason, Reason::StepsDiffer);
}

TEST(Ladder, AbortWhenGatherCountsDiffer) {
  auto all = ranks(2, 3);
  all[1] = propose(1, 2, 4);
  EXPECT_EQ(decide_everywhere(all).mode, AgreementMode::Abort);
}

TEST(Ladder, AbortWhenGroupingDiffersOrIsUnstable) {
  auto all = ranks(3, 3);
  all[1].header.group_digest = 0x78;
  Decision d = decide_everywhere(all);
  EXPECT_EQ(d.mode, AgreementMode::Abort);
  EXPECT_EQ(d.reason, Reason::GroupsDiffer);
  all = ranks(3, 3);
  all[2].header.flags |= kGroupsUnstable;
  d = decide_everywhere(all);
  EXPECT_EQ(d.reason, Reason::GroupsDiffer);
}

TEST(Ladder, AbortOnGarbage) {
  auto all = ranks(2, 2);
  all[1].header.magic = 0;
  EXPECT_EQ(decide_everywhere(all).mode, AgreementMode::Abort);
}

TEST(Ladder, AGatherMovesOnlyIfEveryRankHoldsItEligible) {
  auto all = ranks(4, 3);
  all[2].entries[1].reason = static_cast<uint8_t>(Reason::NotStable);
  const std::vector<uint8_t> bytes = gather_all(all);
  const Decision d0 = decide(bytes, 4, 0);
  EXPECT_EQ(d0.moved, 2u);
  EXPECT_FALSE(d0.gathers[1].moves);
  EXPECT_EQ(d0.gathers[1].reason, Reason::OtherRankRefused);
  EXPECT_EQ(d0.gathers[1].refused_by, 2);
  const Decision d2 = decide(bytes, 4, 2);
  EXPECT_EQ(d2.gathers[1].reason, Reason::NotStable);  // the refusing rank names its own reason
  EXPECT_EQ(d0.hash, d2.hash);
}

TEST(Ladder, ABucketMovesWholeOrNotAtAll) {
  auto all = ranks(2, 4, {0, 1, 1, 2});
  all[0].entries[2].reason = static_cast<uint8_t>(Reason::ShardTooSmall);
  const Decision d = decide_everywhere(all);
  EXPECT_TRUE(d.gathers[0].moves);
  EXPECT_FALSE(d.gathers[1].moves);
  EXPECT_EQ(decide(gather_all(all), 2, 1).gathers[1].reason, Reason::BucketPartial);
  EXPECT_FALSE(d.gathers[2].moves);
  EXPECT_TRUE(d.gathers[3].moves);
  EXPECT_EQ(d.moved, 2u);
}

TEST(Ladder, NothingMovesWhenARoundWasIssuedInsideAGroup) {
  auto all = ranks(3, 2);
  all[1].header.flags |= kIssuedInGroup;
  const Decision d = decide_everywhere(all);
  EXPECT_EQ(d.reason, Reason::AnchorInGroup);
  EXPECT_EQ(d.moved, 0u);
  // Whatever else differs: the rank that voted from inside a group decided without reading.
  all[2].header.step_digest = 0xdead;
  EXPECT_EQ(decide_everywhere(all).reason, Reason::AnchorInGroup);
}

TEST(Ladder, PeersMustShareTheHostAndReachEachOthersGpus) {
  // Two ranks on two hosts: machines of one rank each, where a two-level gather would be NCCL's
  // alone (the machines' own rules: Ladder.RanksOnSeveralMachines...).
  auto all = ranks(2, 2);
  all[1].header.host = 43;
  EXPECT_EQ(decide_everywhere(all).reason, Reason::OneRankPerMachine);

  all = ranks(3, 2);
  for (auto& c : all) {
    c.header.backend = static_cast<uint8_t>(ce::Backend::Cuda);
    c.header.device = c.header.rank;
    c.header.peer_access_mask = 0b111;
  }
  EXPECT_EQ(decide_everywhere(all).moved, 2u);
  all[2].header.peer_access_mask = 0b100;  // device 2 cannot reach 0 and 1
  EXPECT_EQ(decide_everywhere(all).reason, Reason::PeerNotAccessible);
  for (auto& c : all) c.header.device = 0;  // processes sharing one GPU reach each other
  EXPECT_EQ(decide_everywhere(all).moved, 2u);
}

// Ranks on several machines: the topology comes from the propose's bytes, so every rank reads
// the same machines, and the plan (its hash included) is served in two levels.
TEST(Ladder, RanksOnSeveralMachinesOfEqualSizeMoveInTwoLevels) {
  auto all = ranks(4, 3);
  const uint64_t hosts[] = {7, 9, 7, 9};
  for (size_t r = 0; r < all.size(); ++r) all[r].header.host = hosts[r];
  const Decision d = decide_everywhere(all);
  EXPECT_EQ(d.reason, Reason::None);
  EXPECT_EQ(d.moved, 3u);
  ASSERT_TRUE(d.machines.spans());
  EXPECT_EQ(d.machines.count, 2);
  EXPECT_EQ(d.machines.per_machine, 2);
  EXPECT_EQ(d.machines.machine_of, (std::vector<int32_t>{0, 1, 0, 1}));
  EXPECT_EQ(d.machines.local_of, (std::vector<int32_t>{0, 0, 1, 1}));
  // No round can come at a capture for ranks on several hosts: the eager plan has graph slots.
  EXPECT_TRUE(d.graph_slots);
  all[1].header.flags |= kRefusesGraphSlots;  // MAGI_GRAPH_SLOTS=never on one rank
  EXPECT_FALSE(decide_everywhere(all).graph_slots);
  all[1].header.flags &= ~kRefusesGraphSlots;

  // Another topology is another plan: its hash differs.
  const uint64_t consecutive[] = {7, 7, 9, 9};
  for (size_t r = 0; r < all.size(); ++r) all[r].header.host = consecutive[r];
  const Decision other = decide_everywhere(all);
  EXPECT_EQ(other.moved, 3u);
  EXPECT_NE(other.hash, d.hash);
  EXPECT_NE(other.hash, decide_everywhere(ranks(4, 3)).hash);
}

TEST(Ladder, RanksOnMachinesOfUnequalSizeStayOnNccl) {
  auto all = ranks(4, 2);
  all[3].header.host = 43;  // 3 + 1
  EXPECT_EQ(decide_everywhere(all).reason, Reason::MachinesUneven);
  EXPECT_EQ(decide_everywhere(all).moved, 0u);
}

// On GPUs, peer access is asked of the ranks of each machine only: devices 0 and 1 of one
// machine are not devices 0 and 1 of another.
TEST(Ladder, OnTheCudaBackendEachMachinesGpusMustReachEachOtherAcrossMachinesNone) {
  auto all = ranks(4, 2);
  all[2].header.host = all[3].header.host = 43;
  for (auto& c : all) {
    c.header.backend = static_cast<uint8_t>(ce::Backend::Cuda);
    c.header.device = c.header.rank % 2;
    c.header.peer_access_mask = 0b11;
  }
  Decision d = decide_everywhere(all);
  EXPECT_EQ(d.reason, Reason::None);
  EXPECT_EQ(d.moved, 2u);
  EXPECT_TRUE(d.machines.spans());

  // Static weights on GPUs too: the network crossed once.
  for (auto& c : all) {
    c.header.flags |= kStaticWeights;
    c.header.hold_max_bytes = 1 << 20;
  }
  d = decide_everywhere(all);
  EXPECT_EQ(d.moved, 2u);
  EXPECT_TRUE(d.static_across_machines);
  EXPECT_TRUE(d.network_once);
  EXPECT_EQ(d.held_bytes, 2u * 2 * 1024);

  all[3].header.peer_access_mask = 0b10;  // rank 3 (device 1) cannot reach rank 2 (device 0)
  EXPECT_EQ(decide_everywhere(all).reason, Reason::PeerNotAccessible);
}

// Static weights across machines bind nothing in the window (each rank stages its machines'
// shards), and cross the network once where every rank may hold its machines' shards of every
// moved gather (the least MAGI_BIND_MAX_MIB of any rank); graph slots carry the captured ones.
TEST(Ladder, StaticWeightsAcrossMachinesCrossTheNetworkOnceWhereEveryRankMayHoldThem) {
  auto all = ranks(4, 2);  // 2 gathers of 256 float32 (1 KiB) a rank
  all[2].header.host = all[3].header.host = 43;
  for (auto& c : all) {
    c.header.flags |= kStaticWeights | kWantsGraphSlots;
    c.header.hold_max_bytes = 1 << 20;
  }
  const Decision d = decide_everywhere(all);
  EXPECT_EQ(d.moved, 2u);
  EXPECT_FALSE(d.bound);
  EXPECT_TRUE(d.static_across_machines);
  EXPECT_TRUE(d.graph_slots);
  EXPECT_TRUE(d.network_once);
  EXPECT_EQ(d.held_bytes, 2u * 2 * 1024);  // 2 machines' shards of 2 gathers

  all[3].header.hold_max_bytes = 4095;  // one rank may hold less: every rank stages
  const Decision staged = decide_everywhere(all);
  EXPECT_EQ(staged.moved, 2u);
  EXPECT_TRUE(staged.static_across_machines);
  EXPECT_FALSE(staged.network_once);
  EXPECT_NE(staged.hash, d.hash);
}

TEST(Ladder, DifferentBackendsMoveNothing) {
  auto all = ranks(2, 1);
  all[0].header.backend = static_cast<uint8_t>(ce::Backend::Cuda);
  EXPECT_EQ(decide_everywhere(all).reason, Reason::BackendDiffers);
}

TEST(Ladder, OneDryRankMakesEveryRankDry) {
  auto all = ranks(3, 2);
  all[1].header.flags |= kDryRun;
  const std::vector<uint8_t> bytes = gather_all(all);
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(decide(bytes, 3, r).dry_run);
}

Contribution commit(int rank, int n, RoundKind kind, uint64_t hash, bool can_serve) {
  Contribution c = propose(rank, n, 0);
  c.header.kind = static_cast<uint8_t>(kind);
  c.header.decision_hash = hash;
  if (can_serve) c.header.flags |= kCanServe;
  c.header.handle.bytes[0] = static_cast<uint8_t>(rank + 1);
  return c;
}

std::vector<Contribution> static_ranks(int n, int gathers) {
  std::vector<Contribution> all = ranks(n, gathers);
  for (Contribution& c : all) c.header.flags |= kStaticWeights;
  return all;
}

TEST(Ladder, StaticWeightsBindWhenNoGatherIsTransient) {
  const Decision d = decide_everywhere(static_ranks(4, 3));
  EXPECT_TRUE(d.bound);
  EXPECT_EQ(d.moved, 3u);
  EXPECT_EQ(d.transient_rank, -1);
}

TEST(Ladder, AGatherTransientOnOneRankMakesEveryRankStage) {
  for (const uint8_t flag : {kEntryBufferReused, kEntryInPlace}) {
    std::vector<Contribution> all = static_ranks(4, 3);
    const uint64_t bound_hash = decide_everywhere(all).hash;
    all[2].entries[1].flags = flag;
    const std::vector<uint8_t> bytes = gather_all(all);
    for (int r = 0; r < 4; ++r) {
      const Decision d = decide(bytes, 4, r);
      EXPECT_FALSE(d.bound) << "rank " << r;
      EXPECT_EQ(d.moved, 3u) << "rank " << r;  // still moved, staged as in the default mode
      EXPECT_EQ(d.transient_position, 1) << "rank " << r;
      EXPECT_EQ(d.transient_rank, 2) << "rank " << r;
      EXPECT_EQ(d.transient_flags, flag) << "rank " << r;
    }
    // A staged plan is another plan: no rank may serve it from bindings agreed before.
    const Decision staged = decide_everywhere(all);
    EXPECT_NE(staged.hash, bound_hash);
    EXPECT_NE(staged.hash, 0u);
  }
}

TEST(Ladder, ATransientGatherThatStaysOnNcclKeepsTheBinding) {
  std::vector<Contribution> all = static_ranks(4, 3);
  all[1].entries[0].flags = kEntryBufferReused;
  all[3].entries[0].reason = static_cast<uint8_t>(Reason::NotStable);
  const Decision d = decide_everywhere(all);
  EXPECT_TRUE(d.bound);
  EXPECT_EQ(d.moved, 2u);
  EXPECT_FALSE(d.gathers[0].moves);
}

TEST(Ladder, TransientFlagsMatterOnlyForStaticWeights) {
  std::vector<Contribution> all = ranks(2, 2);
  const uint64_t plain = decide_everywhere(all).hash;
  all[0].entries[0].flags = kEntryInPlace;
  const Decision d = decide_everywhere(all);
  EXPECT_FALSE(d.bound);
  EXPECT_EQ(d.transient_rank, -1);
  EXPECT_EQ(d.hash, plain);
}

// Graph slots: some rank asks (always, or auto after a capture) and none refuses (never); a
// plan with them is another plan (its windows differ). A bound plan needs none.
TEST(Ladder, GraphSlotsComeWhenSomeRankAsksAndNoneRefuses) {
  std::vector<Contribution> all = ranks(4, 2);
  const Decision none = decide_everywhere(all);
  EXPECT_FALSE(none.graph_slots);
  all[2].header.flags |= kWantsGraphSlots;
  const std::vector<uint8_t> bytes = gather_all(all);
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(decide(bytes, 4, r).graph_slots) << "rank " << r;
  const Decision wanted = decide_everywhere(all);
  EXPECT_EQ(wanted.moved, none.moved);
  EXPECT_NE(wanted.hash, none.hash);
  all[0].header.flags |= kRefusesGraphSlots;
  const Decision refused = decide_everywhere(all);
  EXPECT_FALSE(refused.graph_slots);
  EXPECT_EQ(refused.hash, none.hash);
  std::vector<Contribution> bound = static_ranks(4, 2);
  for (Contribution& c : bound) c.header.flags |= kWantsGraphSlots;
  const Decision d = decide_everywhere(bound);
  EXPECT_TRUE(d.bound);
  EXPECT_FALSE(d.graph_slots);
}

TEST(Ladder, EntryFlagsSurviveTheWireAndKeepTheEntrySize) {
  static_assert(sizeof(GatherEntry) == 24);
  Contribution c = propose(0, 1, 2);
  c.entries[1].flags = kEntryInPlace;
  c.entries[1].position = kMaxPosition;
  std::vector<uint8_t> bytes(kContributionBytes);
  c.serialize(bytes);
  Contribution back;
  ASSERT_TRUE(Contribution::parse(bytes, back));
  EXPECT_EQ(back.entries[0].flags, 0u);
  EXPECT_EQ(back.entries[1].flags, kEntryInPlace);
  EXPECT_EQ(back.entries[1].position, kMaxPosition);
}

// A step of one gather by shapes, four by each rank's own facts (L = 4 buffers in turn).
std::vector<Contribution> refining(int n, uint32_t period, uint32_t phase) {
  std::vector<Contribution> all = ranks(n, 1);
  for (Contribution& c : all) {
    c.header.period = 1;
    c.entries[0].reason = static_cast<uint8_t>(Reason::NotStable);
    c.header.refine_period = period;
    c.header.refine_phase = phase;
  }
  return all;
}

TEST(Refine, EveryRankProposingTheSamePeriodAndPhaseRefines) {
  const Decision d = decide_everywhere(refining(4, 4, 2));
  EXPECT_EQ(d.reason, Reason::StepRefined);
  EXPECT_EQ(d.refine_period, 4u);
  EXPECT_EQ(d.refine_phase, 2u);
  EXPECT_EQ(d.moved, 0u);
  EXPECT_EQ(d.hash, 0u);
  for (int r = 1; r < 4; ++r) {
    const Decision other = decide(gather_all(refining(4, 4, 2)), 4, r);
    EXPECT_EQ(other.refine_period, 4u) << "rank " << r;
    EXPECT_EQ(other.refine_phase, 2u) << "rank " << r;
  }
  // Grouping that looks unstable step by step does not stop a refinement.
  std::vector<Contribution> unstable = refining(2, 4, 0);
  unstable[1].header.flags |= kGroupsUnstable;
  EXPECT_EQ(decide_everywhere(unstable).refine_period, 4u);
}

TEST(Refine, OneRankWithAnotherPeriodOrPhaseOrNoneRefinesNothing) {
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<Contribution> all = refining(4, 4, 2);
    ContributionHeader& odd = all[2].header;
    if (variant == 0) odd.refine_period = 8;
    if (variant == 1) odd.refine_phase = 3;
    if (variant == 2) odd.refine_period = odd.refine_phase = 0;
    const Decision d = decide_everywhere(all);
    EXPECT_EQ(d.refine_period, 0u) << "variant " << variant;
    EXPECT_NE(d.reason, Reason::StepRefined) << "variant " << variant;
    // The round decides on the shape step as without refinement.
    EXPECT_EQ(d.mode, AgreementMode::Identical) << "variant " << variant;
    EXPECT_EQ(d.moved, 0u) << "variant " << variant;
  }
}

TEST(Refine, AVoidRoundOrDifferentStepsRefineNothing) {
  std::vector<Contribution> in_group = refining(4, 4, 0);
  in_group[1].header.flags |= kIssuedInGroup;
  EXPECT_EQ(decide_everywhere(in_group).reason, Reason::AnchorInGroup);
  std::vector<Contribution> differ = refining(4, 4, 0);
  differ[3].header.step_digest ^= 1;
  const Decision d = decide_everywhere(differ);
  EXPECT_EQ(d.mode, AgreementMode::Abort);
  EXPECT_EQ(d.refine_period, 0u);
  // Proposing the period the ranks already follow is no refinement.
  std::vector<Contribution> same = refining(4, 1, 0);
  EXPECT_EQ(decide_everywhere(same).refine_period, 0u);
}

TEST(Commit, AgreedOnlyWhenEveryRankCanServeTheSamePlan) {
  std::vector<Contribution> all;
  for (int r = 0; r < 3; ++r) all.push_back(commit(r, 3, RoundKind::Publish, 77, true));
  CommitOutcome c = decide_commit(gather_all(all), 3, RoundKind::Publish, 77);
  ASSERT_TRUE(c.agreed);
  ASSERT_EQ(c.handles.size(), 3u);
  EXPECT_EQ(c.handles[2].bytes[0], 3);

  all[1].header.flags &= ~kCanServe;
  c = decide_commit(gather_all(all), 3, RoundKind::Publish, 77);
  EXPECT_FALSE(c.agreed);
  EXPECT_EQ(c.reason, Reason::TransportFailed);

  // A static shard moved while the plan was committed: the refusing rank says so, and every rank
  // reads it alike.
  all[1].header.reason = static_cast<uint8_t>(Reason::BindingChanged);
  c = decide_commit(gather_all(all), 3, RoundKind::Publish, 77);
  EXPECT_FALSE(c.agreed);
  EXPECT_EQ(c.reason, Reason::BindingChanged);

  all[1] = commit(1, 3, RoundKind::Publish, 78, true);  // another plan
  EXPECT_FALSE(decide_commit(gather_all(all), 3, RoundKind::Publish, 77).agreed);

  all[1] = commit(1, 3, RoundKind::Confirm, 77, true);  // another round
  EXPECT_FALSE(decide_commit(gather_all(all), 3, RoundKind::Publish, 77).agreed);
}

// A plan spanning machines: the first member of each sub-communicator publishes its id, which
// every rank reads back by rank; the others' tables stay empty.
TEST(Commit, APublishCarriesTheSubCommunicatorsIdsByRank) {
  std::vector<Contribution> all;
  for (int r = 0; r < 4; ++r) all.push_back(commit(r, 4, RoundKind::Publish, 77, true));
  for (int r = 0; r < 2; ++r) {
    all[static_cast<size_t>(r)].table.assign(128, static_cast<uint8_t>(0x40 + r));
    all[static_cast<size_t>(r)].header.table_bytes = 128;
    all[static_cast<size_t>(r)].header.flags |= kSubCommId;
  }
  const CommitOutcome c = decide_commit(gather_all(all), 4, RoundKind::Publish, 77);
  ASSERT_TRUE(c.agreed);
  ASSERT_EQ(c.sub_comm_ids.size(), 4u);
  EXPECT_EQ(c.sub_comm_ids[0], std::vector<uint8_t>(128, 0x40));
  EXPECT_EQ(c.sub_comm_ids[1], std::vector<uint8_t>(128, 0x41));
  EXPECT_TRUE(c.sub_comm_ids[2].empty());
  EXPECT_TRUE(c.tables[0].exports.empty());  // an id is no source table
}

// A static plan's publish is sized by its shard count, the same on every rank: a table that
// exports every shard from an allocation of its own always fits, and every rank's table comes
// back whole, however large.
TEST(Commit, APublishRoundHoldsATableForEveryShardOfAPlanOfAnySize) {
  EXPECT_EQ(publish_round_bytes(0), kContributionBytes);
  EXPECT_EQ(publish_round_bytes(10), kContributionBytes);
  for (const size_t shards : {size_t{220}, size_t{300}, size_t{1000}, size_t{5000}}) {
    const size_t each = publish_round_bytes(shards);
    EXPECT_GE(each - sizeof(ContributionHeader),
              8 + shards * (ce::SourceTable::kExportBytes + ce::SourceTable::kSourceBytes))
        << shards;
    const size_t doublings = each / kContributionBytes;  // of the standard size
    EXPECT_EQ(each % kContributionBytes, 0u) << each;
    EXPECT_EQ(doublings & (doublings - 1), 0u) << each;
  }
  constexpr size_t kShards = 1000;
  const size_t each = publish_round_bytes(kShards);
  std::vector<Contribution> all;
  for (int r = 0; r < 3; ++r) {
    Contribution c = commit(r, 3, RoundKind::Publish, 77, true);
    ce::SourceTable table;
    for (size_t i = 0; i < kShards; ++i) {  // the worst case: an allocation per shard
      ce::ExportRecord record{};
      record.bytes = 4096 * (i + 1) + static_cast<size_t>(r);
      table.exports.push_back(record);
      table.sources.push_back({static_cast<uint16_t>(i), 64 * i});
    }
    c.table.resize(table.bytes() + 8);
    table.serialize(c.table);
    c.header.table_bytes = static_cast<uint32_t>(c.table.size());
    all.push_back(c);
  }
  const CommitOutcome out = decide_commit(gather_all(all, each), 3, RoundKind::Publish, 77);
  ASSERT_TRUE(out.agreed);
  ASSERT_EQ(out.tables.size(), 3u);
  for (size_t r = 0; r < 3; ++r) {
    ASSERT_EQ(out.tables[r].exports.size(), kShards);
    ASSERT_EQ(out.tables[r].sources.size(), kShards);
    EXPECT_EQ(out.tables[r].exports[kShards - 1].bytes, 4096 * kShards + r);
    EXPECT_EQ(out.tables[r].sources[kShards - 1].offset, 64 * (kShards - 1));
  }
  // In a standard-size round the same table cannot be carried: refused, never cut short.
  Contribution standard;
  EXPECT_FALSE(Contribution::parse(gather_all({all[0]}, kContributionBytes), standard));
}

// A cost round: every rank's median per bucket, both routes (moved_ns, nccl_ns).
Contribution cost(int rank, int nranks, std::vector<BucketCost> costs) {
  Contribution c = commit(rank, nranks, RoundKind::Cost, 77, true);
  c.costs = std::move(costs);
  c.header.gathers = static_cast<uint32_t>(c.costs.size());
  return c;
}

TEST(Cost, EachBucketTakesTheRouteFasterOnTheSlowestRank) {
  // Bucket 0: the copy engine is faster on every rank. Bucket 1: faster on rank 0, but rank 1's
  // copy-engine time is above every rank's NCCL time, and every rank waits for the slowest.
  // Bucket 2: rank 2 could not time it, so the agreed plan stands.
  std::vector<Contribution> all = {cost(0, 3, {{10, 20}, {5, 30}, {10, 20}}),
                                   cost(1, 3, {{12, 25}, {40, 31}, {10, 20}}),
                                   cost(2, 3, {{11, 22}, {6, 29}, {0, 20}})};
  const std::vector<CostVerdict> v = decide_cost(gather_all(all), 3, 3);
  ASSERT_EQ(v.size(), 3u);
  EXPECT_TRUE(v[0].keep);
  EXPECT_TRUE(v[0].measured);
  EXPECT_EQ(v[0].moved_ns, 12u);  // the slowest rank's, both routes: what the log reports
  EXPECT_EQ(v[0].nccl_ns, 25u);
  EXPECT_FALSE(v[1].keep);
  EXPECT_EQ(v[1].moved_ns, 40u);
  EXPECT_EQ(v[1].nccl_ns, 31u);
  EXPECT_TRUE(v[2].keep);
  EXPECT_FALSE(v[2].measured);

  all[1] = commit(1, 3, RoundKind::Confirm, 77, true);  // not a cost round: nothing is measured
  for (const CostVerdict& k : decide_cost(gather_all(all), 3, 3)) {
    EXPECT_TRUE(k.keep);
    EXPECT_FALSE(k.measured);
  }
}

}  // namespace
}  // namespace magi::rewrite
