// libworkload.so: the test scenarios behind one entry point, so a program can link them
// normally (magi-workload) or dlopen them RTLD_LOCAL (magi-workload-local).
//   magi_workload_main(argc, argv): argv[0] is the scenario: ops | fsdp | split | initall | agree |
//   groupskew | weights.
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

#include "tests/support/workload/scenario.h"

namespace workload {

ScenarioOptions::ScenarioOptions(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i];
    if (name.rfind("--", 0) != 0) throw ScenarioFailure("unexpected argument " + name);
    if (i + 1 >= argc) throw ScenarioFailure("missing value after " + name);
    values_[name.substr(2)] = argv[++i];
  }
}

long ScenarioOptions::number(const std::string& name, long fallback) const {
  auto it = values_.find(name);
  if (it == values_.end()) return fallback;
  char* end = nullptr;
  long value = std::strtol(it->second.c_str(), &end, 10);
  if (end == it->second.c_str() || *end != '\0') {
    throw ScenarioFailure("--" + name + " " + it->second + " is not a number");
  }
  return value;
}

std::string ScenarioOptions::text(const std::string& name, const std::string& fallback) const {
  auto it = values_.find(name);
  return it == values_.end() ? fallback : it->second;
}

std::string format(const char* fmt, ...) {
  char text[1024];
  va_list args;
  va_start(args, fmt);
  int n = std::vsnprintf(text, sizeof text, fmt, args);
  va_end(args);
  return std::string(text, n < 0 ? 0 : static_cast<size_t>(n) < sizeof text ? n : sizeof text - 1);
}

void check(ncclResult_t result, const char* call) {
  if (result != ncclSuccess) {
    throw ScenarioFailure(format("%s returned %d (%s): %s", call, static_cast<int>(result),
                                 ncclGetErrorString(result), ncclGetLastError(nullptr)));
  }
}

}  // namespace workload

extern "C" __attribute__((visibility("default"))) int magi_workload_main(int argc, char** argv) {
  if (argc < 1) {
    std::fprintf(stderr,
                 "usage: SCENARIO [--option value]...  "
                 "(ops|fsdp|split|initall|agree|groupskew|weights|perf)\n");
    return 2;
  }
  const std::string scenario = argv[0];
  try {
    const workload::ScenarioOptions options(argc, argv);
    if (scenario == "ops") return workload::run_ops(options);
    if (scenario == "fsdp") return workload::run_fsdp(options);
    if (scenario == "split") return workload::run_split(options);
    if (scenario == "initall") return workload::run_initall(options);
    if (scenario == "agree") return workload::run_agree(options);
    if (scenario == "groupskew") return workload::run_groupskew(options);
    if (scenario == "weights") return workload::run_weights(options);
    if (scenario == "perf") return workload::run_perf(options);
    std::fprintf(stderr,
                 "unknown scenario %s (ops|fsdp|split|initall|agree|groupskew|weights|perf)\n",
                 scenario.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", scenario.c_str(), e.what());
    return 1;
  }
}
