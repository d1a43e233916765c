// The trace file format, version 1. One file per process: magice.<host>.<pid>.trace.
//
//   FileHeader, then records until end of file.
//   Each record: RecordHeader {type, bytes} followed by its payload; `bytes` counts the header
//   and the payload and is a multiple of 8. Integers are little-endian (x86-64 and Arm64 alike).
//   Readers skip record types they do not know (bytes tells how far), so later versions may add
//   types; a change to an existing layout bumps kVersion.
//
// The agreement's words and records (Agreement, Decision, Window, WindowRefusal) are part of this
// format and live in base/agreement_records.h, a leaf that rewrite/ includes too.
//
// The same structs are what the library keeps in memory, so writing a record is one memcpy.
// Pointers (buffers, streams, handles) are recorded beside the fingerprints, never hashed into
// them: they differ between ranks and between runs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "base/agreement_records.h"

namespace magi::trace {

inline constexpr char kMagic[8] = {'M', 'A', 'G', 'I', 'T', 'R', 'C', '\n'};
inline constexpr uint32_t kVersion = 1;

struct FileHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;  // sizeof(FileHeader) of the writer
  uint64_t pid;
  uint64_t start_monotonic_ns;  // CLOCK_MONOTONIC at open: the clock of every time_ns below
  uint64_t start_realtime_ns;   // CLOCK_REALTIME at the same instant, to place the trace in time
  char host[64];                // NUL-terminated
  char program[128];            // NUL-terminated, truncated
};
static_assert(sizeof(FileHeader) == 8 + 4 + 4 + 8 + 8 + 8 + 64 + 128);

enum class RecordType : uint16_t {
  Comm = 1,          // a communicator joined
  Call = 2,          // one NCCL call
  CommEnd = 3,       // a communicator finalized, destroyed, aborted or revoked
  Callsite = 4,      // the frames behind a call-site fingerprint, written once per fingerprint
  Module = 5,        // the name behind a module key, written once per module
  Step = 6,          // the step detector found or lost a communicator's repeating step
  Dropped = 7,       // records lost because the writer fell behind (never blocks the caller)
  Agreement = 8,     // an agreement round of a communicator was issued, read, or changed its routes
  Decision = 9,      // what one agreement round decided for one gather of the step, on this rank
  Window = 10,       // the memory a plan's window took on this rank, once it opened its peers'
  PyCallsite = 11,   // the Python frames behind a Python call-site fingerprint, written once each
  PyCall = 12,       // a call's Python call site (MAGI_PY_CALLSITES=1, the caller held the GIL)
  GroupServed = 13,  // how a gather queued inside a group was served once its group ended
  WindowRefusal = 14,  // why some of a plan's shards were copied into the window (one per reason)
};

struct RecordHeader {
  uint16_t type;  // RecordType
  uint16_t reserved;
  uint32_t bytes;  // header + payload, multiple of 8
};
static_assert(sizeof(RecordHeader) == 8);

// How a communicator came to be; for Split/Shrink, parent_id names the parent.
enum class CommOrigin : uint8_t {
  InitRank = 1,
  InitRankConfig,
  InitAll,
  InitRankScalable,
  Split,
  Shrink,
  Unknown
};
enum class CommEndKind : uint8_t { Finalize = 1, Destroy, Abort, Revoke, ProcessExit };

// NCCL operations, as recorded. Bcast is recorded as Broadcast with sendbuf == recvbuf.
enum class Op : uint8_t {
  AllGather = 1,
  AllReduce,
  ReduceScatter,
  Broadcast,
  Reduce,
  AlltoAll,
  Gather,
  Scatter,
  Send,
  Recv
};

inline constexpr uint8_t kCallCapturing = 1u << 0;  // the stream was capturing a CUDA graph
inline constexpr uint8_t kCallCaptureUnknown =
    1u << 1;  // could not ask CUDA (no driver, not a CUDA stream)
inline constexpr uint8_t kCallInGroup = 1u << 2;    // issued between ncclGroupStart and End
inline constexpr uint8_t kCallMoved = 1u << 3;      // served by the copy-engine transport, not NCCL
inline constexpr uint8_t kCallWouldMove = 1u << 4;  // MAGI_DRY_RUN: would have been moved
// Routed to the transport, whose bucket fell back: NCCL served it (every rank alike).
inline constexpr uint8_t kCallFellBack = 1u << 5;
// The capture bits above were asked of the driver (always for a traced call; untraced, only
// where a route or a round depends on them: the query is a third of the pass-through cost).
inline constexpr uint8_t kCallCaptureAsked = 1u << 6;

struct CommRecord {
  uint64_t comm_id;    // equal on every rank of the communicator
  uint64_t parent_id;  // Split/Shrink: the parent's comm_id; else 0
  uint64_t handle;     // the ncclComm_t value in this process
  uint64_t time_ns;
  int32_t rank;
  int32_t nranks;
  int32_t cuda_device;  // -1 when unknown
  uint8_t origin;       // CommOrigin
  uint8_t reserved[3];
};
static_assert(sizeof(CommRecord) == 48);

struct CallRecord {
  uint64_t comm_id;
  uint64_t seq;          // index of this call on its communicator, from 0
  uint64_t time_ns;      // when the call entered the library
  uint64_t shape;        // XXH3 of op, datatype, count, root, reduction op: equal across ranks
  uint64_t callsite;     // XXH3 of the normalised native frames; 0 when MAGI_CALLSITES=0
  uint64_t fingerprint;  // XXH3 of shape and callsite
  uint64_t count;        // the count argument NCCL's API takes for this op
  uint64_t sendbuf;      // rank-local: recorded, never hashed
  uint64_t recvbuf;
  uint64_t stream;
  uint32_t duration_ns;  // time spent in the real NCCL call (saturates)
  uint32_t thread;       // kernel thread id of the caller
  int32_t root_or_peer;  // root of rooted collectives, peer of Send/Recv, else -1
  int32_t redop;         // reduction op of reductions, else -1
  int32_t result;        // ncclResult_t returned to the program
  uint8_t op;            // Op
  uint8_t dtype;         // ncclDataType_t
  uint8_t group_depth;   // ncclGroupStart nesting on the calling thread
  uint8_t flags;         // kCall*
  int32_t rank;    // the caller's rank in the communicator (ncclCommInitAll: several per file)
  uint32_t group;  // the calling thread's outermost group ordinal (kCallInGroup), else 0
};
static_assert(sizeof(CallRecord) == 112);

struct CommEndRecord {
  uint64_t comm_id;
  uint64_t time_ns;
  uint64_t calls;  // calls recorded on it
  uint8_t how;     // CommEndKind
  uint8_t reserved[7];
};
static_assert(sizeof(CommEndRecord) == 32);

struct Frame {
  uint64_t module;  // module key: XXH3 of the module's GNU build-id, or of its file name
  uint64_t offset;  // instruction address minus the module's load base
};

struct CallsiteRecord {
  uint64_t callsite;
  uint32_t frames;  // Frame[frames] follow
  uint32_t reserved;
};
static_assert(sizeof(CallsiteRecord) == 16);

// The name is the path the module was loaded from (older writers: its file name alone); the
// GNU build-id's raw bytes follow it, so a reader can tell the binary on its machine is the one
// that ran (0 bytes: none, or an older writer, which wrote 0 here).
struct ModuleRecord {
  uint64_t module;
  uint32_t name_bytes;  // name follows (not NUL-terminated), then build_id_bytes, then padding
  uint32_t build_id_bytes;
};
static_assert(sizeof(ModuleRecord) == 16);

enum class StepEvent : uint8_t { Found = 1, Lost = 2 };

struct StepRecord {
  uint64_t comm_id;
  uint64_t seq;      // collective index (not call seq: Send/Recv are not in steps) at the event
  uint64_t origin;   // collective index where the current run of steps began
  uint64_t digest;   // XXH3 of the step's shapes, from its first position
  uint64_t repeats;  // complete steps seen (Lost: how many the run lasted)
  uint32_t period;   // calls per step
  uint8_t event;     // StepEvent
  uint8_t reserved[3];
};
static_assert(sizeof(StepRecord) == 48);

// ---- Python call sites (capture/py_callsite.h) ----

// Followed by `frames` PyFrameEntry, innermost first, then their texts: each entry's file, then
// its function, not NUL-terminated; then padding to 8.
struct PyCallsiteRecord {
  uint64_t py_callsite;  // XXH3 over the frames' files, functions and lines
  uint32_t frames;
  uint32_t text_bytes;
};
static_assert(sizeof(PyCallsiteRecord) == 16);

struct PyFrameEntry {
  int32_t line;
  uint16_t file_bytes;
  uint16_t function_bytes;
};
static_assert(sizeof(PyFrameEntry) == 8);

struct PyCallRecord {
  uint64_t comm_id;
  uint64_t seq;  // the CallRecord's
  uint64_t py_callsite;
  int32_t rank;
  uint32_t reserved;
};
static_assert(sizeof(PyCallRecord) == 32);

// A gather routed off NCCL inside a group is recorded when it is queued, before its bucket is
// served at ncclGroupEnd: this record, written then, gives the call its kCallMoved or
// kCallFellBack flag. Readers apply it to the CallRecord with the same comm_id, seq and rank.
struct GroupServedRecord {
  uint64_t comm_id;
  uint64_t seq;  // the CallRecord's
  int32_t rank;
  uint8_t flags;  // kCallMoved or kCallFellBack
  uint8_t reserved[3];
};
static_assert(sizeof(GroupServedRecord) == 24);

struct DroppedRecord {
  uint64_t records;
};

inline constexpr uint32_t padded(uint32_t bytes) { return (bytes + 7u) & ~7u; }

// A record's bytes as a file holds them: its RecordHeader, the payload, then the tail and zero
// padding. The trace writer and the flight recorder's sites segments both write records this way.
inline constexpr uint32_t record_bytes(uint32_t payload_bytes, uint32_t tail_bytes) {
  return padded(static_cast<uint32_t>(sizeof(RecordHeader)) + payload_bytes + tail_bytes);
}
// Writes record_bytes(payload_bytes, tail_bytes) bytes at `out`.
void encode_record(char* out, RecordType type, const void* payload, uint32_t payload_bytes,
                   const void* tail, uint32_t tail_bytes);

std::string_view op_name(Op op);
std::string_view dtype_name(uint8_t dtype);
std::string_view origin_name(CommOrigin origin);
std::string_view end_name(CommEndKind how);
std::string_view redop_name(int32_t redop);
bool is_collective(Op op);

}  // namespace magi::trace
