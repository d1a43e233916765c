// Agreement for one communicator: the rounds, the plan, and the route of each collective.
//
// When rounds happen. Only at the anchor, one position of the communicator's step (as capture's
// step detector reports it; 0 when the step is found), counted in steps since the step was found.
// The detector sees only shapes (op, type, count, root, reduction), which every rank of a correct
// NCCL program issues alike, so every rank finds, loses and positions the step at the same call,
// and so issues each round at the same place in the communicator's call sequence: our all-gather
// never meets a different call of another rank.
//
//   W = MAGI_WARMUP_STEPS complete steps observed:  issue propose at the anchor
//   next step:   read propose -> decision (the ladder, rewrite/contribution.h); issue publish
//                with this rank's window handle if something moves
//   next step:   read publish -> open peers' windows; issue confirm (opened, or not)
//   next step:   read confirm -> every rank opened every window: routes change here
// and a new propose every MAGI_REAGREE_STEPS steps after. A round is read one step after it was
// issued: the host waits there only if the round is somehow still in flight.
//
// Why a round never hangs. A round's all-gather is issued before the anchor call, on every rank,
// and is launched at once unless the program has a group open; in that case this rank votes "no"
// (kIssuedInGroup) and, knowing the answer without reading, never waits on it: the others read
// its vote and reach the same answer (decide() puts that vote before everything else). So a rank
// only ever waits for an all-gather every rank has launched. After such a void round every rank
// moves the anchor one position on, and the next propose comes one step later, until a position
// outside the program's groups is found.
//
// Why routes never split. The route of a call is a function of the agreed plan (equal on every
// rank, read from the same bytes) and the call's step position and step digest (shapes alone).
//  - A call that deviates in a shared fact (count, type, order) changes the shape sequence: the
//    detector loses the step at that very call on every rank, the plan is dropped there, and that
//    call and all after it go to NCCL until a new agreement.
//  - A rank-local change (a new send buffer, another call site) changes no route. It cannot break
//    bytes either: the default transport copies the send buffer on every call, so it reads
//    whatever buffer the call names. The change shows in the next propose round, where it makes
//    the gather "not stable" on that rank, which the AND spreads to every rank.
//  - A transport failure on one rank returns an error for that call and makes that rank refuse
//    every gather in the next propose, so routes go back to NCCL everywhere at one call.
// Assumed, and checked at each propose: the ranks group their calls (ncclGroupStart/End) the
// same way; a difference aborts the agreement (buckets and window slots follow the groups).
// Assumed, not checkable: a call captured into a CUDA graph on one rank is captured on all (it
// stays on NCCL, since a replay would repeat the handshake's sequence numbers).
#pragma once

#include <nccl.h>

#include <memory>
#include <mutex>
#include <vector>

#include "capture/capture.h"
#include "ce_transport/ce_transport.h"
#include "rewrite/contribution.h"
#include "rewrite/observation.h"
#include "rewrite/rewrite.h"

namespace magi::rewrite {

// A moved gather as its NCCL call, kept to fall back on.
struct NcclGather {
  const void* sendbuf;
  void* recvbuf;
  size_t count;
  ncclDataType_t dtype;
};

struct Route {
  // TrialNccl: a moved gather sent to NCCL on purpose, and timed, during the cost trial.
  enum class Kind : uint8_t { Nccl, Move, WouldMove, TrialNccl };
  Kind kind = Kind::Nccl;
  size_t slot_offset = 0;
  // Bucket of the plan. Usually one per ncclGroupStart/End; a group that straddles the step's
  // boundary is two buckets (each packed from offset 0), served one after the other.
  uint16_t bucket = 0;
};

// What the early launches of the program's open group (CommAgreement::issue) left for that
// group's end: the first error they met, which the program gets from rewrite::group_ended, and
// how many of the group's calls they launched, which ncclGroupSimulateEnd reports. Per thread,
// as NCCL's groups are.
struct EarlyLaunches {
  ncclResult_t error = ncclSuccess;
  uint32_t calls = 0;
};
EarlyLaunches& early_launches();

class CommAgreement {
 public:
  CommAgreement(ncclComm_t comm, const capture::CommInfo& info, const RealNcclCalls& nccl);
  ~CommAgreement();
  CommAgreement(const CommAgreement&) = delete;
  CommAgreement& operator=(const CommAgreement&) = delete;

  // For each collective of the communicator, before it is forwarded.
  Route on_collective(const capture::CallArgs& args, capture::CallRecord& record,
                      const capture::StepView& view);

  // Serves moved gathers (one bucket) on the caller's stream. Returns what the program gets.
  // `calls` are the same gathers as NCCL would take them, for a bucket every rank falls back on.
  // `via_nccl`: a trial bucket, served by NCCL and timed.
  ncclResult_t serve(std::span<const ce::GatherOp> bucket, std::span<const NcclGather> calls,
                     cudaStream_t stream, uint16_t bucket_id, bool via_nccl);

  uint64_t identity() const { return info_.identity; }

  // The communicator is being aborted, maybe from another thread while a call of this one is
  // blocked: the transport stops waiting on peers now, and no window is made after this.
  void abandon();

 private:
  struct Round {
    RoundKind kind;
    uint32_t number;
    std::unique_ptr<ce::Exchange> exchange;
    bool voted_no = false;        // issued inside an open group: this rank said no
    uint64_t decision_hash = 0;   // publish/confirm
  };

  ncclResult_t forward_to_nccl(std::span<const NcclGather> calls, cudaStream_t stream);
  void on_lost(uint64_t seq);
  void at_anchor(const capture::StepView& view);
  void read_round(const capture::StepView& view);
  void issue(RoundKind kind, Contribution& contribution, uint64_t seq);
  Contribution header_for(RoundKind kind) const;
  void propose(uint64_t seq);
  void after_propose(const Decision& decision, uint64_t seq);
  void publish(uint64_t seq);
  void activate(uint64_t seq);
  void issue_cost(uint64_t seq);
  void after_cost(std::span<const uint8_t> all, uint64_t seq);
  void collect_timings();
  void deactivate(uint64_t seq, Reason why);
  void drop_transport();
  void retire(std::unique_ptr<ce::Exchange> exchange);
  void record_round(RoundKind kind, trace::RoundEvent event, uint64_t seq, AgreementMode mode,
                    Reason reason, uint32_t moved) const;
  void record_decision(const Decision& decision) const;

  const ncclComm_t comm_;
  const capture::CommInfo info_;
  const RealNcclCalls nccl_;
  const Options& options_;
  const ce::Backend backend_;
  bool agreeable_ = true;
  bool told_point_to_point_group_ = false;  // the warning of CommAgreement::issue, once

  StepObservation seen_;
  uint64_t step_digest_ = 0;     // of the step being observed
  uint64_t steps_ = 0;           // anchors passed since the step was found
  uint32_t anchor_ = 0;          // step position where rounds are issued and read
  uint64_t next_propose_ = 0;    // value of steps_ at which to propose
  uint32_t rounds_ = 0;
  std::unique_ptr<Round> pending_;
  std::vector<std::unique_ptr<ce::Exchange>> retired_;  // rounds whose result nobody needs
  std::unique_ptr<ce::Exchange> spare_;                 // a read round's buffers, for the next

  // The decision of the last propose, and what serving it needs.
  Decision decision_;
  uint32_t decision_round_ = 0;
  SlotLayout layout_;
  std::unique_ptr<ce::Transport> transport_;
  // Held where transport_ is replaced or dropped, and by abandon(), which may come from another
  // thread; the calling thread itself reads transport_ without it.
  std::mutex transport_mutex_;
  bool aborted_ = false;  // under transport_mutex_
  bool transport_failed_ = false;
  std::vector<uint32_t> stale_positions_;  // static bindings found changed, until the step changes

  // The cost trial (unless MAGI_CE_FORCE=1): for 2 × MAGI_WARMUP_STEPS steps after activation,
  // the moved buckets alternate, step by step, between the transport and NCCL, each timed to
  // completion; then a cost round keeps, per bucket, the route that was faster on the slowest
  // rank. Which steps go where is a function of the anchor count: shared by every rank.
  bool trial_ = false;
  uint64_t trial_start_ = 0;  // steps_ at activation
  uint64_t trial_end_ = 0;
  struct Timing {
    uint16_t bucket;
    bool via_nccl;
    std::unique_ptr<ce::CompletionTimer> timer;
  };
  std::vector<Timing> timings_;                    // waiting to be read
  std::vector<std::vector<uint64_t>> moved_ns_;    // by bucket
  std::vector<std::vector<uint64_t>> nccl_ns_;
  uint64_t nccl_faster_hash_ = 0;  // a plan whose cost round kept no bucket: not tried again

  // The active plan: routes follow it while the step digest is this one.
  bool active_ = false;
  bool active_dry_ = false;
  uint64_t active_digest_ = 0;
  uint64_t active_hash_ = 0;
};

}  // namespace magi::rewrite
