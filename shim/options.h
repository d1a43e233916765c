// Every MAGI_* variable, declared once: name, kind, default, accepted values, one-line doc.
// Parsing, validation, the README table, `magice-trace --help` and the "unknown MAGI_ variable"
// warning all read this table, so they cannot drift apart.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace magi {

enum class OptionKind : uint8_t { Bool, Int, Enum, SubsystemList, Path };

struct OptionSpec {
  const char* name;
  OptionKind kind;
  const char* default_text;
  const char* accepted;  // shown to the user when a value is refused
  int64_t min;           // Int only
  int64_t max;           // Int only
  const char* doc;
};

//  name                 kind            default   accepted                         min  max      doc
#define MAGI_OPTION_TABLE(X)                                                                       \
  X(MAGI_LOG, Enum, "WARN", "WARN|INFO|TRACE", 0, 0,                                              \
    "How much the library says on stderr: warnings only, decisions, or every call.")             \
  X(MAGI_LOG_SUBSYS, SubsystemList, "ALL", "comma list of INIT,SHIM,CAPTURE,TRACE,ALL; ^ negates", \
    0, 0, "Which subsystems may log (like NCCL_DEBUG_SUBSYS).")                                   \
  X(MAGI_TRACE_DIR, Path, "", "a directory path", 0, 0,                                           \
    "Write each process's call records to a file in this directory (mode 0600). Empty: no trace.") \
  X(MAGI_TRACE_BUFFER_KIB, Int, "1024", "an integer from 16 to 1048576", 16, 1048576,             \
    "Size of each of the two trace buffers; a full buffer is handed to the writer thread.")      \
  X(MAGI_CALLSITES, Bool, "1", "0 or 1", 0, 0,                                                    \
    "Fingerprint each call's call site from its native stack (costs about half a microsecond).")  \
  X(MAGI_CALLSITE_DEPTH, Int, "16", "an integer from 1 to 64", 1, 64,                              \
    "Native frames, above the library's own, hashed into a call-site fingerprint.")              \
  X(MAGI_MAX_STEP_CALLS, Int, "4096", "an integer from 2 to 1048576", 2, 1048576,                 \
    "Longest repeating step (in collective calls) the step detector looks for, per communicator.") \
  X(MAGI_NCCL_LIBRARY, Path, "", "a path to libnccl.so.2", 0, 0,                                  \
    "Where the real NCCL is, when it cannot be found among the libraries already loaded.")

// The typed view, filled once from the environment (Options::get()).
struct Options {
  enum class LogLevel : uint8_t { Warn = 0, Info = 1, Trace = 2 };

  // Defaults come from the table (parse() applies them), never from initialisers here.
  LogLevel log_level{};
  uint32_t log_subsystems{};  // bit per magi::Subsystem
  std::string trace_dir;
  int64_t trace_buffer_kib{};
  bool callsites{};
  int64_t callsite_depth{};
  int64_t max_step_calls{};
  std::string nccl_library;

  // The process-wide options: parsed from environ on first use, then immutable.
  static const Options& get();

  // Parses from any environment (tests use this). Each refused value or unknown MAGI_* name
  // adds one line to `complaints`, and the default stays in force.
  using Lookup = std::function<std::optional<std::string>(const char* name)>;
  static Options parse(const Lookup& lookup, std::span<const std::string> magi_names_in_env,
                       std::vector<std::string>& complaints);

  // One line per option for the log at INFO, so a bug report shows the configuration.
  std::string describe() const;
};

std::span<const OptionSpec> option_table();
const OptionSpec* find_option(std::string_view name);

}  // namespace magi
