// Starts N ranks of a program the way a multi-process NCCL job runs, on one machine:
// each rank gets STANDIN_RANK, STANDIN_NRANKS and STANDIN_ID_FILE (a fresh temporary directory
// per launch; see bootstrap.h), the extra variables of the spec, and the rest of the caller's
// environment. Each rank leads its own process group, so a timeout kills everything it started.
//
// Each launch also sets STANDIN_SHM_TAG (unless given) so the segments of a killed run can be
// found and removed: nothing is left in /dev/shm even then.
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace magi::support {

struct LaunchResult;

struct LaunchSpec {
  int nranks = 1;
  std::vector<std::string> argv;  // argv[0] is looked up in PATH unless it has a '/'
  std::vector<std::pair<std::string, std::string>> env;
  // Per rank (index = rank; fewer entries than ranks: the rest get none), applied after `env`.
  std::vector<std::vector<std::pair<std::string, std::string>>> rank_env;
  // <= 0: no limit. Scaled by TEST_TIMEOUT_SCALE (the sanitizer suites set it: their ranks run
  // several times slower) unless the test provokes the hang it waits for (hang_expected).
  double timeout_s = 60;
  bool hang_expected = false;
  // For a hang the test provokes: true once the ranks stand where the test wants them (polled
  // every 50 ms while they run, given the result so far: the ranks' pids, the tag, how the ranks
  // that ended ended, and with capture_output what each rank has written so far); they are
  // killed at once then. With it, a slow machine waits as long as it needs (timeout_s, scaled as
  // any limit, bounds the wait) and a fast one no longer. Without it, a provoked hang is killed
  // after exactly timeout_s.
  std::function<bool(const LaunchResult&)> hung;
  bool capture_output = false;  // else the ranks share the caller's stdout and stderr
};

struct RankResult {
  int pid = -1;
  int exit_code = -1;  // -1 when killed by a signal
  int signal = 0;
  std::string stdout_text, stderr_text;
};

struct LaunchResult {
  bool timed_out = false;  // killed: the limit passed, or `hung` held
  bool hung = false;       // killed because the spec's `hung` held
  std::vector<RankResult> ranks;
  double wall_s = 0;
  std::string shm_tag;  // the STANDIN_SHM_TAG the ranks ran with ("" if the caller chose one)
  bool all_ok() const;
  // One line: "4 ranks exited 0 in 0.31 s", "timed out after 5.0 s; killed ranks 0,1", …
  std::string summary() const;
};

// Throws std::runtime_error when it cannot start the ranks (fork, temporary directory).
LaunchResult launch(const LaunchSpec& spec);

// TEST_TIMEOUT_SCALE (the sanitizer suites set it: 3 under TSan, 2 under ASan): how much slower
// this build runs than the plain one; a positive number, anything else counts as 1.
double timeout_scale();

}  // namespace magi::support

// Tests and the launcher use these unqualified.
using magi::support::launch;
using magi::support::LaunchResult;
using magi::support::LaunchSpec;
using magi::support::RankResult;
