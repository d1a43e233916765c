// The agreement's words and the trace records that carry them: the ladder's modes, the kinds and
// events of rounds, why a gather stays on NCCL, each gather's verdict, and the Agreement,
// Decision, Window and WindowRefusal records of the trace file (capture/trace_format.h: the
// file, its header and record types, version 1).
//
// In base/, below capture/ and rewrite/ (it includes nothing of the project's): rewrite/ decides
// in these words and fills these records, capture/ writes them into the trace and the tools read
// them back, and neither folder holds the other's words. Part of the trace format: a change to
// a layout here bumps trace::kVersion.
#pragma once

#include <cstdint>
#include <string_view>

namespace magi::trace {

// The ladder of seed 001, for a live process: how the ranks' skeletons compared.
enum class AgreementMode : uint8_t {
  None = 0,       // not compared (the round was only issued, or was abandoned)
  Identical = 1,  // steps and call sites equal: gathers matched by (call site, occurrence)
  Slot = 2,       // steps equal, call sites differ: gathers matched by position in the step
  Abort = 3,      // steps, groups or gather counts differ: nothing moves on this communicator
};

// Rounds of one agreement: propose (decide what moves), publish (windows prepared, handles
// exchanged), confirm (every rank opened every window). Routes change when a confirm is read.
// Then cost: after a trial of both routes, each bucket keeps the faster one.
// Hello: the settings check at a communicator's first collective (rewrite/hello.h).
enum class RoundKind : uint8_t { Propose = 1, Publish = 2, Confirm = 3, Cost = 4, Hello = 5 };

enum class RoundEvent : uint8_t {
  Issued = 1,       // this rank's contribution went into the all-gather
  Read = 2,         // the round's result was read and decided
  Activated = 3,    // routes changed: the agreed gathers leave NCCL from this call on
  Deactivated = 4,  // routes back to NCCL from this call on (deviation, failure, new decision)
  Abandoned = 5,    // the step was lost before the round was read: its result is ignored
};

// Why a gather (or a whole communicator) stays on NCCL. Names: reason_name().
enum class Reason : uint8_t {
  None = 0,
  NotStable,            // count, call site or group changed within MAGI_WARMUP_STEPS steps (static
                        // weights: or its send buffer)
  HostMemory,           // a host buffer (the cuda backend needs device memory)
  DeviceMemory,         // a device buffer (the host backend serves host memory only)
  ManagedMemory,        // managed (unified) memory
  UnknownMemory,        // the driver could not say what the buffer is
  PeerOffNode,          // a rank of the communicator is on another host
  PeerNotAccessible,    // a peer's GPU cannot be reached (cudaDeviceCanAccessPeer)
  ShardTooSmall,        // below MAGI_SYMM_MIN_SHARD_MIB
  GraphCapture,         // issued while its stream was capturing a CUDA graph
  WindowTooLarge,       // its bucket needs more staging than MAGI_WINDOW_MAX_MIB
  OtherRankRefused,     // another rank holds it ineligible
  BucketPartial,        // another gather of its bucket (ncclGroupStart/End) stays
  StepsDiffer,          // abort: the ranks' steps differ
  GroupsDiffer,         // abort: the ranks group their calls differently
  TooManyGathers,       // abort: more gathers in the step than a round can carry
  AnchorInGroup,        // the round's call was inside an open ncclGroupStart on some rank
  BackendDiffers,       // ranks run different MAGI_BACKEND values
  TransportFailed,      // the transport could not prepare, attach or serve on some rank
  CommitRefused,        // some rank did not confirm the commit
  Deviated,             // the call deviated from the agreed step in a shared fact
  CommNotAgreeable,     // made by ncclCommInitAll, non-blocking, or unknown to the shim
  BindTooLarge,         // static weights: the bindings would pass MAGI_BIND_MAX_MIB
  BindingChanged,       // static weights: the shard changed after it was bound (verification)
  NcclFaster,           // timed both ways during the trial: NCCL completed its bucket sooner
  SettingsDiffer,       // the ranks' schedule settings differ, or some rank cannot take part
  StepRefined,          // every rank proposed the same longer step: rounds restart on it
  SingleRank,           // a communicator of one rank: NCCL's one local copy cannot be beaten
  SettingUp,            // a confirm: some rank is still mapping its peers' memory; asked again
  CaptureRule,          // agreed at a graph capture, untimed: its bucket is below the size rule
  CaptureAbandoned,     // a round at a graph capture did not reach every rank in time
  NotInPlaceAtCapture,  // static weights at a graph capture: its shard cannot be read in place
  MachinesUneven,       // the ranks span machines holding different numbers of them (3 + 1)
  OneRankPerMachine,    // the ranks span machines of one rank each: nothing is local to read
  MachinesOnDevice,     // not given any more (the CUDA backend gathers in two levels): older traces
  Count
};

struct AgreementRecord {
  uint64_t comm_id;
  uint64_t seq;          // collective index of the call at which the event happened
  uint64_t step_digest;  // the step the round is about
  uint32_t round;        // per communicator, from 1; the rounds of one agreement share it
  uint32_t period;
  uint32_t gathers;  // gathers in the step
  uint32_t moved;    // gathers that move (Read of a propose, Activated); would move under dry run
  int32_t rank;
  uint8_t kind;    // RoundKind
  uint8_t event;   // RoundEvent
  uint8_t mode;    // AgreementMode (Read, Activated)
  uint8_t reason;  // Reason: why nothing moves, or why routes went back
};
static_assert(sizeof(AgreementRecord) == 48);

enum class Verdict : uint8_t { Moved = 1, WouldMove = 2, Stays = 3 };

// Written when a propose round is read: one per gather of the step, on every rank.
struct DecisionRecord {
  uint64_t comm_id;
  uint64_t callsite;  // this rank's call site of the gather
  uint64_t count;
  uint32_t round;
  uint32_t position;  // position of the gather in the step
  int32_t rank;
  int32_t refused_by;  // Stays because of another rank: the lowest such rank; else -1
  uint16_t bucket;     // bucket index in the step (gathers of one ncclGroupStart/End share it)
  uint8_t dtype;
  uint8_t verdict;  // Verdict
  uint8_t reason;   // Reason (Stays)
  uint8_t mode;     // AgreementMode of the round
  // The machines the plan spans (0 or 1: one; at most 255 said): a gather that moves runs in two
  // levels, NCCL between machines on the sub-communicator of this rank's local index `sub_comm`.
  // Zero in files written before: one machine.
  uint8_t machines;
  uint8_t sub_comm;
};
static_assert(sizeof(DecisionRecord) == 48);

// Written when a plan's window is open on this rank (every peer's opened too): what it took.
struct WindowRecord {
  uint64_t comm_id;
  uint64_t seq;             // collective index of the call at which the peers were opened
  uint64_t window_bytes;    // allocated by the transport: flags, staging slots, bound shards
  uint64_t bound_bytes;     // static weights: shards copied into the window
  uint64_t exported_bytes;  // static weights: shards the peers read in this rank's own memory
  uint32_t round;
  int32_t rank;
  uint32_t bound_shards;
  uint32_t exported_shards;
  uint32_t exported_allocations;  // this rank's allocations the peers opened
  uint32_t peer_mappings;         // the peers' allocations this rank opened
  uint8_t mode;                   // AgreementMode of the plan
  uint8_t reserved[7];
};
static_assert(sizeof(WindowRecord) == 72);

// Followed by `text_bytes` of the reason (not NUL-terminated), then padding to 8. Written with
// its plan's WindowRecord, one per reason its shards could not be read in place.
struct WindowRefusalRecord {
  uint64_t comm_id;
  uint64_t bytes;  // of the shards bound for this reason
  int64_t first;   // the first of them: its index among the plan's bound gathers
  uint32_t round;
  int32_t rank;
  uint32_t shards;
  uint32_t text_bytes;
};
static_assert(sizeof(WindowRefusalRecord) == 40);

std::string_view mode_name(AgreementMode mode);
std::string_view round_kind_name(RoundKind kind);
std::string_view round_event_name(RoundEvent event);
std::string_view reason_name(Reason reason);  // a short phrase: "send buffer changed", ...
std::string_view verdict_name(Verdict verdict);

}  // namespace magi::trace
