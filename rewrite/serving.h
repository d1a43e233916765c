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

// Static weights: where each bound position's shard was copied from at the publish round, so
// that a moved call finds the binding of the buffer it names rather than of its position.
//
// At a moved call at position p, this rank's send buffer (address and byte count) is looked up:
//  - p's own source: p's binding, as agreed;
//  - the source of another bound position q of the same size: the call reads q's binding on
//    every peer (keyed by tensor, not position). Exact whenever every rank made the same change
//    (layers gathered in another order on every rank: each rank finds the same q);
//  - no source: this rank's part is its current buffer, the peers' parts their bindings of p,
//    under the promise that the new buffer holds p's bytes; a check of it against p's binding is
//    owed to this call (once per new buffer), and a mismatch is the stale path (WARN, NCCL at the
//    next round).
// What stays silent: a change made on ONE rank only that maps to another binding (that rank alone
// swaps two layers, or re-homes a shard into a buffer bound for another position of the same
// size). Each rank decides from its own buffers only; nothing at the call tells a reader what the
// peer's buffer is, and the routes must not depend on it (rewrite/agreement.h), so that rank
// reads q everywhere while its peers read p: wrong bytes on every rank until the next round, whose
// propose sees the changed buffers (NotStable) and takes those gathers back to NCCL. Telling it
// would take a per-call exchange of buffer identities between ranks. A one-rank re-home to a
// buffer bound for nothing, by contrast, is checked (the third case).
class BoundSources {
 public:
  // From the same facts window_plan() binds from. Allocates (plan time).
  void reset(const Decision& decision, const StepObservation& seen, const SlotLayout& layout);
  void clear();
  bool empty() const { return by_buffer_.empty(); }

  struct Found {
    size_t slot_offset;
    bool verify_now;    // no binding holds this buffer: check it against p's binding now
    bool other_source;  // read another position's binding (keyed by tensor)
  };
  // Hot path: a binary search, no allocation. `slot_offset` is p's own.
  Found find(uint32_t position, uint64_t sendbuf, uint64_t bytes, size_t slot_offset);

 private:
  struct Source {
    uint64_t sendbuf;
    uint64_t bytes;
    size_t slot_offset;
  };
  std::vector<Source> by_buffer_;        // sorted by (sendbuf, bytes)
  std::vector<uint64_t> checked_since_;  // per position: the unbound buffer last checked
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
  ncclResult_t serve(std::span<const ce::GatherOp> bucket, std::span<const NcclGather> calls,
                     cudaStream_t stream, uint16_t bucket_id, bool via_nccl, CostTrial& trial,
                     const SlotLayout& layout, bool& moved);
  // The gathers as NCCL takes them: one NCCL group when there are several.
  ncclResult_t forward_to_nccl(std::span<const NcclGather> calls, cudaStream_t stream);

  // A window for a new plan, replacing any other; fills `handle` for the peers. Throws Error.
  void open_window(const ce::WindowPlan& plan, ce::HandleBlob& handle);
  // Zero-copy plans: the table the peers need (after open_window).
  const ce::SourceTable& sources() const { return transport_->sources(); }
  // Starts opening the peers' windows and exported allocations (indexed by rank) off the
  // program's calls (set_up.h), after `delay`; the transport is the set-up's until it ends.
  // Throws Error when it cannot start.
  void begin_attach(std::span<const ce::HandleBlob> handles,
                    std::span<const ce::SourceTable> tables, std::chrono::milliseconds delay);
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
  // reads were found to disagree (ce_transport's take_disagreement), sticky; else ncclSuccess.
  // Polls the transport first. Any thread.
  ncclResult_t async_error();
  // Positions whose static binding was found changed; they stay until the step changes.
  const std::vector<uint32_t>& stale_positions() const { return stale_positions_; }
  void forget_stale() { stale_positions_.clear(); }

 private:
  const AgreementWorld& world_;
  const capture::CommInfo& info_;
  const ncclComm_t comm_;
  std::unique_ptr<ce::Transport> transport_;
  std::unique_ptr<SetUpJob> set_up_;  // while it runs, it holds the transport
  uint64_t set_up_ns_ = 0;
  // Held where transport_ or set_up_ is replaced or dropped, and by abandon(), which may come
  // from another thread; the calling thread itself reads transport_ without it.
  std::mutex transport_mutex_;
  bool aborted_ = false;  // under transport_mutex_
  bool failed_ = false;
  std::atomic<ncclResult_t> async_error_{ncclSuccess};
  // The ranks' reads disagree: WARN (once), the sticky error, NCCL at the next round.
  void disagreement(const std::string& what);
  std::vector<uint32_t> stale_positions_;
};

}  // namespace magi::rewrite
