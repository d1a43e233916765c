// How the trace format's enumerations are named (capture/trace_format.cc,
// base/agreement_records.cc).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace magi::trace {

// Traces come from other processes and may hold values this build does not know; those get a
// name that shows the number. Each such name is built once and kept, so every returned view
// stays valid for the life of the process, like the names of known values.
template <size_t N>
inline std::array<std::string, 256> names_with_fallback(
    const std::array<std::string_view, N>& known, uint8_t first, std::string_view fallback) {
  std::array<std::string, 256> names;
  for (size_t value = 0; value < names.size(); ++value) {
    const size_t index = value - first;
    names[value] = value >= first && index < N ? std::string(known[index])
                                               : std::string(fallback) + std::to_string(value);
  }
  return names;
}

}  // namespace magi::trace
