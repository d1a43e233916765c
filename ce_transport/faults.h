// MAGI_INJECT_FAULT: lets tests make one rank's transport fail where a CUDA error could, to show
// that every rank then goes back to NCCL together; or make it slow, to show that the cost trial
// then keeps NCCL on every rank.
#pragma once

#include <chrono>
#include <thread>

#include "base/base.h"

namespace magi::ce {

inline bool fault_injected(Options::Fault::Where where, int rank) {
  const Options::Fault& fault = Options::get().inject_fault;
  return fault.where == where && fault.rank == rank;
}

inline void inject_fault(Options::Fault::Where where, int rank, const char* what) {
  if (fault_injected(where, rank))
    throw Error(ErrorKind::Cuda, std::string(what) + ": injected by MAGI_INJECT_FAULT");
}

// slow:RANK: the bucket's start is 20 ms late (a timed bucket counts it: the host waits before
// queuing anything, and the stream's clock runs meanwhile).
inline void inject_delay(int rank) {
  if (fault_injected(Options::Fault::Where::Slow, rank)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

}  // namespace magi::ce
