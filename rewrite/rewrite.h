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
};
void install(const RealNcclCalls& calls);

class CommAgreement;

// What comm_left() leaves to release: the communicator's windows and round buffers, freed when
// this goes (or, if a call of that communicator is still in flight on another thread, when that
// call ends).
class Departure {
 public:
  Departure();
  Departure(Departure&&) noexcept;
  Departure& operator=(Departure&&) noexcept;
  ~Departure();

 private:
  friend Departure comm_left(ncclComm_t, bool);
  std::shared_ptr<CommAgreement> agreement_;
};

void comm_joined(ncclComm_t comm, const capture::CommInfo& info);
// At destroy, abort, finalize or revoke: forgets `comm` (called before the real destroy or abort,
// so a handle NCCL hands out again never meets its state). `aborting`: this rank's waits on its peers give up now, since another thread may be
// blocked on one, as NCCL's abort stops its kernels. The shim keeps the Departure across the
// real ncclCommAbort, so windows are released once NCCL's kernels on the communicator are gone.
[[nodiscard]] Departure comm_left(ncclComm_t comm, bool aborting = false);

struct Outcome {
  bool served = false;              // the call left NCCL: do not forward it
  ncclResult_t result = ncclSuccess;  // what the program gets when served
};

// For every recorded call. May first issue or read an agreement round on the communicator (one
// all-gather of its own through the real NCCL). Marks `record.flags` with kCallMoved or
// kCallWouldMove. Never throws.
Outcome intercept(ncclComm_t comm, const capture::CallArgs& args, capture::CallRecord& record,
                  const capture::StepView& view) noexcept;

// After the program's outermost ncclGroupEnd returned `nccl_result`: serves the moved gathers the
// group queued, as one bucket per communicator. Returns what the program gets.
ncclResult_t group_ended(ncclResult_t nccl_result) noexcept;
// ncclGroupSimulateEnd closed the group without running it: the queued gathers are dropped too.
void group_discarded() noexcept;

}  // namespace magi::rewrite
