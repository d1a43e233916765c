// The backends behind ce_transport.h's factories, and the one place that picks between them
// (backends.cc): the generic transport (window_transport.cc) knows no backend, and a backend's
// files know no transport. Private to ce_transport/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "base/base.h"
#include "ce_transport/ce_transport.h"

namespace magi::ce {

class MemoryOps;

// Each kind of memory's operations (memory_ops.h). The CUDA one throws Error(System) when the
// program has not loaded the CUDA driver (we never start CUDA ourselves).
std::unique_ptr<MemoryOps> make_host_memory(int nranks);
std::unique_ptr<MemoryOps> make_cuda_memory(int rank, int nranks, uint64_t comm_identity,
                                            int device);

// The transport over each kind of memory. `fault`: what MAGI_INJECT_FAULT injects
// (protocol.h); tests give their own.
std::unique_ptr<Transport> make_host_transport(
    int rank, int nranks, uint64_t comm_identity,
    const Options::Fault& fault = Options::get().inject_fault);
std::unique_ptr<Transport> make_cuda_transport(
    int rank, int nranks, uint64_t comm_identity, int device,
    const Options::Fault& fault = Options::get().inject_fault);

std::unique_ptr<Exchange> make_host_exchange(size_t contribution_bytes, int nranks);
std::unique_ptr<Exchange> make_cuda_exchange(size_t contribution_bytes, int nranks, int device);

// Completion timers (timer.cc): the wall clock, CUDA events.
std::unique_ptr<CompletionTimer> make_wall_timer();
std::unique_ptr<CompletionTimer> make_event_timer();

// What the driver says of `ptr` (memory.cc); nothing known without a driver.
BufferIdentity identify_cuda_buffer(const void* ptr);
// XXH3 of the host name and the kernel's boot id (memory.cc).
uint64_t host_fingerprint();
// Bit d set when CUDA device `device` can reach device d's memory, its own included (memory.cc).
uint64_t peer_access_mask(int device);

}  // namespace magi::ce
