// How identities appear to a person: a communicator's 64-bit identity is shown as its low 48
// bits, `comm %012llx`, in every log line, the trace tool and the tests alike.
#pragma once

#include <cstdint>

namespace magi {

constexpr unsigned long long short_id(uint64_t identity) { return identity & 0xffffffffffffull; }

}  // namespace magi
