// Per-communicator state and the registry that finds it from an ncclComm_t on the call path.
#pragma once

#include <nccl.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "capture/capture.h"
#include "capture/skeleton.h"

namespace magi::capture {

struct Communicator {
  Communicator(ncclComm_t h, const CommInfo& i, uint32_t max_step_calls)
      : handle(h), info(i), steps(max_step_calls) {}

  const ncclComm_t handle;
  const CommInfo info;
  std::atomic<uint64_t> calls{0};        // next CallRecord::seq
  std::atomic<uint32_t> derivations{0};  // splits and shrinks of this communicator so far

  // NCCL requires the calls on one communicator to be serialised by the program, so this lock
  // is uncontended in a correct program; it only keeps a misbehaving one from corrupting state.
  std::atomic_flag steps_lock = ATOMIC_FLAG_INIT;
  StepDetector steps;       // fed the shapes of collectives
  uint64_t collectives = 0; // collectives fed to `steps` (guarded by steps_lock)
};

// The state of `comm`; registers an unknown communicator (one created before the shim could see
// it) with a rank-local identity, so it is recorded but never agreed on.
Communicator& communicator_of(ncclComm_t comm);
Communicator* find_communicator(ncclComm_t comm);
Communicator& register_communicator(ncclComm_t comm, const CommInfo& info);
void unregister_communicator(ncclComm_t comm);

// In a child after fork(): the parent's communicators are not usable here (NCCL does not survive
// fork), so the child starts with none. Their state is leaked, not freed: it is the parent's.
void forget_communicators_in_child();

// Calls `visit` for every live communicator, under the registry's lock (off the call path only).
template <class Visit>
void for_each_communicator(Visit&& visit);

namespace registry_detail {
std::mutex& mutex();
std::unordered_map<ncclComm_t, std::unique_ptr<Communicator>>& map();
}  // namespace registry_detail

template <class Visit>
void for_each_communicator(Visit&& visit) {
  std::lock_guard<std::mutex> lk(registry_detail::mutex());
  for (auto& [handle, state] : registry_detail::map()) visit(*state);
}

}  // namespace magi::capture
