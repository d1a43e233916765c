#include "base/options.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "base/log.h"

extern char** environ;

namespace magi {
namespace {

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

// --- One generic parser (assign) and printer (show) per kind, instantiated for each row's field.

template <auto Field>
using FieldOf = std::remove_cvref_t<decltype(std::declval<Options&>().*Field)>;

template <auto Field>
bool assign_bool(const OptionSpec&, Options& o, std::string_view text) {
  const std::optional<bool> value = parse_bool(text);
  if (!value) return false;
  o.*Field = *value;
  return true;
}

template <auto Field>
std::string show_bool(const OptionSpec&, const Options& o) {
  return o.*Field ? "1" : "0";
}

template <auto Field>
bool assign_int(const OptionSpec& spec, Options& o, std::string_view text) {
  const std::optional<int64_t> value = parse_int(text, spec.min, spec.max);
  if (!value) return false;
  o.*Field = static_cast<FieldOf<Field>>(*value * unit_bytes(spec.unit));
  return true;
}

template <auto Field>
std::string show_int(const OptionSpec& spec, const Options& o) {
  return std::to_string(static_cast<int64_t>(o.*Field / unit_bytes(spec.unit)));
}

// An Enum row's value names, each mapped to the enum value it selects; matched ignoring case.
template <class E>
struct ValueName {
  const char* text;
  E value;
};

template <auto Field, const auto& Names>
bool assign_enum(const OptionSpec&, Options& o, std::string_view text) {
  const std::string value = lower(trim(text));
  for (const auto& name : Names) {
    if (value == lower(name.text)) {
      o.*Field = name.value;
      return true;
    }
  }
  return false;
}

template <auto Field, const auto& Names>
std::string show_enum(const OptionSpec&, const Options& o) {
  for (const auto& name : Names)
    if (o.*Field == name.value) return name.text;
  return "?";
}

template <auto Field>
bool assign_subsystems(const OptionSpec&, Options& o, std::string_view text) {
  const std::optional<uint32_t> mask = parse_subsystems(text);
  if (!mask) return false;
  o.*Field = *mask;
  return true;
}

template <auto Field>
std::string show_subsystems(const OptionSpec&, const Options& o) {
  char text[16];
  std::snprintf(text, sizeof(text), "%#x", static_cast<unsigned>(o.*Field));
  return text;
}

template <auto Field>
bool assign_path(const OptionSpec&, Options& o, std::string_view text) {
  o.*Field = trim(text);
  return true;
}

template <auto Field>
std::string show_path(const OptionSpec& spec, const Options& o) {
  return (o.*Field).empty() ? std::string(spec.empty_shows) : o.*Field;
}

// PLACE:RANK, or the name of Where::None alone.
template <auto Field, const auto& Places>
bool assign_fault(const OptionSpec&, Options& o, std::string_view text) {
  const std::string value = lower(trim(text));
  const size_t colon = value.find(':');
  Options::Fault fault;
  for (const auto& place : Places) {
    if (place.value == Options::Fault::Where::None) {
      if (value != place.text) continue;
      o.*Field = fault;
      return true;
    }
    if (colon == std::string::npos || value.compare(0, colon, place.text) != 0) continue;
    const std::optional<int64_t> rank = parse_int(value.substr(colon + 1), 0, 1 << 24);
    if (!rank) return false;
    fault.where = place.value;
    fault.rank = static_cast<int>(*rank);
    o.*Field = fault;
    return true;
  }
  return false;
}

template <auto Field, const auto& Places>
std::string show_fault(const OptionSpec&, const Options& o) {
  const Options::Fault& fault = o.*Field;
  for (const auto& place : Places) {
    if (place.value != fault.where) continue;
    if (fault.where == Options::Fault::Where::None) return place.text;
    return std::string(place.text) + ":" + std::to_string(fault.rank);
  }
  return "?";
}

// --- Row builders. Each checks, while the table compiles, that its field has the kind's type.

// Whether `text` reads "an integer from MIN to MAX", so an Int row's range is stated once.
constexpr bool states_range(std::string_view text, int64_t min, int64_t max) {
  auto consume = [&text](std::string_view word) {
    if (text.substr(0, word.size()) != word) return false;
    text.remove_prefix(word.size());
    return true;
  };
  auto consume_decimal = [&consume](int64_t value) {
    if (value < 0 && !consume("-")) return false;
    uint64_t magnitude = static_cast<uint64_t>(value);
    if (value < 0) magnitude = 0 - magnitude;
    char digits[20] = {};
    int n = 0;
    do digits[n++] = static_cast<char>('0' + magnitude % 10);
    while ((magnitude /= 10) != 0);
    while (n > 0)
      if (!consume(std::string_view(&digits[--n], 1))) return false;
    return true;
  };
  return consume("an integer from ") && consume_decimal(min) && consume(" to ") &&
         consume_decimal(max) && text.empty();
}

template <auto Field>
constexpr OptionSpec bool_option(const char* name, const char* default_text, const char* doc) {
  static_assert(std::is_same_v<FieldOf<Field>, bool>);
  return {name, OptionKind::Bool,   default_text,    "0 or 1", 0, 0, OptionUnit::Count, nullptr,
          doc,  assign_bool<Field>, show_bool<Field>};
}

// A level that was once on/off: the words a boolean takes still mean 0 and 1.
template <auto Field>
bool assign_level(const OptionSpec& spec, Options& o, std::string_view text) {
  if (const std::optional<bool> on = parse_bool(text)) {
    o.*Field = *on ? 1 : 0;
    return true;
  }
  return assign_int<Field>(spec, o, text);
}

template <auto Field>
constexpr OptionSpec int_option(const char* name, const char* default_text, const char* accepted,
                                int64_t min, int64_t max, OptionUnit unit, const char* doc) {
  using T = FieldOf<Field>;
  static_assert(std::is_integral_v<T> && !std::is_same_v<T, bool>);
  // A throw here stops the table from compiling.
  bool fits = min <= max;
  if constexpr (std::is_unsigned_v<T>) {
    fits = fits && min >= 0 &&
           static_cast<uint64_t>(max) <= std::numeric_limits<T>::max() / unit_bytes(unit);
  } else {
    fits = fits && max <= std::numeric_limits<T>::max() / unit_bytes(unit) &&
           min >= std::numeric_limits<T>::min() / unit_bytes(unit);
  }
  if (!fits) throw "the range, in bytes, does not fit the field";
  if (!states_range(accepted, min, max)) throw "the accepted text does not state the range";
  return {name, OptionKind::Int,   default_text,   accepted, min, max, unit, nullptr,
          doc,  assign_int<Field>, show_int<Field>};
}

template <auto Field>
constexpr OptionSpec level_option(const char* name, const char* default_text, const char* accepted,
                                  int64_t max, const char* doc) {
  OptionSpec spec = int_option<Field>(name, default_text, accepted, 0, max, OptionUnit::Count, doc);
  spec.assign = assign_level<Field>;
  return spec;
}

template <auto Field, const auto& Names>
constexpr OptionSpec enum_option(const char* name, const char* default_text, const char* accepted,
                                 const char* doc) {
  static_assert(std::is_same_v<FieldOf<Field>, decltype(Names[0].value)>);
  return {name,
          OptionKind::Enum,
          default_text,
          accepted,
          0,
          0,
          OptionUnit::Count,
          nullptr,
          doc,
          assign_enum<Field, Names>,
          show_enum<Field, Names>};
}

template <auto Field>
constexpr OptionSpec subsystem_option(const char* name, const char* default_text,
                                      const char* accepted, const char* doc) {
  static_assert(std::is_same_v<FieldOf<Field>, uint32_t>);
  return {name,
          OptionKind::SubsystemList,
          default_text,
          accepted,
          0,
          0,
          OptionUnit::Count,
          nullptr,
          doc,
          assign_subsystems<Field>,
          show_subsystems<Field>};
}

// A path's default is empty: describe() shows `empty_shows` for it.
template <auto Field>
constexpr OptionSpec path_option(const char* name, const char* accepted, const char* empty_shows,
                                 const char* doc) {
  static_assert(std::is_same_v<FieldOf<Field>, std::string>);
  return {name,
          OptionKind::Path,
          "",
          accepted,
          0,
          0,
          OptionUnit::Count,
          empty_shows,
          doc,
          assign_path<Field>,
          show_path<Field>};
}

template <auto Field, const auto& Places>
constexpr OptionSpec fault_option(const char* name, const char* default_text, const char* accepted,
                                  const char* doc) {
  static_assert(std::is_same_v<FieldOf<Field>, Options::Fault>);
  return {name,
          OptionKind::FaultSpec,
          default_text,
          accepted,
          0,
          0,
          OptionUnit::Count,
          nullptr,
          doc,
          assign_fault<Field, Places>,
          show_fault<Field, Places>};
}

// --- The table: one row per MAGI_* variable, in the order describe(), --help and README list them.

constexpr ValueName<Options::LogLevel> kLogLevels[] = {{"WARN", Options::LogLevel::Warn},
                                                       {"INFO", Options::LogLevel::Info},
                                                       {"TRACE", Options::LogLevel::Trace}};
constexpr ValueName<Options::Transport> kTransports[] = {
    {"copy_engine", Options::Transport::CopyEngine}, {"nccl", Options::Transport::Nccl}};
constexpr ValueName<Options::Backend> kBackends[] = {{"cuda", Options::Backend::Cuda},
                                                     {"host", Options::Backend::Host}};
constexpr ValueName<Options::GraphSlots> kGraphSlots[] = {{"auto", Options::GraphSlots::Auto},
                                                          {"always", Options::GraphSlots::Always},
                                                          {"never", Options::GraphSlots::Never}};
constexpr ValueName<Options::Fault::Where> kFaultPlaces[] = {
    {"none", Options::Fault::Where::None},
    {"prepare", Options::Fault::Where::Prepare},
    {"attach", Options::Fault::Where::Attach},
    {"gather", Options::Fault::Where::Gather},
    {"slow", Options::Fault::Where::Slow},
    {"slow-attach", Options::Fault::Where::SlowAttach},
    {"slow-prepare", Options::Fault::Where::SlowPrepare},
    {"refuse-descriptors", Options::Fault::Where::RefuseDescriptors},
    {"subcomm", Options::Fault::Where::SubComm}};

constexpr ValueName<Options::DumpSignal> kDumpSignals[] = {{"none", Options::DumpSignal::None},
                                                           {"USR1", Options::DumpSignal::Usr1},
                                                           {"USR2", Options::DumpSignal::Usr2}};

using O = Options;
constexpr OptionSpec kTable[] = {
    enum_option<&O::log_level, kLogLevels>(
        "MAGI_LOG", "WARN", "WARN|INFO|TRACE",
        "How much the library says on stderr: warnings only, decisions, or every call."),
    subsystem_option<&O::log_subsystems>(
        "MAGI_LOG_SUBSYS", "ALL",
        "comma list of INIT,SHIM,CAPTURE,TRACE,REWRITE,TRANSPORT,ALL; ^ negates",
        "Which subsystems may log (like NCCL_DEBUG_SUBSYS)."),
    path_option<&O::trace_dir>("MAGI_TRACE_DIR", "a directory path", "(off)",
                               "Write each process's call records to a file in this directory "
                               "(mode 0600). Empty: no trace."),
    int_option<&O::trace_buffer_bytes>(
        "MAGI_TRACE_BUFFER_KIB", "1024", "an integer from 16 to 1048576", 16, 1048576,
        OptionUnit::KiB,
        "Size of each of the two trace buffers; a full buffer is handed to the writer thread."),
    level_option<&O::callsites>(
        "MAGI_CALLSITES", "1", "an integer from 0 to 2", 2,
        "Fingerprint call sites from the native stack (a quarter to a third of a microsecond a "
        "call): 1 each all-gather's, and every call's when tracing; 2 also every call's for the "
        "flight recorder alone (its reports then name every call, not only all-gathers)."),
    int_option<&O::callsite_depth>(
        "MAGI_CALLSITE_DEPTH", "16", "an integer from 1 to 64", 1, 64, OptionUnit::Count,
        "Native frames, above the library's own, hashed into a call-site fingerprint."),
    int_option<&O::py_callsites>(
        "MAGI_PY_CALLSITES", "0", "an integer from 0 to 2", 0, 2, OptionUnit::Count,
        "Traced or flight-recorded calls from Python threads also record the innermost Python "
        "frames outside torch (file, line, function): 1 when the caller holds the GIL, 2 also "
        "taking the GIL back where the caller released it (PyTorch releases it around its "
        "collectives: use 2 there)."),
    int_option<&O::max_step_calls>("MAGI_MAX_STEP_CALLS", "4096", "an integer from 2 to 1048576", 2,
                                   1048576, OptionUnit::Count,
                                   "Longest repeating step (in collective calls) the step "
                                   "detector looks for, per communicator."),
    path_option<&O::nccl_library>("MAGI_NCCL_LIBRARY", "a path to libnccl.so.2", "(search)",
                                  "Where the real NCCL is, when it cannot be found among the "
                                  "libraries already loaded."),
    enum_option<&O::transport, kTransports>("MAGI_TRANSPORT", "copy_engine", "copy_engine|nccl",
                                            "Where agreed gathers go: the copy-engine transport, "
                                            "or nccl (only capture and trace, and one settings "
                                            "check per communicator). Alike on every rank."),
    enum_option<&O::backend, kBackends>("MAGI_BACKEND", "cuda", "cuda|host",
                                        "Memory the transport serves: CUDA device memory, or "
                                        "host memory (CPU-only runs, the stand-in)."),
    int_option<&O::warmup_steps>("MAGI_WARMUP_STEPS", "3", "an integer from 1 to 1000000", 1,
                                 1000000, OptionUnit::Count,
                                 "Steps a gather must recur unchanged (position, count, type, "
                                 "call site, group; with static weights its send buffer too, "
                                 "for at least 2 steps) to be a candidate."),
    int_option<&O::reagree_steps>("MAGI_REAGREE_STEPS", "256", "an integer from 0 to 1000000000", 0,
                                  1000000000, OptionUnit::Count,
                                  "Steps to the next agreement round after one that moved all "
                                  "it could; after one that could move more later, the next "
                                  "comes sooner, backing off 1, 2, 4 ... steps up to this (with "
                                  "static weights every other step while the step is young "
                                  "first). 0: no re-agreement once all moved, no bound on the "
                                  "back-off."),
    int_option<&O::symm_min_shard_bytes>(
        "MAGI_SYMM_MIN_SHARD_MIB", "0", "an integer from 0 to 1048576", 0, 1048576, OptionUnit::MiB,
        "Smallest per-rank shard (MiB) a gather needs to leave NCCL; 0: any size."),
    int_option<&O::window_max_bytes>("MAGI_WINDOW_MAX_MIB", "4096", "an integer from 1 to 1048576",
                                     1, 1048576, OptionUnit::MiB,
                                     "Largest staging slot (MiB) of a communicator's window; a "
                                     "bigger bucket stays on NCCL."),
    bool_option<&O::dry_run>("MAGI_DRY_RUN", "0",
                             "Agree and decide as usual, move nothing: decisions show as 'would "
                             "move' in log and trace."),
    bool_option<&O::static_weights>("MAGI_STATIC_WEIGHTS", "0",
                                    "You assert weights do not change after warmup: peers read "
                                    "each shard where the program keeps it (or a copy bound once "
                                    "where that memory cannot be shared), calls are pure peer "
                                    "reads. Rounds at a capture are taken only where it is alike "
                                    "on every rank."),
    enum_option<&O::graph_slots, kGraphSlots>(
        "MAGI_GRAPH_SLOTS", "auto", "auto|always|never",
        "Default mode (weights not asserted static): gathers captured into CUDA graphs move "
        "only with graph slots, two more staging slots in the window (twice its memory). auto: "
        "from the first plan after a gather was captured on the communicator (a capture ends a "
        "plan without them and agrees one with them at the captured call); always: from the "
        "first plan, and on a communicator spanning machines (which has no rounds at a capture) "
        "also with auto, and with static weights; never: captured gathers stay on NCCL. "
        "Combined across ranks: never on any rank wins, then always or a capture on any; rounds "
        "at a capture are taken only where it is alike on every rank."),
    int_option<&O::capture_wait_ms>(
        "MAGI_CAPTURE_WAIT_MS", "20000", "an integer from 0 to 600000", 0, 600000,
        OptionUnit::Count,
        "A gather captured into a CUDA graph with no plan covering it is agreed at the capture, "
        "through host shared memory among the communicator's ranks (all on this host): the graph "
        "then holds the copy-engine path on every rank, or NCCL on every rank. How long (ms) such "
        "a round waits for every rank to capture the same gather; past it, that communicator's "
        "captured gathers stay on NCCL. 0: no rounds at capture. Alike on every rank."),
    int_option<&O::verify_every>("MAGI_VERIFY_EVERY", "64", "an integer from 0 to 1000000000", 0,
                                 1000000000, OptionUnit::Count,
                                 "Static weights: check a shard (against its binding, or what "
                                 "its peers read in place) every this many calls (0: only the "
                                 "first 3), on sampled lines (at most 128 KiB of the shard)."),
    int_option<&O::bind_max_bytes>("MAGI_BIND_MAX_MIB", "16384", "an integer from 0 to 1048576", 0,
                                   1048576, OptionUnit::MiB,
                                   "Static weights: most device memory (MiB) a communicator's "
                                   "bound shards may take (shards read in place take none); "
                                   "gathers beyond stay on NCCL."),
    bool_option<&O::ce_force>("MAGI_CE_FORCE", "0",
                              "Skip the trial that times each moved bucket both ways: agreed "
                              "gathers always move. Also explores a communicator of one rank, "
                              "which otherwise stays on NCCL (its all-gather is one local "
                              "copy)."),
    int_option<&O::inject_capture_from>(
        "MAGI_INJECT_CAPTURE", "0", "an integer from 0 to 1000000000", 0, 1000000000,
        OptionUnit::Count,
        "For tests: every all-gather from this call of a communicator on (its index among the "
        "communicator's calls, from 0) is taken as captured into a CUDA graph, as a program on a "
        "machine without a GPU cannot capture; 0: off. The host backend serves such a gather at "
        "once, as its replay."),
    fault_option<&O::inject_fault, kFaultPlaces>(
        "MAGI_INJECT_FAULT", "none",
        "none, or prepare:RANK, attach:RANK, gather:RANK, slow:RANK, slow-attach:RANK, "
        "slow-prepare:RANK, refuse-descriptors:RANK or subcomm:RANK",
        "For tests: the transport of that rank of every communicator fails there, as a CUDA "
        "error would (slow: each bucket it serves takes 20 ms longer; slow-attach: opening the "
        "peers' memory takes 100 ms longer, as thousands of CUDA IPC mappings do; slow-prepare: "
        "exporting its own shards and making its window does; refuse-descriptors: its "
        "descriptor channel refuses every peer, so the peers cannot read its static weights "
        "exported by descriptor; gather: on the host backend every rank falls back to NCCL in "
        "that bucket, on the CUDA backend that rank's call fails and its peers wait for it until "
        "the communicator is aborted; subcomm: on a communicator spanning machines, that rank's "
        "inter-machine sub-communicator fails to form). On a communicator spanning machines, "
        "the transport is each machine's own, and RANK of prepare, attach, gather and slow "
        "names a local index: that rank of every machine."),
    path_option<&O::inject_host>(
        "MAGI_INJECT_HOST", "a machine name", "(the host name)",
        "For tests: the machine this process says it runs on, in place of its host name, "
        "wherever ranks on one machine are told from ranks on others; set per process (by the "
        "launcher, per rank), so that ranks on one host act as ranks on several. Ranks with "
        "different names never read each other's memory: a communicator spanning them gathers "
        "in two levels (NCCL between machines, the transport inside each). On one GPU under MPS, "
        "processes given different names gather in two levels on the CUDA backend."),
    int_option<&O::flight_recorder_calls>(
        "MAGI_FLIGHT_RECORDER", "0", "an integer from 0 to 65536", 0, 65536, OptionUnit::Count,
        "Keep each communicator's last N calls (rounded up to a power of two, at least 16) in a "
        "file mapping that survives the process being killed, for magice-trace hang. 0: off."),
    path_option<&O::flight_recorder_dir>("MAGI_FLIGHT_RECORDER_DIR", "a directory path",
                                         "(MAGI_TRACE_DIR, else /tmp)",
                                         "Where the flight recorder's files go (mode 0600)."),
    bool_option<&O::flight_recorder_completion>(
        "MAGI_FLIGHT_RECORDER_COMPLETION", "0",
        "With the flight recorder on: also record when each call's stream reached it and when "
        "its work finished on the GPU (CUDA events polled off the call path), for magice-trace "
        "hang. Without a CUDA driver in the process a call counts as finished when it returns."),
    enum_option<&O::dump_signal, kDumpSignals>(
        "MAGI_DUMP_SIGNAL", "none", "none|USR1|USR2",
        "On this signal the trace is written out and the flight recorder synced, without "
        "stopping the program (the handler is installed at the first communicator, chaining "
        "the program's own)."),
};

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
    if (!spec.assign(spec, o, spec.default_text))
      complaints.push_back(std::string("internal: default of ") + spec.name + " does not parse");
    std::optional<std::string> value = lookup(spec.name);
    if (!value) continue;
    if (!spec.assign(spec, o, *value)) {
      complaints.push_back(refusal(spec, *value));
      spec.assign(spec, o, spec.default_text);
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
  std::string out;
  for (const OptionSpec& spec : kTable) {
    if (!out.empty()) out += ' ';
    out += spec.name;
    out += '=';
    out += spec.show(spec, *this);
  }
  return out;
}

std::string Options::value_text(std::string_view name) const {
  const OptionSpec* spec = find_option(name);
  return spec ? spec->show(*spec, *this) : std::string();
}

}  // namespace magi
