// magi-launch -n N [--timeout S] [--env K=V]... -- PROGRAM ARGS...
// Runs N ranks of PROGRAM (see launch.h). Exits 0 when every rank exits 0, 124 on timeout
// (every rank killed), else 1; one summary line goes to stderr.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "tests/support/launch.h"

namespace {

int usage(const char* problem) {
  std::fprintf(
      stderr,
      "magi-launch: %s\n"
      "usage: magi-launch -n N [--timeout SECONDS] [--env KEY=VALUE]... -- PROGRAM ARGS...\n",
      problem);
  return 2;
}

bool parse_number(const char* text, double& out) {
  char* end = nullptr;
  out = std::strtod(text, &end);
  return end != text && *end == '\0';
}

}  // namespace

int main(int argc, char** argv) {
  LaunchSpec spec;
  spec.timeout_s = 0;
  int i = 1;
  for (; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (i + 1 >= argc) return usage(("missing value after " + arg).c_str());
    const char* value = argv[++i];
    double number = 0;
    if (arg == "-n") {
      if (!parse_number(value, number) || number < 1 || number != static_cast<int>(number)) {
        return usage("-n needs a positive whole number");
      }
      spec.nranks = static_cast<int>(number);
    } else if (arg == "--timeout") {
      if (!parse_number(value, number) || number < 0) return usage("--timeout needs seconds");
      spec.timeout_s = number;
    } else if (arg == "--env") {
      const char* eq = std::strchr(value, '=');
      if (eq == nullptr || eq == value) return usage("--env needs KEY=VALUE");
      spec.env.emplace_back(std::string(value, eq), std::string(eq + 1));
    } else {
      return usage(("unknown option " + arg).c_str());
    }
  }
  for (; i < argc; ++i) spec.argv.emplace_back(argv[i]);
  if (spec.argv.empty()) return usage("no program given");

  try {
    const LaunchResult result = launch(spec);
    std::fprintf(stderr, "magi-launch: %s: %s\n", spec.argv[0].c_str(), result.summary().c_str());
    if (result.timed_out) return 124;
    return result.all_ok() ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "magi-launch: %s\n", e.what());
    return 1;
  }
}
