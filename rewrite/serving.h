// Serving an agreed plan's gathers: the transport of the plan, NCCL when every rank fell back,
// and the static bindings found changed.
#pragma once

#include <nccl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "rewrite/cost_trial.h"
#include "rewrite/observation.h"
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

class Serving {
 public:
  Serving(const AgreementWorld& world, const capture::CommInfo& info, ncclComm_t comm);
  ~Serving();
  Serving(const Serving&) = delete;
  Serving& operator=(const Serving&) = delete;

  // One bucket on the caller's stream (see CommAgreement::serve), timed by `trial` while it
  // runs. A transport error that the peers cannot learn of in this bucket is returned; the
  // communicator then refuses its gathers at its next propose (failed()).
  ncclResult_t serve(std::span<const ce::GatherOp> bucket, std::span<const NcclGather> calls,
                     cudaStream_t stream, uint16_t bucket_id, bool via_nccl, CostTrial& trial,
                     const SlotLayout& layout);
  // The gathers as NCCL takes them: one NCCL group when there are several.
  ncclResult_t forward_to_nccl(std::span<const NcclGather> calls, cudaStream_t stream);

  // A window for a new plan, replacing any other; fills `handle` for the peers. Throws Error.
  void open_window(const ce::WindowPlan& plan, ce::HandleBlob& handle);
  // Opens the peers' windows (indexed by rank). Throws Error.
  void attach(std::span<const ce::HandleBlob> handles) { transport_->attach(handles); }
  size_t window_bytes() const { return transport_ ? transport_->window_bytes() : 0; }
  void drop();
  // See CommAgreement::abandon.
  void abandon();

  // The transport failed since the window was opened: every gather is refused at the next
  // propose.
  bool failed() const { return failed_; }
  // Marks it failed for a reason outside the transport (one WARN, the first time).
  void fail(const char* why) noexcept;
  // Positions whose static binding was found changed; they stay until the step changes.
  const std::vector<uint32_t>& stale_positions() const { return stale_positions_; }
  void forget_stale() { stale_positions_.clear(); }

 private:
  const AgreementWorld& world_;
  const capture::CommInfo& info_;
  const ncclComm_t comm_;
  std::unique_ptr<ce::Transport> transport_;
  // Held where transport_ is replaced or dropped, and by abandon(), which may come from another
  // thread; the calling thread itself reads transport_ without it.
  std::mutex transport_mutex_;
  bool aborted_ = false;  // under transport_mutex_
  bool failed_ = false;
  std::vector<uint32_t> stale_positions_;
};

}  // namespace magi::rewrite
