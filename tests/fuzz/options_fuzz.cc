// libFuzzer target: Options::parse over any environment. The input is an environment, one
// NAME=VALUE per line (the first '=' splits; a line without one is no variable; the first of a
// repeated name wins, as getenv finds it). Checked for every input:
//  - nothing crashes, nothing is thrown;
//  - each complaint is one refused value of a variable that is set, or one unknown MAGI_ name,
//    and each of those has exactly one complaint;
//  - a refused value and an unknown name change nothing: the environment without them parses to
//    the same options, with no complaint at all;
//  - every integer option holds a value inside its table range, a size in whole units.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "base/options.h"

namespace {

using Environment = std::map<std::string, std::string>;

[[noreturn]] void broken(const std::string& what) {
  std::fprintf(stderr, "options parser broke its promise: %s\n", what.c_str());
  std::abort();
}

Environment environment_from(std::string_view input) {
  Environment env;
  while (!input.empty()) {
    const size_t end = std::min(input.find('\n'), input.size());
    const std::string_view line = input.substr(0, end);
    input.remove_prefix(std::min(end + 1, input.size()));
    const size_t equals = line.find('=');
    if (equals == std::string_view::npos) continue;
    env.emplace(std::string(line.substr(0, equals)), std::string(line.substr(equals + 1)));
  }
  return env;
}

struct Parsed {
  magi::Options options;
  std::vector<std::string> complaints;
};

// As Options::get() reads environ: every name that starts with MAGI_ is checked against the table.
Parsed parse(const Environment& env) {
  std::vector<std::string> magi_names;
  for (const auto& [name, value] : env)
    if (name.rfind("MAGI_", 0) == 0) magi_names.push_back(name);
  Parsed out;
  out.options = magi::Options::parse(
      [&](const char* name) -> std::optional<std::string> {
        const auto it = env.find(name);
        return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
      },
      magi_names, out.complaints);
  return out;
}

// `value` is the field: bytes for an option written in KiB or MiB.
void check_in_range(const char* name, int64_t value) {
  const magi::OptionSpec* spec = magi::find_option(name);
  if (spec == nullptr || spec->kind != magi::OptionKind::Int)
    broken(std::string("no Int option ") + name);
  const int64_t unit = magi::unit_bytes(spec->unit);
  if (value % unit != 0 || value / unit < spec->min || value / unit > spec->max)
    broken(std::string(name) + " holds " + std::to_string(value) + ", outside its range");
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Environment env = environment_from({reinterpret_cast<const char*>(data), size});
  const Parsed parsed = parse(env);

  // Attribute each complaint to the one variable it is about.
  std::set<std::string> refused, unknown;
  for (const std::string& complaint : parsed.complaints) {
    std::optional<std::string> about;
    for (const magi::OptionSpec& spec : magi::option_table()) {
      if (env.count(spec.name) && starts_with(complaint, std::string(spec.name) + "='")) {
        if (!refused.insert(spec.name).second)
          broken("two complaints about " + std::string(spec.name));
        about = spec.name;
      }
    }
    for (const auto& [name, value] : env) {
      if (starts_with(name, "MAGI_") && magi::find_option(name) == nullptr &&
          starts_with(complaint, "unknown variable " + name + " is ignored")) {
        // A name may be a prefix of another; the complaint is about the longest that fits.
        if (!about || about->size() < name.size()) about = name;
      }
    }
    if (!about) broken("a complaint about nothing that was set: " + complaint);
    if (!magi::find_option(*about) && !unknown.insert(*about).second)
      broken("two complaints about " + *about);
  }
  for (const auto& [name, value] : env)
    if (starts_with(name, "MAGI_") && magi::find_option(name) == nullptr && !unknown.count(name))
      broken("unknown variable without a complaint: " + name);

  const magi::Options& o = parsed.options;
  check_in_range("MAGI_TRACE_BUFFER_KIB", static_cast<int64_t>(o.trace_buffer_bytes));
  check_in_range("MAGI_CALLSITE_DEPTH", o.callsite_depth);
  check_in_range("MAGI_MAX_STEP_CALLS", o.max_step_calls);
  check_in_range("MAGI_WARMUP_STEPS", o.warmup_steps);
  check_in_range("MAGI_REAGREE_STEPS", o.reagree_steps);
  check_in_range("MAGI_SYMM_MIN_SHARD_MIB", static_cast<int64_t>(o.symm_min_shard_bytes));
  check_in_range("MAGI_WINDOW_MAX_MIB", static_cast<int64_t>(o.window_max_bytes));
  check_in_range("MAGI_VERIFY_EVERY", o.verify_every);
  check_in_range("MAGI_BIND_MAX_MIB", static_cast<int64_t>(o.bind_max_bytes));

  Environment accepted = env;
  for (const std::string& name : refused) accepted.erase(name);
  for (const std::string& name : unknown) accepted.erase(name);
  const Parsed again = parse(accepted);
  if (!again.complaints.empty()) broken("an accepted value refused: " + again.complaints[0]);
  if (again.options.describe() != parsed.options.describe())
    broken("refused values or unknown names changed the options:\n  " + parsed.options.describe() +
           "\n  " + again.options.describe());
  return 0;
}
