#include "base/options.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "base/log.h"

extern char** environ;

namespace magi {
namespace {

constexpr OptionSpec kTable[] = {
#define MAGI_OPTION_SPEC(name, kind, def, accepted, min, max, doc) \
  {#name, OptionKind::kind, def, accepted, min, max, doc},
    MAGI_OPTION_TABLE(MAGI_OPTION_SPEC)
#undef MAGI_OPTION_SPEC
};

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string upper(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return out;
}

std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::optional<bool> parse_bool(std::string_view text) {
  const std::string v = lower(trim(text));
  if (v == "1" || v == "true" || v == "yes" || v == "on") return true;
  if (v == "0" || v == "false" || v == "no" || v == "off") return false;
  return std::nullopt;
}

std::optional<int64_t> parse_int(std::string_view text, int64_t min, int64_t max) {
  const std::string v = trim(text);
  if (v.empty()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(v.c_str(), &end, 10);
  if (errno != 0 || end == v.c_str() || *end != '\0') return std::nullopt;
  if (value < min || value > max) return std::nullopt;
  return value;
}

std::optional<uint32_t> parse_subsystems(std::string_view text) {
  std::string v = upper(trim(text));
  bool negate = false;
  if (!v.empty() && v[0] == '^') {
    negate = true;
    v.erase(0, 1);
  }
  if (v.empty()) return std::nullopt;
  uint32_t mask = 0;
  size_t start = 0;
  while (start <= v.size()) {
    const size_t comma = std::min(v.find(',', start), v.size());
    const std::string item = trim(std::string_view(v).substr(start, comma - start));
    bool known = false;
    if (item == "ALL") {
      mask = ~0u;
      known = true;
    }
    for (unsigned s = 0; s < static_cast<unsigned>(Subsystem::Count); ++s) {
      if (item == subsystem_name(static_cast<Subsystem>(s))) {
        mask |= 1u << s;
        known = true;
      }
    }
    if (!known) return std::nullopt;
    start = comma + 1;
  }
  return negate ? ~mask : mask;
}

// Edit distance, to suggest the option a misspelt MAGI_ name probably meant.
size_t distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string refusal(const OptionSpec& spec, std::string_view value) {
  return std::string(spec.name) + "='" + std::string(value) + "' is not accepted (expected " +
         spec.accepted + "); using the default '" + spec.default_text + "'";
}

// Applies one textual value to the typed field; false when refused.
bool apply(Options& o, std::string_view name, std::string_view value) {
  if (name == "MAGI_LOG") {
    const std::string v = upper(trim(value));
    if (v == "WARN") o.log_level = Options::LogLevel::Warn;
    else if (v == "INFO") o.log_level = Options::LogLevel::Info;
    else if (v == "TRACE") o.log_level = Options::LogLevel::Trace;
    else return false;
    return true;
  }
  if (name == "MAGI_LOG_SUBSYS") {
    auto mask = parse_subsystems(value);
    if (!mask) return false;
    o.log_subsystems = *mask;
    return true;
  }
  if (name == "MAGI_TRACE_DIR" || name == "MAGI_NCCL_LIBRARY") {
    (name == "MAGI_TRACE_DIR" ? o.trace_dir : o.nccl_library) = trim(value);
    return true;
  }
  if (name == "MAGI_CALLSITES" || name == "MAGI_DRY_RUN" || name == "MAGI_STATIC_WEIGHTS" ||
      name == "MAGI_CE_FORCE") {
    auto b = parse_bool(value);
    if (!b) return false;
    bool& field = name == "MAGI_CALLSITES"        ? o.callsites
                  : name == "MAGI_DRY_RUN"        ? o.dry_run
                  : name == "MAGI_STATIC_WEIGHTS" ? o.static_weights
                                                  : o.ce_force;
    field = *b;
    return true;
  }
  if (name == "MAGI_INJECT_FAULT") {
    const std::string v = lower(trim(value));
    if (v == "none") {
      o.inject_fault = {};
      return true;
    }
    const size_t colon = v.find(':');
    if (colon == std::string::npos) return false;
    const std::string where = v.substr(0, colon);
    Options::Fault fault;
    if (where == "prepare") fault.where = Options::Fault::Where::Prepare;
    else if (where == "attach") fault.where = Options::Fault::Where::Attach;
    else if (where == "gather") fault.where = Options::Fault::Where::Gather;
    else if (where == "slow") fault.where = Options::Fault::Where::Slow;
    else return false;
    auto rank = parse_int(v.substr(colon + 1), 0, 1 << 24);
    if (!rank) return false;
    fault.rank = static_cast<int>(*rank);
    o.inject_fault = fault;
    return true;
  }
  if (name == "MAGI_TRANSPORT") {
    const std::string v = lower(trim(value));
    if (v == "copy_engine") o.transport = Options::Transport::CopyEngine;
    else if (v == "nccl") o.transport = Options::Transport::Nccl;
    else return false;
    return true;
  }
  if (name == "MAGI_BACKEND") {
    const std::string v = lower(trim(value));
    if (v == "cuda") o.backend = Options::Backend::Cuda;
    else if (v == "host") o.backend = Options::Backend::Host;
    else return false;
    return true;
  }
  const OptionSpec* spec = find_option(name);
  if (spec == nullptr || spec->kind != OptionKind::Int) return false;
  auto v = parse_int(value, spec->min, spec->max);
  if (!v) return false;
  if (name == "MAGI_TRACE_BUFFER_KIB") o.trace_buffer_kib = *v;
  else if (name == "MAGI_CALLSITE_DEPTH") o.callsite_depth = *v;
  else if (name == "MAGI_MAX_STEP_CALLS") o.max_step_calls = *v;
  else if (name == "MAGI_WARMUP_STEPS") o.warmup_steps = *v;
  else if (name == "MAGI_REAGREE_STEPS") o.reagree_steps = *v;
  else if (name == "MAGI_SYMM_MIN_SHARD_MIB") o.symm_min_shard_mib = *v;
  else if (name == "MAGI_WINDOW_MAX_MIB") o.window_max_mib = *v;
  else if (name == "MAGI_VERIFY_EVERY") o.verify_every = *v;
  else if (name == "MAGI_BIND_MAX_MIB") o.bind_max_mib = *v;
  else return false;
  return true;
}

}  // namespace

std::span<const OptionSpec> option_table() { return kTable; }

const OptionSpec* find_option(std::string_view name) {
  for (const OptionSpec& spec : kTable)
    if (name == spec.name) return &spec;
  return nullptr;
}

Options Options::parse(const Lookup& lookup, std::span<const std::string> magi_names_in_env,
                       std::vector<std::string>& complaints) {
  Options o;
  for (const OptionSpec& spec : kTable) {
    // Defaults go through the same parser, so the table's text is the single source.
    if (!apply(o, spec.name, spec.default_text))
      complaints.push_back(std::string("internal: default of ") + spec.name + " does not parse");
    std::optional<std::string> value = lookup(spec.name);
    if (!value) continue;
    if (!apply(o, spec.name, *value)) {
      complaints.push_back(refusal(spec, *value));
      apply(o, spec.name, spec.default_text);
    }
  }
  for (const std::string& name : magi_names_in_env) {
    if (find_option(name) != nullptr) continue;
    const OptionSpec* closest = nullptr;
    size_t best = 4;  // suggest only near misses
    for (const OptionSpec& spec : kTable) {
      const size_t d = distance(name, spec.name);
      if (d < best) best = d, closest = &spec;
    }
    complaints.push_back("unknown variable " + name + " is ignored" +
                         (closest ? std::string(" (did you mean ") + closest->name + "?)" : ""));
  }
  return o;
}

const Options& Options::get() {
  static const Options* options = [] {
    std::vector<std::string> names;
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      std::string_view entry(*e);
      if (entry.rfind("MAGI_", 0) != 0) continue;
      names.emplace_back(entry.substr(0, entry.find('=')));
    }
    std::vector<std::string> complaints;
    auto* parsed = new Options(parse(
        [](const char* name) -> std::optional<std::string> {
          const char* v = std::getenv(name);
          return v ? std::optional<std::string>(v) : std::nullopt;
        },
        names, complaints));
    log_detail::g_subsystems.store(parsed->log_subsystems, std::memory_order_relaxed);
    log_detail::g_level.store(static_cast<int>(parsed->log_level), std::memory_order_relaxed);
    for (const std::string& line : complaints) MAGI_WARN(Init, "%s", line.c_str());
    MAGI_INFO(Init, "options: %s", parsed->describe().c_str());
    return parsed;  // intentionally never freed: read until the last instruction of the process
  }();
  return *options;
}

std::string Options::describe() const {
  static constexpr const char* kLevels[] = {"WARN", "INFO", "TRACE"};
  std::string out;
  out += "MAGI_LOG=" + std::string(kLevels[static_cast<int>(log_level)]);
  char subsystems[16];
  snprintf(subsystems, sizeof(subsystems), "%#x", log_subsystems);
  out += " MAGI_LOG_SUBSYS=" + std::string(subsystems);
  out += " MAGI_TRACE_DIR=" + (trace_dir.empty() ? std::string("(off)") : trace_dir);
  out += " MAGI_TRACE_BUFFER_KIB=" + std::to_string(trace_buffer_kib);
  out += " MAGI_CALLSITES=" + std::string(callsites ? "1" : "0");
  out += " MAGI_CALLSITE_DEPTH=" + std::to_string(callsite_depth);
  out += " MAGI_MAX_STEP_CALLS=" + std::to_string(max_step_calls);
  out += " MAGI_NCCL_LIBRARY=" + (nccl_library.empty() ? std::string("(search)") : nccl_library);
  out += " MAGI_TRANSPORT=" + std::string(transport == Transport::Nccl ? "nccl" : "copy_engine");
  out += " MAGI_BACKEND=" + std::string(backend == Backend::Host ? "host" : "cuda");
  out += " MAGI_WARMUP_STEPS=" + std::to_string(warmup_steps);
  out += " MAGI_REAGREE_STEPS=" + std::to_string(reagree_steps);
  out += " MAGI_SYMM_MIN_SHARD_MIB=" + std::to_string(symm_min_shard_mib);
  out += " MAGI_WINDOW_MAX_MIB=" + std::to_string(window_max_mib);
  out += " MAGI_DRY_RUN=" + std::string(dry_run ? "1" : "0");
  out += " MAGI_STATIC_WEIGHTS=" + std::string(static_weights ? "1" : "0");
  out += " MAGI_VERIFY_EVERY=" + std::to_string(verify_every);
  out += " MAGI_BIND_MAX_MIB=" + std::to_string(bind_max_mib);
  out += " MAGI_CE_FORCE=" + std::string(ce_force ? "1" : "0");
  static constexpr const char* kWhere[] = {"none", "prepare", "attach", "gather", "slow"};
  out += " MAGI_INJECT_FAULT=" + std::string(kWhere[static_cast<int>(inject_fault.where)]);
  if (inject_fault.where != Fault::Where::None) out += ":" + std::to_string(inject_fault.rank);
  return out;
}

}  // namespace magi
