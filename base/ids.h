// How identities appear to a person: a communicator's 64-bit identity is shown as the 12 hex
// digits of its low 48 bits, in every log line (`comm %012llx` of short_id()) and in every output
// of magice-trace (short_id_text()), so an id copied from a log finds the same communicator there.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace magi {

inline constexpr int kShortIdDigits = 12;

constexpr unsigned long long short_id(uint64_t identity) { return identity & 0xffffffffffffull; }

// The shown id as text, exactly what `comm %012llx` of short_id() prints in a log line.
inline std::string short_id_text(uint64_t identity) {
  char text[kShortIdDigits + 1];
  std::snprintf(text, sizeof(text), "%012llx", short_id(identity));
  return text;
}

}  // namespace magi
