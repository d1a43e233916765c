// Byte arithmetic shared by every folder: units, rounding, NCCL element sizes.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <cstdint>

namespace magi {

inline constexpr size_t kKiB = size_t{1} << 10;
inline constexpr size_t kMiB = size_t{1} << 20;

// `n` rounded up to a multiple of `to` (to > 0).
constexpr size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Bytes of one element of an NCCL datatype (as recorded: the ncclDataType_t's value); 0 when
// the library does not know the type, which keeps such a call off every copy path.
constexpr size_t datatype_bytes(uint8_t dtype) {
  switch (static_cast<ncclDataType_t>(dtype)) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}

}  // namespace magi
