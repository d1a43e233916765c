// magice-trace: reads the trace files libmagice writes (MAGI_TRACE_DIR).
#include <algorithm>
#include <cstdio>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "base/options.h"
#include "tools/magice-trace/cli.h"
#include "tools/magice-trace/symbols.h"
#include "tools/magice-trace/verbs.h"

namespace {

struct Verb {
  std::string_view name;
  std::string_view summary;
  int (*run)(std::span<const std::string> args);
};

constexpr Verb kVerbs[] = {
    {"dump", "every record of each file, as tables", magi::tool::dump_main},
    {"skeleton", "each communicator's repeating step, found offline", magi::tool::skeleton_main},
    {"diff", "where the ranks' collectives part (exit 1 if they do)", magi::tool::diff_main},
    {"export", "Chrome trace-event JSON for Perfetto (--chrome)", magi::tool::export_main},
    {"decisions", "what agreement decided per gather and rank (exit 1 if ranks differ)",
     magi::tool::decisions_main},
    {"hang", "which rank stopped where, from flight recorder files (exit 1 if hung)",
     magi::tool::hang_main},
};

// The full help also lists the library's settings, from the one option table.
void print_usage(std::FILE* to, bool with_settings) {
  std::fprintf(to, "usage: magice-trace VERB [OPTIONS] FILE...\n\nverbs:\n");
  for (const Verb& verb : kVerbs) {
    std::fprintf(to, "  %-10.*s %.*s\n", static_cast<int>(verb.name.size()), verb.name.data(),
                 static_cast<int>(verb.summary.size()), verb.summary.data());
  }
  std::fprintf(to,
               "\n'magice-trace VERB --help' describes a verb. Frames are named from the\n"
               "binaries on this machine (function (file:line)); --no-symbols prints\n"
               "module+0xoffset instead.\n");
  if (!with_settings) return;
  std::fprintf(to,
               "Traces are written by libmagice.so when MAGI_TRACE_DIR is set. Its settings:\n");
  std::vector<std::string> defaults;  // as the user writes them: a size with its unit
  int name_width = 0, default_width = 0;
  for (const magi::OptionSpec& option : magi::option_table()) {
    std::string shown = *option.default_text ? option.default_text : "\"\"";
    if (option.unit != magi::OptionUnit::Count)
      shown += std::string(" ") + magi::unit_name(option.unit);
    name_width = std::max(name_width, static_cast<int>(std::string_view(option.name).size()));
    default_width = std::max(default_width, static_cast<int>(shown.size()));
    defaults.push_back(std::move(shown));
  }
  for (size_t i = 0; i < defaults.size(); ++i) {
    const magi::OptionSpec& option = magi::option_table()[i];
    std::fprintf(to, "  %-*s default %-*s %s\n", name_width, option.name, default_width,
                 defaults[i].c_str(), option.doc);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  // Taken before the verb sees its options: every verb that prints frames honours it.
  const auto no_symbols = std::find(args.begin(), args.end(), "--no-symbols");
  if (no_symbols != args.end() && no_symbols != args.begin()) {
    magi::tool::set_symbols_enabled(false);
    args.erase(no_symbols);
  }
  if (args.empty()) {
    print_usage(stderr, false);
    return magi::tool::kExitUsage;
  }
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    print_usage(stdout, true);
    return 0;
  }
  for (const Verb& verb : kVerbs) {
    if (args[0] == verb.name) return verb.run(std::span(args).subspan(1));
  }
  std::fprintf(stderr, "magice-trace: unknown verb '%s'\n", args[0].c_str());
  print_usage(stderr, false);
  return magi::tool::kExitUsage;
}
