// What a rank puts into an agreement round, and the decision every rank derives from all of them.
//
// A round is one all-gather of fixed-size contributions (kContributionBytes, whatever the step),
// so the round itself can never mismatch between ranks, even when their steps differ. The one
// exception is sized by what every rank already agreed: a static plan's publish carries a source
// table per rank, as large as the plan's shard count makes it (publish_round_bytes). decide()
// is a pure function of all ranks' contributions: every rank that reads the same bytes reaches the
// same decision. The only rank-local input it takes is which rank is "me", used for wording the
// reasons, never for what moves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "base/agreement_records.h"
#include "base/sizes.h"
#include "ce_transport/ce_transport.h"
#include "rewrite/machines.h"

namespace magi::rewrite {

using trace::AgreementMode;
using trace::Reason;
using trace::RoundKind;

inline constexpr uint32_t kContributionMagic = 0x4147524d;  // "MRGA"
inline constexpr uint32_t kContributionVersion = 4;
inline constexpr uint32_t kMaxGathers = 1024;  // gathers per step a round can carry

// Flags of a contribution.
// This rank's round could not launch at once (it sits in an open group holding Send/Recv).
inline constexpr uint32_t kIssuedInGroup = 1u << 0;
inline constexpr uint32_t kGroupsUnstable = 1u << 1;  // its grouping changed between steps
inline constexpr uint32_t kDryRun = 1u << 2;          // MAGI_DRY_RUN=1 on this rank
inline constexpr uint32_t kCanServe = 1u << 3;        // publish/confirm: prepared / attached
inline constexpr uint32_t kStaticWeights = 1u << 4;   // MAGI_STATIC_WEIGHTS=1 on this rank
// Confirm: this rank can serve the plan, but is still opening its peers' memory, off the
// program's calls: every rank asks again at the next step.
inline constexpr uint32_t kSettingUp = 1u << 5;
// Propose: this rank asks for graph slots (MAGI_GRAPH_SLOTS=always, or auto once it saw a gather
// captured into a CUDA graph), or refuses them (never).
inline constexpr uint32_t kWantsGraphSlots = 1u << 6;
inline constexpr uint32_t kRefusesGraphSlots = 1u << 7;
// Publish of a plan spanning machines: the table holds the ncclUniqueId of this rank's
// inter-machine sub-communicator, which this rank, its first member (machine 0), made.
inline constexpr uint32_t kSubCommId = 1u << 8;

struct ContributionHeader {
  uint32_t magic;
  uint32_t version;
  uint32_t round;
  uint8_t kind;     // RoundKind
  uint8_t backend;  // ce::Backend
  uint8_t reason;   // publish/confirm: why this rank cannot serve
  uint8_t reserved0;
  int32_t rank;
  int32_t nranks;
  uint32_t flags;
  uint64_t step_digest;      // shapes of the step (capture's digest)
  uint64_t callsite_digest;  // call sites of the step's all-gathers, in order
  uint64_t group_digest;     // which positions are grouped together
  uint32_t period;
  uint32_t gathers;  // all-gathers in the step
  uint64_t host;     // ce::Locality
  int32_t device;
  uint32_t table_bytes;  // publish, hello: bytes of the table in the entry area
  uint64_t peer_access_mask;
  uint64_t decision_hash;  // publish/confirm: the decision being served
  ce::HandleBlob handle;   // publish: how to open this rank's window
  // Propose: the longer step this rank sees in its own facts (call sites, send buffers), a
  // multiple of the shape step, and the collective index of its position 0 modulo it; 0: none.
  uint32_t refine_period;
  uint32_t refine_phase;
  // Propose: the most bytes this rank may hold of other ranks' static shards (MAGI_BIND_MAX_MIB),
  // for a plan spanning machines that crosses the network once.
  uint64_t hold_max_bytes;
};
// The header grows only into the padding of the entry area (kContributionBytes stays).
static_assert(sizeof(ContributionHeader) <= 320);

// Flags of a GatherEntry: its send buffer is transient on this rank (it holds the shard only
// around its own call), so a static binding taken at the anchor would hold other bytes.
inline constexpr uint8_t kEntryBufferReused = 1u << 0;  // send range overlaps another gather's
inline constexpr uint8_t kEntryInPlace = 1u << 1;       // sendbuf == recvbuf + rank × bytes
inline constexpr uint8_t kEntryTransient = kEntryBufferReused | kEntryInPlace;
inline constexpr uint32_t kMaxPosition = (1u << 24) - 1;  // MAGI_MAX_STEP_CALLS <= 2^20

// One all-gather of the step as this rank saw it.
struct GatherEntry {
  uint64_t callsite;
  uint64_t count;
  uint32_t position : 24;  // in the step
  uint32_t flags : 8;      // kEntry*
  uint16_t bucket;         // bucket index in the step
  uint8_t dtype;
  uint8_t reason;  // Reason::None: eligible on this rank
};
static_assert(sizeof(GatherEntry) == 24);

// Cost rounds: per bucket of the plan, the median time this rank measured each way (0: not
// measured).
struct BucketCost {
  uint64_t moved_ns;
  uint64_t nccl_ns;
};
static_assert(sizeof(BucketCost) <= sizeof(GatherEntry));

inline constexpr size_t kContributionBytes =
    (sizeof(ContributionHeader) + kMaxGathers * sizeof(GatherEntry) + 63) / 64 * 64;
// A publish round carries the rank's zero-copy source table (ce::SourceTable, its counts
// included) where a propose carries its entries.
inline constexpr size_t kPublishTableRoom = kContributionBytes - sizeof(ContributionHeader);
// The contribution size of a publish round for a plan binding `shards` shards: room for a table
// that exports every shard from an allocation of its own, so that no shard is ever bound for want
// of room. Every rank computes it from the agreed plan alone, so every rank's all-gather has the
// same size. The standard size doubled as often as needed, so that plans of similar size reuse
// one round's buffers.
size_t publish_round_bytes(size_t shards);

// A contribution being built or read: header, then entries.
struct Contribution {
  ContributionHeader header{};
  std::vector<GatherEntry> entries;  // header.gathers of them, at most kMaxGathers
  std::vector<BucketCost> costs;     // cost rounds instead of entries: header.gathers of them
  // Publish rounds: a serialized ce::SourceTable; hello rounds: the ScheduleSettings (hello.h).
  std::vector<uint8_t> table;

  // `out`: the round's contribution size (kContributionBytes, or a publish's).
  void serialize(std::span<uint8_t> out) const;
  // Parses one rank's slice; false when it is not a contribution of this version.
  static bool parse(std::span<const uint8_t> in, Contribution& out);
};

struct GatherDecision {
  uint32_t position;
  uint16_t bucket;
  bool moves;
  Reason reason;       // why it stays (Reason::None when it moves)
  int32_t refused_by;  // lowest other rank that held it ineligible, else -1
};

// Network once: the room one gather's machines' shards take in the held region, each machine's
// at a slot-aligned stride. A plan's held bytes are its moved gathers' sum (decide), laid out in
// that order by the serving.
inline size_t held_room(size_t shard_bytes, int32_t machines) {
  return round_up(shard_bytes, ce::kSlotAlignment) * static_cast<size_t>(machines);
}

struct Decision {
  AgreementMode mode = AgreementMode::None;
  Reason reason = Reason::None;  // when nothing moves because of the whole communicator
  bool dry_run = false;          // some rank runs dry: everyone only reports
  bool bound = false;            // every rank asserted static weights: shards are bound once
  // Staged (not bound): the window has graph slots, so gathers captured into CUDA graphs move
  // too. Some rank wants them and none refuses them.
  bool graph_slots = false;
  // Static weights asserted by every rank, but some moving gather is transient on some rank: the
  // plan stages (default mode) instead. The first such gather, for the log; -1 when none.
  int64_t transient_position = -1;
  int32_t transient_rank = -1;
  uint8_t transient_flags = 0;          // kEntry* of that entry on that rank
  std::vector<GatherDecision> gathers;  // in step order
  uint32_t moved = 0;
  uint64_t hash = 0;  // of step digest, mode and the moving positions; 0 if none move
  // Less moved than later may: some rank's candidate was not yet stable, or its groups had not
  // settled. The next propose comes soon (ExplorationPolicy::retry_soon), on every rank alike.
  bool retry_soon = false;
  // Every rank proposed this refinement (Reason::StepRefined): nothing moves, and every rank
  // restarts its rounds on a step of refine_period collectives from here. 0: none.
  uint32_t refine_period = 0;
  uint32_t refine_phase = 0;
  // The machines the ranks run on (rewrite/machines.h). A plan spanning several gathers in two
  // levels; it stages (never bound), with graph slots unless a rank refuses them.
  Machines machines;
  // Static weights asserted by every rank, but the plan spans machines: nothing is bound in a
  // window, each rank stages its machines' shards.
  bool static_across_machines = false;
  // ... and the other machines' shards cross the network once: each rank holds
  // every moved gather's shards of its peers of the same local index (`held_bytes`, its
  // machines' shards of every gather), within every rank's MAGI_BIND_MAX_MIB; later eager calls
  // read only inside the machine.
  bool network_once = false;
  uint64_t held_bytes = 0;

  bool moves_anything() const { return moved != 0; }
};

// The ladder. `all` holds nranks contributions of equal size (kContributionBytes), rank order.
Decision decide(std::span<const uint8_t> all, int nranks, int my_rank);
// A propose this rank issued inside an open group: void, without reading it.
Decision void_propose(const std::vector<GatherEntry>& entries);
// After gathers of a decision were made to stay (by verdicts every rank holds alike): its moved
// count and hash again, as decide() computes them for the step `step_digest`.
void recount(Decision& decision, uint64_t step_digest);

// Publish and confirm rounds: true when every rank can serve `decision_hash`; else the reason.
struct CommitOutcome {
  bool agreed = false;
  // Publish or confirm: every rank can serve the plan, but some rank is still setting it up
  // (kSettingUp, reason SettingUp: its window, or its mappings of the peers'): not agreed yet,
  // asked again.
  bool pending = false;
  Reason reason = Reason::None;
  std::vector<ce::HandleBlob> handles;  // publish: by rank
  std::vector<ce::SourceTable> tables;  // publish: by rank (empty tables but for zero-copy)
  // Publish of a plan spanning machines: by rank, the sub-communicator id that rank made (empty
  // but for the first member of each sub-communicator).
  std::vector<std::vector<uint8_t>> sub_comm_ids;
};
// Cost rounds: for each bucket, whether it keeps moving. A bucket moves on when the slowest rank's
// moved time is no worse than the slowest rank's NCCL time (every rank waits for the slowest), or
// when some rank could not measure it. The times compared come along, for the log.
struct CostVerdict {
  bool keep = true;
  bool measured = false;
  uint64_t moved_ns = 0;  // the slowest rank's median, both routes
  uint64_t nccl_ns = 0;
};
std::vector<CostVerdict> decide_cost(std::span<const uint8_t> all, int nranks, size_t buckets);

CommitOutcome decide_commit(std::span<const uint8_t> all, int nranks, RoundKind kind,
                            uint64_t decision_hash);

}  // namespace magi::rewrite
