// magice-trace skeleton: the repeating step of each communicator, found offline by the same
// StepDetector the library runs, so the answer matches what the runtime saw.
#include "capture/skeleton.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <string>
#include <vector>

#include "base/options.h"
#include "tools/magice-trace/cli.h"
#include "tools/magice-trace/describe.h"
#include "tools/magice-trace/members.h"
#include "tools/magice-trace/verbs.h"

namespace magi::tool {
namespace {

constexpr std::string_view kUsage =
    "usage: magice-trace skeleton [--max-step N] [--calls N] FILE...\n"
    "  For each communicator in each file: the calls before, between and after runs of a\n"
    "  repeating step, and each step's collectives (Send/Recv are not part of steps). Runs are\n"
    "  placed by collective index, collective #N as the logs number them.\n"
    "  --max-step N  longest step looked for, in collectives (default: MAGI_MAX_STEP_CALLS's)\n"
    "  --calls N     list at most N calls of each step (default 32; 0 lists all)\n";

struct SkeletonOptions {
  uint32_t max_step_calls = 0;
  uint64_t listed_calls = 32;
  std::vector<std::string> files;
};

// One run of repeating steps, in collective indices.
struct StepRun {
  uint64_t origin = 0;
  uint32_t period = 0;
  uint64_t repeats = 0;
  uint64_t digest = 0;
  uint64_t end() const { return origin + repeats * period; }
  uint64_t last() const { return end() == 0 ? 0 : end() - 1; }
};

// A communicator that keeps losing its step would otherwise fill the screen.
constexpr size_t kRunsShown = 8;

std::vector<StepRun> find_runs(const Member& member, uint32_t max_step_calls) {
  std::vector<StepRun> runs;
  capture::StepDetector detector(max_step_calls);
  for (const trace::CallRecord* call : member.collectives) {
    switch (detector.push(call->shape)) {
      case capture::StepDetector::Event::Found:
        runs.push_back(
            {detector.origin(), detector.period(), detector.repeats(), detector.digest()});
        break;
      case capture::StepDetector::Event::Lost:
        if (!runs.empty()) runs.back().repeats = detector.repeats();
        break;
      case capture::StepDetector::Event::None: break;
    }
  }
  if (detector.found() && !runs.empty()) runs.back().repeats = detector.repeats();
  return runs;
}

std::string calls_text(uint64_t n) { return std::to_string(n) + (n == 1 ? " call" : " calls"); }

std::string summary(const std::vector<StepRun>& runs, uint64_t collectives) {
  if (collectives == 0) return "no collectives";
  if (runs.empty()) return calls_text(collectives) + ", no repeating step";
  std::string text;
  uint64_t cursor = 0;
  auto add = [&](const std::string& part) { text += (text.empty() ? "" : "; ") + part; };
  for (size_t i = 0; i < runs.size(); ++i) {
    const StepRun& run = runs[i];
    if (i == kRunsShown) {
      add("… " + std::to_string(runs.size() - i) + " more runs of steps");
      cursor = std::max(cursor, runs.back().end());
      break;
    }
    if (run.origin > cursor) {
      add((cursor == 0 ? "prologue " : "then ") + calls_text(run.origin - cursor));
    }
    char line[160];
    std::snprintf(line, sizeof(line),
                  "step of %s × %" PRIu64 " repeats (collectives #%" PRIu64 "–#%" PRIu64
                  "), digest %s",
                  calls_text(run.period).c_str(), run.repeats, run.origin, run.last(),
                  hex16(run.digest).c_str());
    add(line);
    cursor = std::max(cursor, run.end());
  }
  if (collectives > cursor) add("epilogue " + calls_text(collectives - cursor));
  return text;
}

void print_step_calls(const trace::Trace& trace, const Member& member, const StepRun& run,
                      uint64_t listed_calls) {
  const uint64_t available =
      member.collectives.size() - std::min<uint64_t>(run.origin, member.collectives.size());
  const uint64_t shown_max = std::min<uint64_t>(run.period, available);
  const uint64_t shown = listed_calls == 0 ? shown_max : std::min(shown_max, listed_calls);
  for (uint64_t i = 0; i < shown; ++i) {
    const trace::CallRecord& call = *member.collectives[run.origin + i];
    const std::string frame = top_frame_text(trace, call.callsite);
    std::printf("    %s callsite %-8s%s%s\n", shape_text(call).c_str(),
                callsite_label(call.callsite).c_str(), frame.empty() ? "" : "  ", frame.c_str());
  }
  if (shown < run.period) std::printf("    … %s more\n", calls_text(run.period - shown).c_str());
}

void print_runtime_steps(const trace::Trace& trace, uint64_t comm_id) {
  size_t shown = 0, total = 0;
  for (const trace::StepRecord& s : trace.steps) {
    if (s.comm_id != comm_id) continue;
    if (++total > 2 * kRunsShown) continue;
    ++shown;
    if (s.event == static_cast<uint8_t>(trace::StepEvent::Found)) {
      std::printf("  runtime: found at collective #%" PRIu64
                  ": step of %s from collective #%" PRIu64 ", digest %s\n",
                  s.seq, calls_text(s.period).c_str(), s.origin, hex16(s.digest).c_str());
    } else if (s.event == static_cast<uint8_t>(trace::StepEvent::Lost)) {
      std::printf("  runtime: lost at collective #%" PRIu64 " after %" PRIu64
                  " repeats of %s from collective #%" PRIu64 "\n",
                  s.seq, s.repeats, calls_text(s.period).c_str(), s.origin);
    }
  }
  if (total > shown) std::printf("  runtime: … %zu more step events\n", total - shown);
}

void print_skeleton(const trace::Trace& trace, const SkeletonOptions& options) {
  std::printf("%s (%s:%" PRIu64 " %s)\n", trace.path.c_str(), trace.header.host, trace.header.pid,
              trace.header.program);
  for (const Member& member : members_of(trace)) {
    const std::vector<StepRun> runs = find_runs(member, options.max_step_calls);
    const std::string rank = member.rank < 0 ? "?" : std::to_string(member.rank);
    const std::string nranks = member.nranks < 0 ? "?" : std::to_string(member.nranks);
    std::printf("comm %s rank %s/%s: %s\n", short_id_text(member.comm_id).c_str(), rank.c_str(),
                nranks.c_str(), summary(runs, member.collectives.size()).c_str());
    for (size_t i = 0; i < std::min(runs.size(), kRunsShown); ++i) {
      const StepRun& run = runs[i];
      if (runs.size() > 1) {
        std::printf("  step at collectives #%" PRIu64 "–#%" PRIu64 ":", run.origin, run.last());
      }
      // A step that comes back after a disturbance is listed once.
      const auto earlier = std::find_if(runs.begin(), runs.begin() + i, [&](const StepRun& r) {
        return r.digest == run.digest && r.period == run.period;
      });
      if (earlier != runs.begin() + i) {
        std::printf(" the step at collectives #%" PRIu64 "–#%" PRIu64 " again\n", earlier->origin,
                    earlier->last());
        continue;
      }
      if (runs.size() > 1) std::putchar('\n');
      print_step_calls(trace, member, run, options.listed_calls);
    }
    print_runtime_steps(trace, member.comm_id);
  }
}

}  // namespace

int skeleton_main(std::span<const std::string> args) {
  return run_verb(kUsage, args, [&] {
    const OptionSpec* spec = find_option("MAGI_MAX_STEP_CALLS");
    std::vector<std::string> complaints;
    SkeletonOptions options;
    options.max_step_calls = static_cast<uint32_t>(
        Options::parse([](const char*) { return std::nullopt; }, {}, complaints).max_step_calls);
    ArgCursor cursor(args);
    while (!cursor.done()) {
      if (auto n = cursor.value("--max-step")) {
        options.max_step_calls =
            static_cast<uint32_t>(parse_integer("--max-step", *n, spec->min, spec->max));
      } else if (auto calls = cursor.value("--calls")) {
        options.listed_calls =
            static_cast<uint64_t>(parse_integer("--calls", *calls, 0, INT64_MAX));
      } else {
        cursor.operand(options.files);
      }
    }
    if (options.files.empty()) throw UsageError("skeleton needs at least one trace file");
    for (size_t i = 0; i < options.files.size(); ++i) {
      const trace::Trace t = trace::read_trace(options.files[i]);
      if (i != 0) std::putchar('\n');
      print_skeleton(t, options);
    }
    return 0;
  });
}

}  // namespace magi::tool
