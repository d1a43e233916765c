// ce_transport/: moves agreed all-gathers without NCCL. The face of the folder.
//
// rewrite/ decides, with every rank, which gathers leave NCCL; this folder serves them. It knows
// nothing of skeletons or agreement: it is handed a plan of buckets with symmetric offsets (equal
// on every rank, computed by rewrite/ from shared facts), a handle blob to publish, the peers'
// blobs to open, and then one call per bucket.
//
// Two backends behind one interface, one mechanism (window_transport.cc) over each kind of
// memory's operations (memory_ops.h):
//  - Cuda: device windows, peers' windows mapped through CUDA IPC, copy-engine reads
//    (cudaMemcpyBatchAsync) on the caller's stream, cross-rank ordering by stream memory
//    operations on peer-mapped flag words (no kernels).
//  - Host (MAGI_BACKEND=host): the same logic over host memory (POSIX shared-memory windows,
//    memcpy, the handshake on host atomics), for programs whose buffers are host memory (the NCCL
//    stand-in, machines without GPUs). The CPU tests run every transport path through it.
//
// Window layout, the same on every rank (so a peer's slot for gather g of a bucket is at the same
// offset in its window as ours): two staging slots and the flag words of the handshake, one line
// per word (host: [ head | flags | slot 0 | slot 1 ]; CUDA: [ slot 0 | slot 1 | flags ]). Which
// word is whose, the handle blob's header and the fault points are the protocol both backends
// share (protocol.h). A moved bucket with sequence number n (counted per transport from 1, equal
// on every rank because routes are) stages this rank's shards into slot n % 2, publishes ready =
// n in every peer's window, waits until every peer's ready >= n in its own, reads every peer's
// slot into the receive buffers (its own shard straight from its send buffer), then publishes
// done = n. Before staging into slot n % 2 it waits until every
// peer's done >= n - 2: that slot was last read in bucket n - 2. A steady run finds that wait
// already met, so it is off the critical path; the one wait that matters is "every peer staged".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "base/backend.h"
#include "ce_transport/round_board.h"  // part of the face: rounds where no NCCL call may run

namespace magi::ce {

using magi::Backend;

// Where slots, shards in a bound region and the offsets of a bucket's gathers are aligned: the
// copy engines' alignment for full-speed reads, and the offsets rewrite/ agrees on (the same on
// every rank) are multiples of it.
inline constexpr size_t kSlotAlignment = 256;

// What kind of memory a buffer is; decides eligibility (device memory for Cuda, host for Host).
enum class MemoryKind : uint8_t { Device, Host, Managed, Unknown };

struct BufferIdentity {
  MemoryKind kind = MemoryKind::Unknown;
  uint64_t allocation_id =
      0;            // CUDA's buffer id (CU_POINTER_ATTRIBUTE_BUFFER_ID); 0 for host memory
  int device = -1;  // CUDA device of device memory
};
// Classifies `ptr` for `backend`. Host backend: every pointer is Host memory, allocation id 0.
// Cuda backend: asks the driver (only if the program already loaded it); Unknown otherwise.
BufferIdentity identify_buffer(Backend backend, const void* ptr);

// Static weights: whether peers could read `bytes` at `ptr` where they lie (zero-copy), i.e.
// whether the memory can be exported (exports.h). Asked at plan time, never on the call path.
bool exportable(Backend backend, const void* ptr, size_t bytes);

// The calling thread sets up a window off the program's calls (rewrite/set_up.h): between two
// mappings of the peers' memory it steps aside for a moment. Opening a CUDA IPC handle holds up
// the program's own CUDA calls for as long as it takes (in proportion to the bytes mapped: 768
// allocations of 4 MiB stalled one program call by 60-90 ms on an H200), so the mappings are
// spread out rather than made back to back: after each, a pause as long as it took (20 µs to
// 1 ms). (Shared-memory mappings hold nothing up: not paced.)
void pace_mappings_on_this_thread(bool on);

// Where this process runs, for "every peer is on this node and can reach my memory".
struct Locality {
  uint64_t host = 0;    // XXH3 of hostname and boot id
  int32_t device = -1;  // CUDA device ordinal (-1: host backend or unknown)
  uint64_t peer_access_mask =
      0;  // bit d: this device can access device d (cudaDeviceCanAccessPeer)
};
Locality local_locality(Backend backend, int cuda_device);

// Opaque, fixed size: what a rank publishes so that peers can open its window.
struct HandleBlob {
  static constexpr size_t kBytes = 192;
  uint8_t bytes[kBytes] = {};
};

// Static weights (MAGI_STATIC_WEIGHTS=1): a shard copied once into the window, where peers then
// read it on every call with no handshake.
struct BindOp {
  const void* sendbuf;
  size_t bytes;
  size_t slot_offset;
};

// What a window holds.
//  - Default: two staging slots of `slot_bytes` (a bucket's shards, packed), the handshake flags.
//  - Bound (static weights): one region of `slot_bytes` holding every moved gather's shard at its
//    own offset, filled from `bind` during prepare (complete before prepare returns, so before
//    any peer can read: peers attach only after every rank published). Each gather then reads
//    peers' regions directly.
//  - Bound and `zero_copy` (static weights, the default there): each shard of `bind` that lies in
//    memory its owner can export is read by the peers where the program keeps it (the owner
//    exports each allocation once, the peers map it once: no copy, no second allocation); only
//    the others are copied into the region, packed. Which is which differs by rank, so the
//    owner publishes a SourceTable (sources()) and the peers take it at attach. The table must
//    fit in `table_room` bytes (SourceTable::bytes()): past it, shards are bound.
//  The rank checks its shard on each of its first `verify_first` calls and then every
//  `verify_every` calls (0: never after the first), never on a timed call (verify_schedule.h),
//  on sampled lines, never the whole shard (at most 128 KiB a check; a rewrite touching an
//  anchor line is caught at the next check, any other within stride / 256 checks:
//  sample_plan.h): a bound shard against its binding (a mismatch is re-bound whole), one read
//  in place against what the first look at each set saw (exports.h); a change is reported by
//  take_stale_bindings(). What the ranks read is compared across ranks without waiting
//  (source_log.h, take_disagreement()). The CUDA backend's check does not wait for the stream:
//  it compares once its copies have run, at a later call.
struct WindowPlan {
  size_t slot_bytes = 0;
  bool bound = false;
  // Staged windows: two more slots, for buckets captured into CUDA graphs (Timing::Captured),
  // whose handshake every replay leaves as it found it (window_transport.cc). Twice the slots'
  // memory; agreed like the rest of the plan, so alike on every rank.
  bool graph_slots = false;
  bool zero_copy = false;  // bound only
  size_t table_room = 0;   // zero_copy: the most bytes the SourceTable may take
  std::vector<BindOp> bind;
  uint64_t verify_first = 3;
  uint64_t verify_every = 64;
  // Staged windows, two levels with static weights (the network crossed once): a region of this
  // rank's own (Transport::held_region(); the window's kind of memory, never read by the peers)
  // where the caller keeps its machines' shards of every gather once they came. A gather that
  // stages from there names its own piece (GatherOp::own_source), which is checked.
  size_t held_bytes = 0;
};

// Zero-copy static weights: where this rank's shard of each BindOp can be read by a peer.
// `handle` is the backend's: the CUDA IPC handle of the allocation's base, or the host backend's
// shared file (kind Handle: the bytes alone open it); or, for memory only a file descriptor can
// share (cuMemCreate allocations), where the owner's descriptor channel listens, and `index`,
// the offer there that hands the descriptors (kind ByDescriptor: fd_channel.h). Fixed-size
// records, so a table's size is known before it is filled.
struct ExportRecord {
  enum class Kind : uint32_t { Handle = 0, ByDescriptor = 1 };
  uint8_t handle[64];
  uint64_t bytes;  // the allocation's size: every source in it must lie inside
  Kind kind = Kind::Handle;
  uint32_t index = 0;  // ByDescriptor: the owner's offer
};
struct ShardSource {
  static constexpr uint16_t kInWindow = 0xffff;  // copied into the owner's region, at `offset`
  uint16_t allocation = kInWindow;               // else: index into the exports
  uint64_t offset = 0;                           // in that allocation or region (< 2^48)
};
struct SourceTable {
  static constexpr size_t kExportBytes = sizeof(ExportRecord);  // 80
  static constexpr size_t kSourceBytes = 8;  // allocation (16 bits) and offset (48 bits)
  static constexpr uint64_t kMaxOffset = (uint64_t{1} << 48) - 1;
  std::vector<ExportRecord> exports;
  std::vector<ShardSource> sources;  // one per BindOp, in the plan's order

  size_t bytes() const { return exports.size() * kExportBytes + sources.size() * kSourceBytes; }
  // Counts, then the records: what the publish round carries. `out` holds at least bytes() + 8.
  void serialize(std::span<uint8_t> out) const;
  // Throws Error(Usage) on a table that does not parse, names a kind of export it does not know
  // or whose sources name no export.
  static SourceTable parse(std::span<const uint8_t> in);
};

// What a window took, for the log and the trace: device (or shared) memory the transport
// allocated, and what it reads in place instead.
struct WindowMemory {
  size_t window_bytes = 0;  // allocated by the transport: flags, slots, bound shards
  size_t bound_shards = 0;  // copied into the window
  size_t bound_bytes = 0;
  size_t exported_shards = 0;  // read by the peers in the program's own memory
  size_t exported_bytes = 0;   // the shards' bytes (not the allocations')
  size_t exported_allocations = 0;
  size_t peer_mappings = 0;  // peers' allocations this rank mapped at attach
  // The first shard that could not be exported, and why ("" when none).
  int64_t first_refused = -1;  // its index in the plan's bind
  std::string refusal;
  // Every reason shards were bound for, in the order first met: how many shards and bytes, and
  // the first of them (its index in the plan's bind).
  struct Refusal {
    std::string why;
    size_t shards = 0;
    size_t bytes = 0;
    int64_t first = -1;
  };
  std::vector<Refusal> refusals;
};

// One gather of a bucket. `bytes` is this rank's shard (sendcount × element size); the receive
// buffer holds nranks × bytes, rank r's shard at r × bytes. In-place (sendbuf == recvbuf +
// rank × bytes) is allowed. `slot_offset` is where this gather's shard lies inside a staging slot
// (bound windows: inside the region, where the peers' bindings are read AND where this rank's
// binding, checked against `sendbuf`, is): equal on every rank. `verify_now` (bound windows):
// the check of `sendbuf` against that binding is owed now (its next untimed call), whatever the
// schedule says: the caller found the send buffer is not the one bound there.
// `own_offset` (bound windows): the slot offset of the gather's own position, when the caller
// reads another position's sources (slot_offset) because that is the buffer it sends; kOwn:
// the same. Such a call is a deviation, which the peers compare (source_log.h).
// `captured`: the call's stream is capturing a CUDA graph (bound windows, or staged ones with
// graph slots): the bucket is served with Timing::Captured. `bucket`: the plan's index of the
// gather's bucket, the same on every rank: which graph slot a captured bucket of a staged window
// takes (bucket % 2).
//
// Two levels (a communicator spanning machines; staged windows, eager or on graph slots): the
// transport is one machine's, its ranks the machine's local indices, and each rank's part is
// `pieces` shards of `bytes` (the shards of its peers of the same local index on every machine,
// which NCCL gathers between machines), staged and read whole; piece m of local rank r lands at
// recvbuf + places[r × pieces + m] × bytes (the global rank of machine m, local index r), so the
// receive buffer is NCCL's all-gather of the whole communicator. The part is copied from
// `sendbuf`, or, where `sendbuf` is null, written into the staging slot by the bucket's
// PartWriter (NCCL between machines writing straight into the slot: no copy). `refuse`: this
// rank cannot serve the bucket (its NCCL part failed): on synchronous memory it says so as a
// failing rank does, and every local peer falls back within the bucket.
// Held pieces (WindowPlan::held_bytes; eager buckets): `sendbuf` lies in held_region(), and
// piece `own_piece` (this rank's machine) is staged from `own_source`, the program's send
// buffer, so this machine reads the call's own bytes; the held copy of it, which the other
// machines took, is compared with `own_source` (the whole piece at every call on synchronous
// memory; sampled lines on the schedule of bound windows on a stream) and a difference is
// reported by take_stale_bindings() at the held pieces' offset in held_region().
struct GatherOp {
  static constexpr size_t kOwn = ~size_t{0};
  const void* sendbuf;
  void* recvbuf;
  size_t bytes;
  size_t slot_offset;
  bool verify_now = false;
  size_t own_offset = kOwn;
  bool captured = false;
  uint16_t bucket = 0;
  uint32_t pieces = 1;
  const int32_t* places = nullptr;  // pieces > 1 only
  bool refuse = false;
  const void* own_source = nullptr;  // held pieces only
  uint32_t own_piece = 0;
};

// Two levels: writes the parts of a bucket's gathers whose `sendbuf` is null into this rank's
// staging slot, at the point of the bucket where no local peer reads that slot any more and none
// has been told it is staged (after the wait for the slot, before this rank's ready), on the
// bucket's stream (host memory: done when it returns). False: this rank cannot serve the bucket
// (GatherOp::refuse).
class PartWriter {
 public:
  // Each such op's part (pieces × bytes) goes to `slot + op.slot_offset`.
  virtual bool write_parts(std::span<const GatherOp> bucket, uint8_t* slot, void* stream) = 0;

 protected:
  ~PartWriter() = default;
};

// A transport for one communicator. Every method may throw magi::Error; the caller (rewrite/)
// turns a failure into "this communicator goes back to NCCL at the next agreement round".
class Transport {
 public:
  virtual ~Transport() = default;

  // Allocates this rank's window for `plan` (binding its shards if bound) and fills `out` with
  // what peers need to open it. Called once per agreed plan.
  virtual void prepare(const WindowPlan& plan, HandleBlob& out) = 0;
  // Zero-copy plans: what the peers need besides the blob (empty otherwise). Valid after prepare.
  virtual const SourceTable& sources() const = 0;
  // Opens every peer's window (blobs indexed by rank; this rank's own entry is ignored) and, for
  // a zero-copy plan, the allocations of every peer's table (`tables`, by rank, required then).
  virtual void attach(std::span<const HandleBlob> blobs, std::span<const SourceTable> tables) = 0;
  void attach(std::span<const HandleBlob> blobs) { attach(blobs, {}); }
  // Serves one bucket on the caller's stream (ignored by the host backend, which completes the
  // bucket before returning). Every rank calls this for the same buckets in the same order.
  // FallBack: some rank failed before moving anything, and every rank learned it within this
  // same bucket and moved nothing: the caller serves the bucket another way (NCCL). Throws when
  // this rank failed in a way its peers cannot learn of in the bucket.
  // Only the host backend can fall back: its handshake runs on the host, so a failing rank
  // publishes "failed" with its ready and every peer reads it before moving. The CUDA backend's
  // handshake runs on the stream after gather() has returned, so no peer's host can learn of a
  // failure within the bucket without waiting for the stream; a failing CUDA rank throws, and
  // its peers' streams wait for it (as they would in NCCL's kernels) until the communicator is
  // aborted. MAGI_INJECT_FAULT=gather:RANK follows the same rule (ce_transport/protocol.h).
  // Timed: the cost trial times this bucket, so nothing else (a static binding's check) may run
  // in it. Captured: the stream is capturing a CUDA graph, and the bucket is recorded for every
  // replay of it, its copies as plain copies (the batch call is refused in a capture). A bound
  // window records the reads alone, with no flag and no check, which a replay would repeat from
  // the capture's values. A staged window needs graph slots (WindowPlan::graph_slots; throws
  // Error(Usage) without them) and records a handshake of its own on them, which counts nothing:
  // each word it waits on is put back by the waiter, so every replay finds the words as the
  // capture did. Every mapping the copies read stays mapped while a graph holds them (release()
  // then leaves them, and a later release or prepare frees them once every such graph and its
  // instances are destroyed).
  enum class Served : uint8_t { Moved, FallBack };
  enum class Timing : uint8_t { Untimed, Timed, Captured };
  // `writer`: the parts of gathers without a send buffer (two levels), written in the bucket.
  virtual Served gather(std::span<const GatherOp> bucket, void* stream,
                        Timing timing = Timing::Untimed, PartWriter* writer = nullptr) = 0;
  // Frees the window and unmaps the peers', once every peer has finished reading it and this
  // rank's own copies have run. If that cannot be known (a peer died, or did not finish in
  // time, or abandon() came first), the rank stops waiting and leaves the window allocated, and
  // says so: freeing device memory waits for the whole device, which a stuck peer would hang.
  // Safe to call more than once and after a failure.
  virtual void release() = 0;
  // The communicator is being aborted, possibly from another thread while a call is in flight:
  // every wait of this rank on its peers gives up now (CUDA: work already queued on a stream runs
  // on without its peers, reading whatever their windows hold, as NCCL's output after an abort
  // is undefined; a graph's waits on graph slots give up at every replay to come). Only
  // release() may follow.
  virtual void abandon() = 0;

  // Bytes this rank's window holds (flags and slots, or the bound region); 0 before prepare.
  virtual size_t window_bytes() const = 0;
  // The window's memory, and what it reads in place (exports after prepare, mappings after
  // attach).
  virtual WindowMemory memory() const = 0;
  // Bound windows: slot offsets of bindings found stale (the shard changed) since the last call;
  // windows with held pieces: held_region() offsets of pieces whose own piece was found changed.
  virtual std::vector<size_t> take_stale_bindings() { return {}; }
  // WindowPlan::held_bytes of this rank's own, after prepare (nullptr without).
  virtual uint8_t* held_region() const { return nullptr; }
  // Bound windows: bytes of this rank's shards that its checks have compared with their bindings
  // since prepare (the CUDA backend copies as many of the binding too). What a check costs.
  virtual uint64_t checked_bytes() const { return 0; }
  // Bound windows: the first disagreement between what the ranks read, once it is visible here
  // (source_log.h), described, once; "" otherwise. Never waits; may be called from any thread
  // until release().
  virtual std::string take_disagreement() { return {}; }
  // A peer of the attached window that died with the communicator in use: its process is gone
  // and it never released its window ("rank R (pid P)"), so its part of every moved gather, and
  // of every replay of a graph holding them, will never come. "" otherwise, or while a prepare,
  // attach or release runs (never waits for them). Asks the system about each peer's pid, and
  // reads a dead one's window; may be called from any thread.
  virtual std::string lost_peer() { return {}; }
};

// The communicator is being aborted: the graph slots' latches of its windows that earlier plans
// left to CUDA graphs still alive (ce_transport.h's release()) are opened for good too, as
// abandon() opens the current window's, so that no replay of those graphs waits on a peer that
// is gone. Nothing without such windows (no CUDA call at all).
void abandon_graphs(uint64_t comm_identity) noexcept;

// A waiting rank notices a dead peer (its pid is in its window) and throws instead of waiting
// for ever.
// `device`: the communicator's CUDA device (Cuda backend; -1 when unknown).
std::unique_ptr<Transport> make_transport(Backend backend, int rank, int nranks,
                                          uint64_t comm_identity, int device = -1);

// Times one bucket to its completion on its stream (seed 000: wait(launch()), not the launch):
// the wall clock for the host backend, whose buckets complete before the call returns; CUDA
// events for the CUDA backend, read once the bucket is long done.
class CompletionTimer {
 public:
  virtual ~CompletionTimer() = default;
  virtual void start(void* stream) = 0;
  virtual void stop(void* stream) = 0;
  virtual uint64_t elapsed_ns() = 0;  // waits for the stop point if it has not passed yet
};
std::unique_ptr<CompletionTimer> make_timer(Backend backend);

// Whether `backend` can run in this process now: the host backend always; the CUDA backend once
// the program has loaded the CUDA driver (we never start CUDA ourselves).
bool backend_available(Backend backend);

// ---- the exchange buffers of agreement rounds ----
// rewrite/ runs each agreement round as one all-gather of fixed-size contributions through the
// real NCCL on the communicator. Where those bytes live depends on the backend (NCCL needs device
// memory; the stand-in takes host memory), so the buffers come from here.
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual void* send_buffer() = 0;  // contribution_bytes, where the real NCCL reads
  virtual void* recv_buffer() = 0;  // nranks × contribution_bytes, where it writes
  virtual void* stream() = 0;       // the stream the all-gather is issued on
  // Copies `contribution` to the send buffer before the all-gather is issued.
  virtual void stage(std::span<const uint8_t> contribution) = 0;
  // After the all-gather was issued: starts bringing the result back to the host.
  virtual void issued() = 0;
  // True once the result can be read without waiting.
  virtual bool ready() = 0;
  // Waits for the result and returns it (nranks × contribution_bytes).
  virtual std::span<const uint8_t> result() = 0;
};
std::unique_ptr<Exchange> make_exchange(Backend backend, size_t contribution_bytes, int nranks,
                                        int device = -1);

// For its life, the calling thread's own CUDA calls (a round's wait, a window's set-up) are not
// taken for part of a CUDA graph that a thread of the program is capturing, and the thread's
// capture mode is given back after. Nothing for the host backend.
class OutsideCapture {
 public:
  explicit OutsideCapture(Backend backend);
  ~OutsideCapture();
  OutsideCapture(const OutsideCapture&) = delete;
  OutsideCapture& operator=(const OutsideCapture&) = delete;

 private:
  int saved_;
};

}  // namespace magi::ce
