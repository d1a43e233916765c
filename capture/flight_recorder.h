// The flight recorder (MAGI_FLIGHT_RECORDER=N): each communicator's last N calls, kept in a file
// mapping that outlives the process, so `magice-trace hang` can say which rank stopped where
// even after the job was SIGKILLed (the trace's last buffer dies with the process).
//
// One file per process, magice.<host>.<pid>.flight (mode 0600, never through a symlink):
//
//   FileHeader, padded to one page;
//   then segments, each page aligned and starting with a SegmentHeader that gives its size and
//   kind. A communicator's ring (kind kRing) is appended when a rank starts joining it, off the
//   call path: RingHeader, then Record[capacity]. Other kinds hold what the records refer to;
//   a reader skips a kind it does not know.
//
// A segment whose size is still zero (the process died while adding it) ends the file.
//
// Publication: call seq goes to slot seq % capacity. The writer zeroes the slot's stamp, writes
// the fields with plain stores, then stores stamp = seq + 1 with release order; end_call stores
// the result, then returned = seq + 1, also release. A reader (of a live or a killed process)
// keeps a slot only when the stamp read before and after copying it is the same non-zero value
// and names the seq the slot holds: a record the process died writing is ignored. The call path
// makes no syscall: stores into memory the kernel already maps to the file.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "capture/trace_format.h"

namespace magi::capture {

namespace flight {

inline constexpr char kMagic[8] = {'M', 'A', 'G', 'I', 'F', 'L', 'T', '\n'};
inline constexpr uint32_t kVersion = 2;
inline constexpr size_t kPage = 4096;
inline constexpr uint32_t kMinCapacity = 16;
inline constexpr uint32_t kMaxCapacity = 65536;

struct FileHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;  // the file header's segment: one page
  uint64_t pid;
  uint64_t start_monotonic_ns;
  uint64_t start_realtime_ns;
  char host[64];      // NUL-terminated
  char program[128];  // NUL-terminated, truncated
  uint32_t capacity;  // records per communicator (a power of two)
  uint32_t record_bytes;
};

// Each segment's first bytes.
struct SegmentHeader {
  uint64_t bytes;  // header + body, page aligned; 0: the segment was never completed
  uint32_t kind;   // SegmentKind
  uint32_t reserved;
};
enum SegmentKind : uint32_t { kRing = 1, kSites = 2 };

// Where a rank stands with its communicator (RingHeader::joined).
enum JoinState : uint8_t {
  kJoining = 0,  // inside ncclCommInitRank* (waiting for the other ranks, or died there)
  kJoined = 1,   // the init returned; calls follow
  kJoinFailed = 2,
};

// How the records' `completed` (and `reached`) words are filled (RingHeader::completion).
enum CompletionSource : uint8_t {
  kCompletionOff = 0,     // not watched
  kCompletionReturn = 1,  // no asynchronous work (no CUDA driver): complete when returned
  kCompletionEvents = 2,  // CUDA events recorded on the call's stream, polled off the call path
};

// Why a call's completion is not watched (Record::unwatched's top byte).
enum UnwatchedReason : uint8_t {
  kUnwatchedCaptured = 1,    // issued into a CUDA graph, and no replay reached it yet
  kUnwatchedFailed = 2,      // the call (or its group's end) returned an error: nothing ran
  kUnwatchedInProgress = 3,  // ncclInProgress: a non-blocking communicator enqueues it later
  kUnwatchedBusy = 4,        // no event free: the GPU is far behind, or calls come very fast
  kUnwatchedDriver = 5,      // an event call of the driver failed
  kUnwatchedNotRun = 6,      // its group was simulated or never ended
};
inline constexpr uint64_t kUnwatchedSeqMask = (uint64_t{1} << 56) - 1;
std::string_view unwatched_text(uint8_t reason);

struct RingHeader {
  SegmentHeader segment;
  uint64_t comm_id;  // equal on every rank of the communicator
  uint64_t parent_id;
  uint64_t join_monotonic_ns;
  int32_t rank;  // -1: a communicator made out of the shim's sight
  int32_t nranks;
  uint32_t capacity;
  uint8_t origin;      // trace::CommOrigin
  uint8_t joined;      // JoinState (atomic_ref, release)
  uint8_t completion;  // CompletionSource
  uint8_t reserved;
  uint32_t ended;  // CommEndKind + 1 once ended; 0 while alive (atomic_ref, release)
  uint32_t reserved2;
  uint64_t reserved3[2];
};
static_assert(sizeof(RingHeader) == 80);

// A kSites segment: call-site descriptions the records' fingerprints refer to, as trace records
// (trace_format.h) one after another; `used` (release) counts the body's complete bytes.
// Written at a fingerprint's first sighting only (Module, Callsite and PyCallsite records, as
// the trace writes them); a full segment is followed by a new one.
struct SitesHeader {
  SegmentHeader segment;
  uint64_t used;
  uint64_t reserved[5];
};
static_assert(sizeof(SitesHeader) == 64);
inline constexpr size_t kSitesSegmentBytes = 16 * kPage;

// Lays out a kSites segment of `bytes` (page aligned) in zeroed `memory`.
SitesHeader* init_sites(void* memory, size_t bytes);
// Appends one record to the segment: its bytes first, then `used` with release order, so a
// reader (of a killed process too) never takes part of a record. False when it has no room.
// One writer at a time.
bool append_site(SitesHeader& sites, trace::RecordType type, const void* payload,
                 uint32_t payload_bytes, const void* tail, uint32_t tail_bytes);

struct Record {
  // Written through std::atomic_ref, so the struct stays trivially copyable for readers.
  alignas(8) uint64_t stamp;  // seq + 1 once the record is complete; 0 while written
  uint64_t returned;          // seq + 1 once the call returned (`result` then holds)
  uint64_t reached;     // seq + 1 once the call's stream reached the call (work before it done)
  uint64_t completed;   // seq + 1 once the call's work finished on its stream
  uint64_t seq;         // the call's index on its communicator
  uint64_t collective;  // collective index + 1; 0 for Send and Recv
  uint64_t count;
  uint64_t callsite;  // call-site fingerprint when one was taken, else 0
  uint64_t python;    // Python call-site fingerprint when one was taken, else 0
  int32_t root_or_peer;
  int32_t redop;
  int32_t result;  // ncclResult_t, once returned
  uint8_t op;      // trace::Op
  uint8_t dtype;
  uint8_t group_depth;
  uint8_t flags;  // trace::kCall* as begin_call set them
  // (UnwatchedReason << 56) | (seq + 1) when completion was on but this call is not watched:
  // `reached` and `completed` then say nothing about it.
  uint64_t unwatched;
};
static_assert(sizeof(Record) == 96);
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);

// Capacity for a MAGI_FLIGHT_RECORDER value: at least kMinCapacity, a power of two.
uint32_t capacity_for(int64_t calls);
size_t segment_bytes(uint32_t capacity);

// What a reader keeps of one communicator's ring.
struct RingView {
  RingHeader header{};
  std::vector<Record> records;  // complete records, by seq
  uint64_t torn = 0;            // slots being written when the copy was made
};

struct FileView {
  std::string path;
  FileHeader header{};
  std::vector<RingView> rings;
  std::vector<std::string> sites;  // each kSites segment's body, as written so far
};

// Decodes a recorder file's bytes. Throws std::runtime_error with the file name and what is
// wrong when it is not one.
FileView parse_file(const std::string& name, std::span<const char> bytes);
FileView read_file(const std::string& path);

}  // namespace flight

// The writer's handle on one communicator's ring; null when the recorder is off.
struct FlightRing;

// When a rank starts joining (before the real init, never on the call path): adds the
// communicator's ring to this process's file in state `state`, creating the file at the first
// join. Null when MAGI_FLIGHT_RECORDER=0 or the file failed (one WARN, then the recorder stays
// off). `completion`: how the ring's reached/completed words will be filled
// (capture/completion.h).
FlightRing* flight_join(uint64_t comm_id, uint64_t parent_id, int rank, int nranks, uint8_t origin,
                        flight::JoinState state, flight::CompletionSource completion);
// The ring this thread started joining for `comm_id` (flight_join with kJoining), if any; the
// next call forgets it.
FlightRing* flight_take_joining(uint64_t comm_id);
void flight_set_joined(FlightRing* ring, flight::JoinState state, uint64_t parent_id);
// Before the ring's first call: the source decided again once the init returned (the CUDA
// driver may have been loaded by the init).
void flight_set_completion(FlightRing* ring, flight::CompletionSource completion);
void flight_end(FlightRing* ring, uint8_t how);

// The call path: stores only.
struct FlightCall {
  uint64_t seq;
  uint64_t collective;  // index + 1, or 0
  uint64_t count;
  uint64_t callsite;
  uint64_t python;
  int32_t root_or_peer;
  int32_t redop;
  uint8_t op, dtype, group_depth, flags;
};
// The slot a call was written to, for the completion watcher: `record` is null when the ring's
// completion is off.
struct FlightSlot {
  flight::Record* record = nullptr;
  flight::CompletionSource completion = flight::kCompletionOff;
};
FlightSlot flight_issue(FlightRing* ring, const FlightCall& call);

// A call-site description for the process's file (append_site into its kSites segment, a new
// segment when that one is full), under the file's mutex: callers write a fingerprint's first
// sighting only. Nothing when the process has no file (no communicator recorded yet).
void flight_add_site(trace::RecordType type, const void* payload, uint32_t payload_bytes,
                     const void* tail = nullptr, uint32_t tail_bytes = 0);
void flight_return(uint64_t comm_id, uint64_t seq, int32_t result);

// MS_ASYNC over the file's mappings (the dump signal); safe from any thread.
void flight_sync();
// In a child after fork(): the parent's file and mappings are left alone; the child starts a
// file of its own at its first join.
void flight_forget_in_child();

// Test seam: the ring in memory the caller owns (no file): `memory` holds
// segment_bytes(capacity) bytes, zeroed.
FlightRing* flight_ring_in(void* memory, uint32_t capacity, uint64_t comm_id, int rank, int nranks,
                           flight::CompletionSource completion = flight::kCompletionOff);
void flight_ring_release(FlightRing* ring);

}  // namespace magi::capture
