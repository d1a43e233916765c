// The library's clocks, read one way everywhere.
#pragma once

#include <time.h>

#include <cstdint>

namespace magi {

// Nanoseconds on `clock`. Trace times, durations and timeouts use CLOCK_MONOTONIC.
inline uint64_t clock_ns(clockid_t clock = CLOCK_MONOTONIC) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace magi
