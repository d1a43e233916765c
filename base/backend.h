// Which memory the moved gathers use: the one type for MAGI_BACKEND (base/options.h) and for
// the transport that serves it (ce_transport/ce_transport.h).
#pragma once

#include <cstdint>

namespace magi {

// Cuda: device memory, read by the copy engines. Host: host memory (the NCCL stand-in, machines
// without GPUs). The values travel in handle blobs and agreement rounds: never renumbered.
enum class Backend : uint8_t { Cuda = 0, Host = 1 };

}  // namespace magi
