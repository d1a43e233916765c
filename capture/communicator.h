// What capture knows of one communicator: who it is, how many calls it saw, and its step.
//
// The object lives inside the shim's one record per communicator (shim/communicators.h), which
// finds it from an ncclComm_t with one lookup per call; capture keeps no registry of its own.
#pragma once

#include <atomic>
#include <cstdint>

#include "base/spin_lock.h"
#include "capture/skeleton.h"
#include "capture/trace_format.h"

namespace magi::capture {

struct FlightRing;

struct CommInfo {
  uint64_t identity;         // equal on every rank of the communicator
  uint64_t parent_identity;  // Split/Shrink; else 0
  int rank;
  int nranks;
  int cuda_device;  // -1 when unknown
  trace::CommOrigin origin;
  bool nonblocking = false;  // made with config.blocking = 0 (its calls may return ncclInProgress)
};

struct Communicator {
  Communicator(const CommInfo& i, uint32_t max_step_calls) : info(i), steps(max_step_calls) {}
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  const CommInfo info;
  std::atomic<uint64_t> calls{0};        // next CallRecord::seq
  std::atomic<uint32_t> derivations{0};  // splits and shrinks of this communicator so far

  // NCCL requires the calls on one communicator to be serialised by the program, so this lock
  // is uncontended in a correct program; it only keeps a misbehaving one from corrupting state.
  SpinLock steps_lock;
  StepDetector steps;        // fed the shapes of collectives
  uint64_t collectives = 0;  // collectives fed to `steps` (guarded by steps_lock)

  FlightRing* flight = nullptr;  // MAGI_FLIGHT_RECORDER: set at the join, before any call
  // Whether an untraced all-gather's call site is wanted (rewrite/ keys gathers on it while the
  // communicator may explore). Cleared for good by stop_gather_callsites (capture/capture.h):
  // the unwinding is most of a watched gather's cost.
  std::atomic<bool> gather_callsites{true};
};

}  // namespace magi::capture
