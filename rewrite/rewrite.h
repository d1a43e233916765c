// rewrite/: which calls leave NCCL, agreed with every rank. The face of the folder.
//
// The shim hands each recorded call here between capture::begin_call and forwarding. For every
// communicator, rewrite/ watches the step capture found, collects this rank's candidate gathers,
// runs agreement rounds through the real NCCL on that communicator (rewrite/agreement.h), and
// once every rank confirmed a plan, serves the agreed gathers through ce_transport/ instead of
// forwarding them. Everything else is forwarded unchanged.
//
// The one rule everything here keeps: the route of a call is a function of facts every rank
// shares — the agreed plan, and the call's position and shape in the step — so the ranks can never
// take different routes for one collective (rewrite/agreement.h says why that holds).
#pragma once

#include <nccl.h>

#include <memory>

#include "capture/capture.h"

namespace magi::rewrite {

// The real NCCL functions agreement rounds use, handed down by the shim (data flows shim ->
// capture -> rewrite -> ce_transport, never back).
struct RealNcclCalls {
  ncclResult_t (*all_gather)(const void* sendbuff, void* recvbuff, size_t sendcount,
                             ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*group_start)();
  ncclResult_t (*group_end)();
  // The inter-machine sub-communicators of plans spanning machines (rewrite/sub_comm.h); made,
  // used and ended only through these, never through our own entry points. Null where the real
  // NCCL lacks one: such a plan's set-up then fails alike on its ranks' confirm.
  ncclResult_t (*get_unique_id)(ncclUniqueId* id) = nullptr;
  ncclResult_t (*comm_init_rank_config)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                        ncclConfig_t* config) = nullptr;
  ncclResult_t (*comm_get_async_error)(ncclComm_t comm, ncclResult_t* error) = nullptr;
  ncclResult_t (*comm_destroy)(ncclComm_t comm) = nullptr;
  ncclResult_t (*comm_abort)(ncclComm_t comm) = nullptr;
};
void install(const RealNcclCalls& calls);

class CommAgreement;

// The agreement of a communicator that just joined, held in the shim's record of it. A call in
// flight holds it too, so an abort from another thread (a watchdog, as NCCL allows) never frees
// it under that call; the last holder releases its windows (its destructor never throws).
std::shared_ptr<CommAgreement> join(ncclComm_t comm, const capture::CommInfo& info);

// At ncclCommAbort or ncclCommRevoke, before the real one: this rank's waits on its peers give
// up now, since another thread may be blocked on one, as NCCL's abort stops its kernels.
void abandon(CommAgreement& agreement) noexcept;
// At ncclCommGetAsyncError, once NCCL itself reports no error: ours (ncclRemoteError when the
// ranks' static-weights reads were found to disagree), else ncclSuccess. Any thread.
ncclResult_t async_error(CommAgreement& agreement) noexcept;
// The communicator ends: the calling thread's open group forgets the gathers it queued for it.
void forget_queued(const CommAgreement& agreement) noexcept;
// In a child after fork(): the calling thread's queued gathers are the parent's; dropped.
void forget_in_child() noexcept;
// At process exit, once the communicators are released: waits for the set-ups of dropped plans
// still running (rewrite/set_up.h), so that no thread of ours outlives the CUDA runtime.
void finish_set_ups() noexcept;

struct Outcome {
  bool served = false;                // the call left NCCL: do not forward it
  ncclResult_t result = ncclSuccess;  // what the program gets when served
  // Served: queued in the open group as a moved gather (not a trial's NCCL call), served when
  // the group ends, and traced then (trace::GroupServedRecord).
  bool queued_to_move = false;
  // The communicator may still explore; once false, it stays false (its gathers' call sites are
  // no longer needed).
  bool watching = true;
};
// Whether a communicator that just joined may explore at all (one rank, say, never does).
bool watching(const CommAgreement& agreement) noexcept;

// For every recorded call of a communicator (`agreement` is null for one created out of sight).
// May first issue or read an agreement round on the communicator (one all-gather of its own
// through the real NCCL). Serves a moved call now or, inside a group, queues it for
// group_ended. The call counts as served (and is marked kCallMoved) only once it was served or
// queued; whatever is thrown before leaves it to NCCL. Marks kCallWouldMove in a dry run.
// Never throws.
Outcome intercept(const std::shared_ptr<CommAgreement>& agreement, const capture::CallArgs& args,
                  capture::CallRecord& record, const capture::StepView& view) noexcept;

// After the program's outermost ncclGroupEnd returned `nccl_result`: serves the moved gathers the
// group queued, as one bucket per communicator. Returns what the program gets.
ncclResult_t group_ended(ncclResult_t nccl_result) noexcept;
// ncclGroupSimulateEnd closed the group without running it: the queued gathers are dropped too.
void group_discarded() noexcept;

}  // namespace magi::rewrite
