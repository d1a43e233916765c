// Buffers in CUDA device memory. The stand-in stages device memory through host memory: for an
// operation whose buffers are device (or managed) memory it waits for the call's stream, copies
// the send data into host staging, runs the host protocol on the staging, and copies the result
// back to the device before the call returns. It is a reference, not a fast path, and it is not
// CUDA IPC: no rank ever maps another's device memory.
//
// On a stream capturing a CUDA graph (torch.cuda.graph, torch.compile's reduce-overhead mode,
// nccl-tests -G) nothing runs at the call: the operation is recorded into the graph as a copy of
// the send data into pinned staging, a host node that runs the host protocol with the peers
// when a replay reaches it, and a copy of the result back. It takes its place in the
// communicator's order at each replay, not at the capture, as NCCL's captured kernels do. The
// staging lives as long as the graph (a CUDA user object gives its blocks back to the pool).
//
// CUDA is never started here: a pointer is asked about only when the program has already loaded
// the driver (libcuda.so.1 is in the process); otherwise every buffer is host memory.
#pragma once

#include <nccl.h>

#include <memory>
#include <vector>

#include "tests/support/standin/operation.h"

namespace standin {

// True once libcuda.so.1 is in the process (dlopen RTLD_NOLOAD); never loads it.
bool cuda_driver_loaded();

// The program's current CUDA device when the driver is loaded; else `fallback`.
int current_cuda_device(int fallback);

// The operation for a collective (or a Send/Recv): the host one when every buffer the rank uses
// is host memory; otherwise the host one on staging, inside an operation that copies the device
// buffers in at launch and out when it completes. `sends`/`receives`: whether this rank uses its
// send/receive buffer (a broadcast's non-root sends nothing, say). On a capturing stream, an
// operation that is_captured and its group records (record_captured) instead of running.
std::unique_ptr<Operation> collective_on_any_memory(ncclComm* comm, const CollectiveArgs& args,
                                                    bool sends, bool receives, cudaStream_t stream);
std::unique_ptr<Operation> transfer_on_any_memory(ncclComm* comm, bool sending, void* buffer,
                                                  size_t count, ncclDataType_t dtype, int peer,
                                                  cudaStream_t stream);

// Whether `op` was made on a stream capturing a CUDA graph.
bool is_captured(const Operation& op);

// Records the captured operations of one group (in call order) into their streams' graphs: on
// each stream, the copies of their send data from the device, one host node that runs them all
// with the peers at every replay, and the copies of their results to the device. A group's
// operations on several streams get a host node each. Throws Failure.
void record_captured(std::vector<std::unique_ptr<Operation>> ops);

}  // namespace standin
