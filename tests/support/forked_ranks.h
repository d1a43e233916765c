// Ranks as forked children of the test process, for tests of memory shared between processes
// (the host transport, the round board): each runs a body and exits with its return value.
#pragma once

#include <sys/types.h>

#include <functional>
#include <vector>

namespace support {

struct ForkedRank {
  pid_t pid = 0;
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
};
struct ForkedRun {
  bool timed_out = false;
  std::vector<ForkedRank> ranks;
};

// Forks `nranks` children running `body(rank)`; its return value is the exit status (2 when it
// throws, said on stderr). The rank `reap_last` (if >= 0) is reaped only after every other rank
// has exited, so while the others run it stays a zombie once dead, as a child whose parent is
// busy elsewhere would. Past `timeout_s` the ranks still running are killed (timed_out).
ForkedRun run_forked_ranks(int nranks, double timeout_s, const std::function<int(int rank)>& body,
                           int reap_last = -1);

}  // namespace support
