// MAGI_INJECT_FAULT: lets tests make one rank's transport fail where a CUDA error could, to show
// that every rank then goes back to NCCL together.
#pragma once

#include "shim/shim.h"

namespace magi::ce {

inline bool fault_injected(Options::Fault::Where where, int rank) {
  const Options::Fault& fault = Options::get().inject_fault;
  return fault.where == where && fault.rank == rank;
}

inline void inject_fault(Options::Fault::Where where, int rank, const char* what) {
  if (fault_injected(where, rank))
    throw Error(ErrorKind::Cuda, std::string(what) + ": injected by MAGI_INJECT_FAULT");
}

}  // namespace magi::ce
