#include "tests/support/forked_ranks.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <thread>

namespace support {

ForkedRun run_forked_ranks(int nranks, double timeout_s, const std::function<int(int rank)>& body,
                           int reap_last) {
  ForkedRun run;
  run.ranks.resize(static_cast<size_t>(nranks));
  std::fflush(nullptr);
  for (int r = 0; r < nranks; ++r) {
    const pid_t pid = fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      int status = 3;
      try {
        status = body(r);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d: %s\n", r, e.what());
        status = 2;
      }
      std::fflush(nullptr);
      _exit(status);
    }
    run.ranks[static_cast<size_t>(r)].pid = pid;
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  std::vector<bool> reaped(static_cast<size_t>(nranks), false);
  int left = nranks;
  while (left > 0) {
    for (int r = 0; r < nranks; ++r) {
      if (reaped[static_cast<size_t>(r)] || (r == reap_last && left > 1)) continue;
      ForkedRank& rank = run.ranks[static_cast<size_t>(r)];
      int status = 0;
      if (waitpid(rank.pid, &status, WNOHANG) != rank.pid) continue;
      if (WIFEXITED(status)) rank.exit_code = WEXITSTATUS(status);
      if (WIFSIGNALED(status)) rank.signal = WTERMSIG(status);
      reaped[static_cast<size_t>(r)] = true;
      --left;
    }
    if (left == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      run.timed_out = true;
      for (int r = 0; r < nranks; ++r)
        if (!reaped[static_cast<size_t>(r)]) kill(run.ranks[static_cast<size_t>(r)].pid, SIGKILL);
      for (int r = 0; r < nranks; ++r)
        if (!reaped[static_cast<size_t>(r)])
          waitpid(run.ranks[static_cast<size_t>(r)].pid, nullptr, 0);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return run;
}

}  // namespace support
