// One record per communicator: what capture and the agreement know of it, found from an
// ncclComm_t with one lookup per call.
//
// Ownership. The registry holds each record by shared_ptr, and every call in flight holds its
// own reference for the length of the call, so ncclCommAbort from another thread (a watchdog,
// as NCCL allows while the main thread is blocked in a call) never frees a record under that
// call: its windows are released by whoever lets go last. Each thread caches a few recent
// lookups as weak references (a thread that stops calling must not keep windows alive); a
// generation counter, bumped at every join and leave, invalidates all the caches at once.
#pragma once

#include <nccl.h>

#include <memory>
#include <vector>

#include "capture/capture.h"
#include "rewrite/rewrite.h"

namespace magi::shim {

struct CommRecord {
  CommRecord(const capture::CommInfo& info, uint32_t max_step_calls,
             std::shared_ptr<rewrite::CommAgreement> agreed)
      : capture(info, max_step_calls), agreement(std::move(agreed)) {}

  capture::Communicator capture;
  // Null for a communicator created out of the shim's sight. Set once: the record's last holder
  // releases the agreement's windows.
  const std::shared_ptr<rewrite::CommAgreement> agreement;
};
using CommRef = std::shared_ptr<CommRecord>;

// The record of `comm`, or null if it was never seen.
CommRef find_comm(ncclComm_t comm);
// The record of `comm`; a communicator created before the shim could see it is registered then
// with a rank-local identity, so it is recorded but never agreed on.
CommRef comm_of(ncclComm_t comm);
// Registers a communicator that just joined, with its agreement (a handle NCCL reuses replaces
// the old record). Its Comm record is in the trace before any call can find it.
CommRef add_comm(ncclComm_t comm, const capture::CommInfo& info,
                 std::shared_ptr<rewrite::CommAgreement> agreement);
// Takes `comm` out of the registry (no lookup finds it after this) and hands its record over.
CommRef remove_comm(ncclComm_t comm);

// For the lifecycle (shim/lifecycle.cc) only.
namespace registry {
// Takes every record out of the registry, in no particular order.
std::vector<CommRef> take_all();
// In a child after fork(): the parent's records are set aside, reachable, never used.
void forget_in_child();
}  // namespace registry

}  // namespace magi::shim
