// Every MAGI_* variable is one row of the option table (kTable in base/options.cc): its name, the
// field of Options it fills, its kind, default, range or value names, unit and one-line doc.
// Parsing, validation, describe(), `magice-trace --help`, the README table (checked by a test)
// and the "unknown MAGI_ variable" warning all read that table, so they cannot drift apart.
// Adding an option is one row there and its field in Options below.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/backend.h"

namespace magi {

// FaultSpec is MAGI_INJECT_FAULT's PLACE:RANK.
enum class OptionKind : uint8_t { Bool, Int, Enum, SubsystemList, Path, FaultSpec };

// What the user writes an Int option in. Its field holds bytes for a size: the one conversion is
// in the table's Int parser, so no reader of Options multiplies by 1024 again.
enum class OptionUnit : uint8_t { Count, KiB, MiB };

constexpr int64_t unit_bytes(OptionUnit unit) {
  return unit == OptionUnit::MiB   ? int64_t{1} << 20
         : unit == OptionUnit::KiB ? int64_t{1} << 10
                                   : 1;
}
constexpr const char* unit_name(OptionUnit unit) {
  return unit == OptionUnit::MiB ? "MiB" : unit == OptionUnit::KiB ? "KiB" : "";
}

struct Options;

struct OptionSpec {
  const char* name;
  OptionKind kind;
  const char* default_text;
  const char* accepted;     // shown to the user when a value is refused
  int64_t min;              // Int only, in `unit`
  int64_t max;              // Int only, in `unit`
  OptionUnit unit;          // Int only
  const char* empty_shows;  // Path only: what describe() shows for an empty path
  const char* doc;
  // Made from the row's field by the generic parser of its kind: `assign` fills the field from
  // the user's text (false: refused, the field unchanged); `show` gives the field back as the
  // user would write it (a size in its unit).
  bool (*assign)(const OptionSpec& spec, Options& options, std::string_view text);
  std::string (*show)(const OptionSpec& spec, const Options& options);
};

// The typed view, filled once from the environment (Options::get()).
struct Options {
  enum class LogLevel : uint8_t { Warn = 0, Info = 1, Trace = 2 };

  // Defaults come from the table (parse() applies them), never from initialisers here.
  LogLevel log_level{};
  uint32_t log_subsystems{};  // bit per magi::Subsystem
  std::string trace_dir;
  uint64_t trace_buffer_bytes{};  // MAGI_TRACE_BUFFER_KIB
  int64_t callsites{};            // 0 off, 1 all-gathers (every call when tracing), 2 every call
  int64_t callsite_depth{};
  int64_t py_callsites{};  // 0 off, 1 with the GIL held, 2 also taking it (capture/py_callsite.h)
  int64_t max_step_calls{};
  std::string nccl_library;
  enum class Transport : uint8_t { CopyEngine, Nccl };
  Transport transport{};
  using Backend = magi::Backend;  // MAGI_BACKEND
  Backend backend{};
  int64_t warmup_steps{};
  int64_t reagree_steps{};
  uint64_t symm_min_shard_bytes{};  // MAGI_SYMM_MIN_SHARD_MIB
  uint64_t window_max_bytes{};      // MAGI_WINDOW_MAX_MIB
  bool dry_run{};
  bool static_weights{};
  // MAGI_GRAPH_SLOTS: whether a default-mode plan's window gets graph slots, for gathers
  // captured into CUDA graphs (auto: once a capture was seen on the communicator).
  enum class GraphSlots : uint8_t { Auto, Always, Never };
  GraphSlots graph_slots{};
  // MAGI_CAPTURE_WAIT_MS: how long a round at a graph capture waits for the other ranks; 0: none.
  int64_t capture_wait_ms{};
  // MAGI_INJECT_CAPTURE: for tests, all-gathers from this call of a communicator on are taken
  // as captured into a CUDA graph (0: off).
  int64_t inject_capture_from{};
  bool ce_force{};
  struct Fault {
    enum class Where : uint8_t {
      None,
      Prepare,
      Attach,
      Gather,
      Slow,
      SlowAttach,
      SlowPrepare,
      RefuseDescriptors,
      SubComm
    };
    Where where = Where::None;
    int rank = -1;
  };
  Fault inject_fault{};
  // MAGI_INJECT_HOST: for tests, the machine this process says it runs on ("": the host name).
  std::string inject_host;
  int64_t verify_every{};
  uint64_t bind_max_bytes{};        // MAGI_BIND_MAX_MIB
  int64_t flight_recorder_calls{};  // MAGI_FLIGHT_RECORDER: calls kept per communicator, 0: off
  std::string flight_recorder_dir;
  bool flight_recorder_completion{};  // the recorder also watches each call finish on the GPU
  enum class DumpSignal : uint8_t { None, Usr1, Usr2 };
  DumpSignal dump_signal{};

  // The process-wide options: parsed from environ on first use, then immutable.
  static const Options& get();

  // Parses from any environment (tests use this). Each refused value or unknown MAGI_* name
  // adds one line to `complaints`, and the default stays in force.
  using Lookup = std::function<std::optional<std::string>(const char* name)>;
  static Options parse(const Lookup& lookup, std::span<const std::string> magi_names_in_env,
                       std::vector<std::string>& complaints);

  // One NAME=VALUE per option for the log at INFO, so a bug report shows the configuration.
  std::string describe() const;
  // One option's value as describe() shows it (a size in the unit of its name); empty for a
  // name the table lacks.
  std::string value_text(std::string_view name) const;
};

std::span<const OptionSpec> option_table();
const OptionSpec* find_option(std::string_view name);

}  // namespace magi
