// Buffers in CUDA device memory. The stand-in stages device memory through host memory: for an
// operation whose buffers are device (or managed) memory it waits for the call's stream, copies
// the send data into host staging, runs the host protocol on the staging, and copies the result
// back to the device before the call returns. It is a reference, not a fast path, and it is not
// CUDA IPC: no rank ever maps another's device memory.
//
// CUDA is never started here: a pointer is asked about only when the program has already loaded
// the driver (libcuda.so.1 is in the process); otherwise every buffer is host memory.
#pragma once

#include <nccl.h>

#include <memory>

#include "tests/support/standin/operation.h"

namespace standin {

// True once libcuda.so.1 is in the process (dlopen RTLD_NOLOAD); never loads it.
bool cuda_driver_loaded();

// The program's current CUDA device when the driver is loaded; else `fallback`.
int current_cuda_device(int fallback);

// The operation for a collective (or a Send/Recv): the host one when every buffer the rank uses
// is host memory; otherwise the host one on staging, inside an operation that copies the device
// buffers in at launch and out when it completes. `sends`/`receives`: whether this rank uses its
// send/receive buffer (a broadcast's non-root sends nothing, say). Throws Failure when the
// stream is capturing a CUDA graph, which a synchronous stand-in cannot join.
std::unique_ptr<Operation> collective_on_any_memory(ncclComm* comm, const CollectiveArgs& args,
                                                    bool sends, bool receives, cudaStream_t stream);
std::unique_ptr<Operation> transfer_on_any_memory(ncclComm* comm, bool sending, void* buffer,
                                                  size_t count, ncclDataType_t dtype, int peer,
                                                  cudaStream_t stream);

}  // namespace standin
