// The backends behind make_transport and make_exchange. Private to ce_transport/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "ce_transport/ce_transport.h"

namespace magi::ce {

std::unique_ptr<Transport> make_host_transport(int rank, int nranks, uint64_t comm_identity);
std::unique_ptr<Transport> make_cuda_transport(int rank, int nranks, uint64_t comm_identity, int device);

std::unique_ptr<Exchange> make_host_exchange(size_t contribution_bytes, int nranks);
std::unique_ptr<Exchange> make_cuda_exchange(size_t contribution_bytes, int nranks, int device);

}  // namespace magi::ce
