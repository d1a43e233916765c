// What a window transport asks of its memory: the operations in which host shared memory and
// CUDA device memory differ, one table of them per kind. Private to ce_transport/.
//
// The transport is one mechanism (window_transport.cc): the window a plan needs, binding static
// shards, the handle blob, attach and its checks, where each peer's shard is read, the bucket
// handshake, the checks of static weights. It touches memory only through this table, as each
// NCCL transport is one struct of functions under a shared protocol:
//  - host_memory_ops.cc: POSIX shared-memory windows, memcpy, flag words as host atomics;
//  - cuda_memory_ops.cc: cudaMalloc windows shared by CUDA IPC, cudaMemcpyBatchAsync, flag words
//    written and waited for by stream memory operations.
// One fact of the kind shapes the mechanism itself, synchronous(): whether an operation is done
// when it returns (host), or queued on the caller's stream to run later, in order (device).
#pragma once

#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "base/base.h"
#include "ce_transport/ce_transport.h"
#include "ce_transport/exports.h"
#include "ce_transport/fd_channel.h"
#include "ce_transport/protocol.h"
#include "ce_transport/sample_plan.h"

namespace magi::ce {

// A window as this process reaches it: its own, or a peer's through a mapping.
struct WindowView {
  uint8_t* region = nullptr;  // the staging slots (two, or four with graph slots), or the bound
                              // region
  size_t region_bytes = 0;    // the room they have
  size_t slot_stride = 0;     // staging: where slot k lies after slot 0, k times this
  uint8_t* flags = nullptr;   // the handshake's words, at protocol.h's FlagLayout offsets
  uint8_t* held = nullptr;    // this rank's own: held pieces (WindowPlan::held_bytes); peers'
                              // views have none
};

// One copy of a batch.
struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};

// One operation on a word of the handshake; a batch runs in its order.
//  - Write, Wait: a counter (the eager handshake): stores `value`; waits until the word holds at
//    least `value`.
//  - Latch, WaitLatch: a latch (graph slots: protocol.h): stores `value` (0 or 1) in the low 32
//    bits alone; waits until the word & kLatchOpen is not 0 (set, or aborted).
//  - Open: a latch opened for good by an abort: 1 stored in its high 32 bits alone.
struct FlagOp {
  enum class Kind : uint8_t { Write, Wait, Latch, WaitLatch, Open };
  Kind kind;
  int rank;        // Write, Latch: whose window holds `word`; waits: the peer that writes it
  uint8_t* word;   // waits: always a word of this rank's own window
  uint64_t value;  // what is stored, or waited for (Wait)
};

// The blob's bytes after its header: what a kind needs to map a window (protocol.h).
using Medium = std::array<uint8_t, protocol::kMediumBytes>;

// A check of static weights copies four sets of sampled lines (sample_plan.h) to host memory:
// the anchor and the sweep, of the reference (binding or agreed source) and of the shard sent.
inline constexpr size_t kCheckSetBytes = SamplePlan::kMaxSetBytes;
inline constexpr size_t kCheckBytes = 4 * kCheckSetBytes;

class MemoryOps {
 public:
  virtual ~MemoryOps() = default;

  // ---- the kind ----
  virtual Backend backend() const = 0;
  // True when copies and flag operations are done when they return, in the caller's order (host
  // memory): the handshake runs on the calling thread, so a rank that cannot serve a bucket tells
  // its peers within it (failed words: Served::FallBack), and a check is compared at once. False
  // when they are queued on the caller's stream and run later (device memory): nothing of a
  // bucket is known on the host when gather() returns, and a check is compared at a later call.
  virtual bool synchronous() const = 0;
  // Where the flag words lie in a window (the line each takes is the kind's).
  virtual const protocol::FlagLayout& flags() const = 0;
  // Makes the calling thread ready to use this memory (CUDA: the communicator's device): first in
  // gather, on the program's thread, so as cheap as can be.
  virtual void use() {}
  // The same on a thread that may never have used it (the set-up's, a watchdog's): first in
  // prepare, attach, abandon and release, off the gathers' path.
  virtual void use_on_any_thread() { use(); }
  // The calling thread's own calls on this memory (a window's set-up or release) are not taken
  // for part of a CUDA graph a thread of the program is capturing, until restore_capture() is
  // given what this returned (cuda_thread.h's RelaxedCaptureMode); through OwnCalls. Nothing for
  // host memory.
  virtual int relax_capture() { return -1; }
  virtual void restore_capture(int /*saved*/) {}
  // Whether mapping a peer's allocation holds up the program's own calls on the device (CUDA
  // IPC: in proportion to the bytes mapped), so that a set-up off the calls spreads its mappings
  // out (pace_mappings_on_this_thread). Shared-memory mappings hold nothing up.
  virtual bool paces_mappings() const { return false; }

  // ---- this rank's window ----
  // Allocates it, its flag words as `first_flags` has them (protocol::first_flags(): the
  // FlagLayout's bytes(); a kind that keeps no failed words takes those before them): two
  // staging slots of `slot_bytes` (four with `graph_slots`: WindowView::slot_stride apart), or
  // one bound region of `slot_bytes` (`bound`, which also gets a check buffer); and, past the
  // rest, `held_bytes` of held pieces (WindowView::held; a check buffer too when not 0).
  virtual WindowView allocate(size_t slot_bytes, bool bound, bool graph_slots,
                              std::span<const uint8_t> first_flags, size_t held_bytes = 0) = 0;
  virtual size_t window_bytes() const = 0;  // 0 while there is no window
  // Bound windows, at prepare: copies the program's shards into the window, done before prepare
  // returns. A shard the program has freed since is refused (Error System), never read.
  virtual void bind(std::span<const Copy> shards) = 0;
  // Writes what peers need to map the window, once everything written into it so far is there.
  virtual void export_window(Medium& medium) = 0;

  // ---- the peers' windows ----
  // First in attach, once the peers' blobs are checked (CUDA: the device; the stream memory
  // operations looked up now, not at the first gather). `pids`: the peers' processes, by rank
  // (this rank's own 0), from their blobs: a wait on the host notices a dead one.
  virtual void begin_attach(std::span<const pid_t> pids) = 0;
  // Maps peer `rank`'s window from its checked header and its medium. A mapping made is kept
  // until release(), also when this throws afterwards.
  virtual WindowView map_peer(int rank, const protocol::BlobHeader& header,
                              const Medium& medium) = 0;
  // Whether the peer whose medium this is runs on this rank's GPU (its mappings then take turns
  // with this rank's: mapping_turns.h). False where that is not known.
  virtual bool shares_gpu_with(const Medium& /*peer*/) const { return false; }

  // ---- the program's memory read in place (zero-copy static weights: exports.h) ----
  virtual exports::Exportable find_export(const void* ptr, size_t bytes) = 0;
  // find_export for a whole plan's shards, one after the other (host: the process's mappings
  // read once, not once a shard).
  virtual std::function<exports::Exportable(const void*, size_t)> export_finder() {
    return [this](const void* ptr, size_t bytes) { return find_export(ptr, bytes); };
  }
  // Whether the allocation exported at `base` is still the one exported (`identity`; `bytes`:
  // the export's size, ExportRecord::bytes).
  virtual bool export_alive(uintptr_t base, size_t bytes, uint64_t identity) = 0;
  // An export by descriptor (find_export's, kind ByDescriptor): what the offer of it hands a
  // peer (fd_channel.h), made now (host: a descriptor of its file held; CUDA: its pieces'
  // handles retained) and kept until end_offers(). Throws when it cannot be offered;
  // offer_refusal() begins the reason.
  virtual fd_channel::Offer descriptor_offer(const exports::Exportable& e) = 0;
  virtual const char* offer_refusal() const = 0;
  // What the offers were made from goes (after the channel that served them stopped).
  virtual void end_offers() {}
  // Maps a peer's exported allocation, until release().
  virtual exports::Span import(const ExportRecord& record) = 0;
  virtual size_t imports() const = 0;

  // ---- the call path ----
  // A bucket's copies on `stream`, as one batch (CUDA: spread over the copy engines).
  virtual void copy_batch(std::span<const Copy> copies, void* stream) = 0;
  // The same while `stream` captures a CUDA graph, where a batch is refused: each copy recorded
  // on its own (a graph's memcpy nodes). Host memory has no graph: the copies are made now.
  virtual void copy_captured(std::span<const Copy> copies, void* stream) {
    copy_batch(copies, stream);
  }
  // The graph `stream` is capturing uses this window and its mappings: they stay until that
  // graph, and every instance of it, is destroyed (release() leaves them meanwhile). Nothing
  // when the stream is not capturing, and nothing for host memory.
  virtual void hold_for_graph(void* /*stream*/) {}
  // The staged buckets of a window run in the order they were issued, whatever streams they are
  // issued on, as NCCL orders a communicator's work across the program's streams: the eager
  // handshake pairs a rank's n-th bucket with its peers' n-th, and a bucket run before an
  // earlier one of the same rank would publish a ready its peers take for the earlier one's.
  // follow_last_bucket(): first in a bucket, whose stream then waits for the end of the last
  // one when that was on another stream; end_bucket(): last. Nothing for synchronous memory.
  // `captured` (a bucket on graph slots, recorded into a CUDA graph): the order is taken at each
  // launch of the graph, whatever stream it is launched on, as NCCL orders a communicator's
  // graph launches: a replay runs after the bucket last issued or launched before it, and the
  // buckets issued after the launch run after the replay's. Two graphs launched on unordered
  // streams would otherwise pair their uses of a graph slot's latches wrongly.
  virtual void follow_last_bucket(void* /*stream*/, bool /*captured*/) {}
  virtual void end_bucket(void* /*stream*/, bool /*captured*/) {}
  // A bound shard copied into the window again, on `stream` (ahead of that call's reads).
  virtual void rebind(const Copy& shard, void* stream) = 0;
  // Flag operations on `stream`, in order.
  virtual void run_flags(std::span<const FlagOp> ops, void* stream) = 0;
  // A word of this rank's own window as it is now. Synchronous memory only.
  virtual uint64_t read_flag(const uint8_t* word) const = 0;

  // ---- checks of static weights ----
  // kCheckBytes of host memory for a check's lines; bound windows and windows with held pieces,
  // after allocate().
  virtual uint8_t* check_buffer() = 0;
  // The lines of `set` from `from` into `into`, packed one after the other, on `stream`.
  virtual void copy_lines(uint8_t* into, const uint8_t* from, const SampleSet& set,
                          void* stream) = 0;
  // A check's line copies are queued on `stream`; lines_copied() is true once they have run
  // (throws if they failed).
  virtual void mark_lines(void* stream) = 0;
  virtual bool lines_copied() = 0;

  // A word of this rank's window or of a peer's, read or written now, off the gathers' path
  // (CUDA: a copy on the window's own stream, waited for, on the communicator's device, the
  // calling thread's device given back after; never a program's stream, which may be stuck).
  virtual uint64_t read_word_now(const uint8_t* word) = 0;
  virtual void write_word_now(uint8_t* word, uint64_t value) = 0;

  // ---- the end (window_end.h decides, these execute) ----
  // Synchronous memory: every wait of this rank running on a thread now, or to come, gives up
  // (throws). A stream's waits are released by the words an abort writes (run_flags_now).
  virtual void interrupt_waits() {}
  // This rank's own flag words as they are now, copied to the host (CUDA: on the window's own
  // stream, waited for: never a program's stream, which may be the one stuck); nullptr when they
  // cannot be read. Valid until the next call.
  virtual const uint8_t* read_flags_now() = 0;
  // Flag operations (writes only) run now on the window's own stream, waited for; false when
  // they could not be run. May come from another thread than the gathers'.
  virtual bool run_flags_now(std::span<const FlagOp> ops) = 0;
  // Waits for what this rank queued on its window off the program's streams (the first flags,
  // the bindings); false when it failed.
  virtual bool own_work_done() { return true; }
  // Frees the window, the peers' mappings and imports. `settled`: no peer reads the window any
  // more and this rank's own work on it has run (window_end.h); else the memory is left as it
  // is (freeing device memory would wait for the whole device, which a stuck peer holds) and
  // only forgotten: the process's end returns it.
  virtual void release(bool settled) = 0;
};

// For its life, the calling thread's own calls on `memory` are kept out of any CUDA graph a
// thread of the program is capturing (MemoryOps::relax_capture), and the thread's mode is given
// back at the end.
class OwnCalls {
 public:
  explicit OwnCalls(MemoryOps& memory) : memory_(memory), saved_(memory.relax_capture()) {}
  ~OwnCalls() { memory_.restore_capture(saved_); }
  OwnCalls(const OwnCalls&) = delete;
  OwnCalls& operator=(const OwnCalls&) = delete;

 private:
  MemoryOps& memory_;
  int saved_;
};

// Throws Error(Usage) unless 0 <= rank < nranks.
void check_rank(int rank, int nranks);

// The transport over `memory`. `fault`: what MAGI_INJECT_FAULT injects (protocol.h).
std::unique_ptr<Transport> make_window_transport(std::unique_ptr<MemoryOps> memory, int rank,
                                                 int nranks, uint64_t comm_identity,
                                                 const Options::Fault& fault);

}  // namespace magi::ce
