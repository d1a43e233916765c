// Serving an agreed plan's gathers: the transport of the plan, NCCL when every rank fell back,
// and the static bindings found changed.
#pragma once

#include <nccl.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "rewrite/cost_trial.h"
#include "rewrite/observation.h"
#include "rewrite/set_up.h"
#include "rewrite/sub_comm.h"
#include "rewrite/world.h"

namespace magi::rewrite {

// A moved gather as its NCCL call, kept to fall back on.
struct NcclGather {
  const void* sendbuf;
  void* recvbuf;
  size_t count;
  ncclDataType_t dtype;
};

// The window a plan needs on this rank. Bound (static weights): the send buffers of the last
// step, stable (same address and allocation) for the whole warmup, which is what made them
// candidates.
ce::WindowPlan window_plan(const Decision& decision, const StepObservation& seen,
                           const SlotLayout& layout, const Options& options);

// Static weights: where each bound position's shard lives now, by what this rank's own calls
// showed, so that a moved call finds the binding of the tensor it sends rather than of its
// position. A shard's home starts as the buffer it was bound from (the publish round's step).
//
// At a moved call at position p, this rank's send buffer (address and byte count) is looked up:
//  - p's home: p's binding, as agreed;
//  - the home of another bound position q of the same size: the call reads q's binding on every
//    peer (keyed by tensor, not position). Exact whenever every rank made the same change
//    (layers gathered in another order on every rank: each rank finds the same q); a check of the
//    buffer against q's binding is owed (once per buffer at p), since an allocator may have given
//    q's block to p's tensor while q's has not been sent from elsewhere yet (blocks reused in
//    another order than the layers'): a mismatch is reported on every rank (source_log.h);
//  - no home: p's shard lives here now (re-homed; under the promise, with p's bytes): this rank's
//    part is its current buffer, the peers' parts their bindings of p, and the buffer becomes p's
//    home. Its check against p's binding is owed to this call; a mismatch means its peers read
//    bytes this call does not send, and is reported on every rank. That includes a buffer that
//    was another position's home before that shard moved away: the program freed it and its
//    allocator gave it to p (every rank re-homing every layer, each new block the one the layer
//    before had), which keying on the buffer alone read as q's.
// What stays silent: a change made on ONE rank only that maps to another home (that rank alone
// swaps two layers), until the source logs are compared (source_log.h): each rank decides from its
// own buffers only; nothing at the call tells a reader what the peer's buffer is, and the routes
// must not depend on it (rewrite/agreement.h). Telling it would take a per-call exchange of buffer
// identities between ranks.
class BoundSources {
 public:
  // From the same facts window_plan() binds from. Allocates (plan time).
  void reset(const Decision& decision, const StepObservation& seen, const SlotLayout& layout);
  void clear();
  bool empty() const { return homes_.empty(); }
  // The slot offset of `position`'s binding (SIZE_MAX: the plan bound none there). Fixed at
  // reset(), whatever the cost round later sends back to NCCL: the homes follow those calls too.
  size_t slot_of(uint32_t position) const {
    return position < slots_.size() ? slots_[position] : SIZE_MAX;
  }

  struct Found {
    size_t slot_offset;
    bool verify_now;    // check the buffer against the binding read (slot_offset's) now
    bool other_source;  // read another position's binding (keyed by tensor)
  };
  // Hot path: a binary search, no allocation (a re-homed shard re-sorts the homes in place).
  // `slot_offset` is p's own. For a moved call: a check owed by an earlier observe() is due now.
  Found find(uint32_t position, uint64_t sendbuf, uint64_t bytes, size_t slot_offset);
  // The same for a call of the plan that NCCL serves (before its activation, or sent there by
  // the cost trial): the homes follow it, and a check it would owe waits for the position's next
  // moved call. So the homes see every call from the binding on, in call order, on every rank.
  void observe(uint32_t position, uint64_t sendbuf, uint64_t bytes, size_t slot_offset);
  // Some call since reset() sent another buffer than its position's binding. At the confirm:
  // a binding copied at the publish from a buffer the program had already vacated and reused
  // (its next call sends from the new home) holds another tensor, so such a plan is refused.
  bool changed() const { return changed_; }

 private:
  Found look_up(uint32_t position, uint64_t sendbuf, uint64_t bytes, size_t slot_offset);

  struct Home {
    uint64_t sendbuf;
    uint64_t bytes;
    size_t slot_offset;  // of the position bound to it
  };
  std::vector<Home> homes_;              // sorted by (sendbuf, bytes)
  std::vector<size_t> slots_;            // per position: its binding's slot offset
  std::vector<uint64_t> other_checked_;  // per position: the other position's home last checked
  std::vector<bool> owed_;               // per position: a check owed to its next moved call
  bool changed_ = false;
};

class Serving {
 public:
  Serving(const AgreementWorld& world, const capture::CommInfo& info, ncclComm_t comm);
  ~Serving();
  Serving(const Serving&) = delete;
  Serving& operator=(const Serving&) = delete;

  // One bucket on the caller's stream (see CommAgreement::serve), timed by `trial` while it
  // runs. A transport error that the peers cannot learn of in this bucket is returned; the
  // communicator then refuses its gathers at its next propose (failed()).
  // `moved`: whether the transport served the bucket (not NCCL, by trial or by fallback).
  // `captured`: its calls are captured into a CUDA graph (Transport::Timing::Captured, untimed).
  ncclResult_t serve(std::span<const ce::GatherOp> bucket, std::span<const NcclGather> calls,
                     cudaStream_t stream, uint16_t bucket_id, bool via_nccl, bool captured,
                     CostTrial& trial, const SlotLayout& layout, bool& moved);
  // The gathers as NCCL takes them: one NCCL group when there are several.
  ncclResult_t forward_to_nccl(std::span<const NcclGather> calls, cudaStream_t stream);

  // The machines the next plan spans (Decision::machines), before its window: one spanning
  // several is served in two levels (rewrite/machines.h): its window is this machine's, among its
  // ranks, and it forms an inter-machine sub-communicator in its set-up. Made here from the plan
  // (its layout, the step it was read on), so that its calls allocate nothing: where the
  // network is crossed once (Decision::network_once), where each moved gather's machines' shards
  // are held.
  void span_machines(const Decision& decision, const SlotLayout& layout,
                     const StepObservation& seen);
  bool two_levels() const { return machines_.spans(); }
  // A window for a new plan, replacing any other; fills `handle` for the peers. Throws Error.
  void open_window(const ce::WindowPlan& plan, ce::HandleBlob& handle);
  // Two levels, this rank the first member of its sub-communicator (machine 0): the id the
  // publish carries to the others, made once per plan; else empty. Throws Error.
  const std::vector<uint8_t>& sub_comm_id();
  // The same off the program's calls (set_up.h), after `delay`: poll_set_up() says when it is
  // done, and handle() then holds what open_window() fills. Throws Error when it cannot start.
  void begin_prepare(const ce::WindowPlan& plan, std::chrono::milliseconds delay);
  // The window's handle for the peers (open_window's, or a begin_prepare() set-up's once Done).
  const ce::HandleBlob& handle() const { return handle_; }
  // Zero-copy plans: the table the peers need (after open_window).
  const ce::SourceTable& sources() const { return transport_->sources(); }
  // Starts opening the peers' windows and exported allocations (indexed by rank) off the
  // program's calls (set_up.h), after `delay`; the transport is the set-up's until it ends.
  // Throws Error when it cannot start.
  // Two levels: `handles` are still by global rank (this machine's are taken), and the set-up
  // also forms the sub-communicator from its first member's id (`sub_comm_ids`, by rank).
  void begin_attach(std::span<const ce::HandleBlob> handles,
                    std::span<const ce::SourceTable> tables, std::chrono::milliseconds delay,
                    std::span<const std::vector<uint8_t>> sub_comm_ids = {});
  // The same, at once, on the calling thread (a set-up cheaper than kSetUpAtTheCallNs).
  void attach_now(std::span<const ce::HandleBlob> handles, std::span<const ce::SourceTable> tables);
  enum class SetUp : uint8_t { Running, Done, Failed };
  // Never waits. Done: the transport is back, attached; Failed: `error` says why (the transport
  // is back, unattached, for drop()). Done also once it was taken back earlier.
  SetUp poll_set_up(std::string& error);
  // How long the last set-up took where it ran (0 before the first).
  uint64_t set_up_ns() const { return set_up_ns_; }
  size_t window_bytes() const { return transport_ ? transport_->window_bytes() : 0; }
  ce::WindowMemory memory() const { return transport_ ? transport_->memory() : ce::WindowMemory{}; }
  void drop();
  // See CommAgreement::abandon.
  void abandon();

  // The transport failed since the window was opened: every gather is refused at the next
  // propose.
  bool failed() const { return failed_; }
  // Marks it failed for a reason outside the transport (one WARN, the first time).
  void fail(const char* why) noexcept;
  // The communicator's asynchronous error of ours: ncclRemoteError once the ranks' static
  // reads were found to disagree (ce_transport's take_disagreement), or a peer was found dead
  // with the communicator in use (lost_peer(), asked at most once a second), sticky; else
  // ncclSuccess. Polls the transport first. Any thread.
  ncclResult_t async_error();
  // Positions whose static binding was found changed; they stay until the step changes.
  const std::vector<uint32_t>& stale_positions() const { return stale_positions_; }
  void forget_stale() { stale_positions_.clear(); }

 private:
  // The transport of a plan: the whole communicator's, or for two levels this machine's.
  std::unique_ptr<ce::Transport> make_transport() const;
  // Two levels: the window plan of this machine's transport (each rank stages its machines'
  // shards of every gather, so the slots grow by the machine count).
  ce::WindowPlan machine_plan(const ce::WindowPlan& plan) const;
  // A bucket in two levels (two_levels()): NCCL between machines on the sub-communicator into
  // this rank's staging slot inside the transport's bucket (writer_), or, network once, into the
  // held region at a gather's first call; then this machine's transport. `nccl`: the first NCCL
  // error, if any.
  ce::Transport::Served gather_in_two_levels(std::span<const ce::GatherOp> bucket,
                                             std::span<const NcclGather> calls, cudaStream_t stream,
                                             ce::Transport::Timing timing, ncclResult_t& nccl);
  // The NCCL part of `gathers` (indices into `calls`), one group, on the sub-communicator: each
  // into `into(i)`. The first error, if any.
  template <class Into>
  ncclResult_t cross_machines(std::span<const size_t> gathers, std::span<const NcclGather> calls,
                              cudaStream_t stream, Into into);
  // The bucket's NCCL part between machines, written into this rank's staging slot by the
  // transport's call (ce::PartWriter): the gathers of writes_.
  struct InterMachine final : ce::PartWriter {
    explicit InterMachine(Serving& s) : serving(s) {}
    bool write_parts(std::span<const ce::GatherOp> bucket, uint8_t* slot, void* stream) override;
    Serving& serving;
    std::span<const NcclGather> calls;
    ncclResult_t nccl = ncclSuccess;
  };

  const AgreementWorld& world_;
  const capture::CommInfo& info_;
  const ncclComm_t comm_;
  std::unique_ptr<ce::Transport> transport_;
  // Two levels: the plan's machines, its sub-communicator (shared with the set-up that forms
  // it), the id this rank made for it, where each local rank's pieces land, and a bucket's ops
  // (reserved: the call allocates nothing).
  Machines machines_;
  std::shared_ptr<SubComm> sub_comm_;
  // Those that a captured bucket recorded into a CUDA graph: kept until the parent ends.
  std::vector<std::shared_ptr<SubComm>> graph_sub_comms_;
  std::vector<uint8_t> sub_comm_id_;
  std::vector<int32_t> places_;
  std::vector<ce::GatherOp> two_level_ops_;
  std::vector<size_t> crossing_;  // network once: a bucket's gathers crossing into held places
  std::vector<size_t> writes_;    // a bucket's gathers crossing into the slot (write_parts)
  InterMachine writer_{*this};
  size_t plan_gathers_ = 0;
  // Network once: every moved gather's place in the held region (its machines' shards), by bucket
  // and slot offset; whether they came (the first moved call of it, alike on every rank, since
  // routes are); its position, for a shard found changed.
  struct Held {
    uint16_t bucket;
    size_t slot_offset;
    size_t at;
    uint32_t position;
    bool came = false;
    bool failed = false;  // its NCCL part failed: never read from here (the call refuses)
  };
  bool network_once_ = false;
  std::vector<Held> held_;  // by (bucket, slot offset)
  size_t held_bytes_ = 0;
  Held* held_of(const ce::GatherOp& op);
  // What the two levels did with the plan, said when it ends.
  uint64_t two_level_calls_ = 0;
  uint64_t crossed_calls_ = 0;
  uint64_t crossed_bytes_ = 0;  // this rank's shards sent to the other machines (ring: M - 1 each)
  void say_two_levels() noexcept;
  // Network once: this rank's shard of `position` changed after the other machines took it;
  // said once a position.
  void shard_changed(uint32_t position);
  // The same, by where its pieces lie in the held region (ce::Transport::take_stale_bindings).
  void stale_held(size_t at);
  std::unique_ptr<SetUpJob> set_up_;  // while it runs, it holds the transport
  ce::HandleBlob handle_{};           // the window's, once prepared
  uint64_t set_up_ns_ = 0;
  // Held where transport_ or set_up_ is replaced or dropped, and by abandon(), which may come
  // from another thread; the calling thread itself reads transport_ without it.
  std::mutex transport_mutex_;
  bool aborted_ = false;  // under transport_mutex_
  bool failed_ = false;
  std::atomic<ncclResult_t> async_error_{ncclSuccess};
  // The ranks' reads disagree: WARN (once), the sticky error, NCCL at the next round.
  void disagreement(const std::string& what);
  // A peer died with the communicator in use: WARN (once), the sticky error.
  void peer_lost(const std::string& who);
  std::atomic<int64_t> next_peer_check_ns_{0};
  std::vector<uint32_t> stale_positions_;
};

}  // namespace magi::rewrite
