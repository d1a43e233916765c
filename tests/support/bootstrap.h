// How a rank started by magi-launch finds its communicator: STANDIN_RANK, STANDIN_NRANKS and
// STANDIN_ID_FILE come from the launcher; rank 0 makes the unique id and publishes it in the
// file (written whole, then renamed into place), the others wait for the file to appear.
// Uses the NCCL API itself, so it works in front of the real NCCL as well as the stand-in.
#pragma once

#include <nccl.h>

namespace magi::support {

struct Bootstrap {
  int rank = 0;
  int nranks = 1;
  ncclUniqueId id{};
};

// Throws std::runtime_error naming the variable or file at fault; waits up to 60 s for the id.
Bootstrap bootstrap_from_env();

}  // namespace magi::support

// Test programs and tools use these unqualified.
using magi::support::Bootstrap;
using magi::support::bootstrap_from_env;
