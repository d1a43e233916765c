// The backends behind make_transport and make_exchange. Private to ce_transport/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "base/base.h"
#include "ce_transport/ce_transport.h"

namespace magi::ce {

// `fault`: what MAGI_INJECT_FAULT injects (protocol.h); tests give their own.
std::unique_ptr<Transport> make_host_transport(
    int rank, int nranks, uint64_t comm_identity,
    const Options::Fault& fault = Options::get().inject_fault);
std::unique_ptr<Transport> make_cuda_transport(
    int rank, int nranks, uint64_t comm_identity, int device,
    const Options::Fault& fault = Options::get().inject_fault);

std::unique_ptr<Exchange> make_host_exchange(size_t contribution_bytes, int nranks);
std::unique_ptr<Exchange> make_cuda_exchange(size_t contribution_bytes, int nranks, int device);

}  // namespace magi::ce
