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
  X(MAGI_LOG_SUBSYS, SubsystemList, "ALL",                                                         \
    "comma list of INIT,SHIM,CAPTURE,TRACE,REWRITE,TRANSPORT,ALL; ^ negates", 0, 0,               \
    "Which subsystems may log (like NCCL_DEBUG_SUBSYS).")                                         \
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
    "Where the real NCCL is, when it cannot be found among the libraries already loaded.")        \
  X(MAGI_TRANSPORT, Enum, "copy_engine", "copy_engine|nccl", 0, 0,                                \
    "Where agreed gathers go: the copy-engine transport, or nccl (only capture and trace).")      \
  X(MAGI_BACKEND, Enum, "cuda", "cuda|host", 0, 0,                                                \
    "Memory the transport serves: CUDA device memory, or host memory (CPU-only runs, the stand-in).") \
  X(MAGI_WARMUP_STEPS, Int, "3", "an integer from 1 to 1000000", 1, 1000000,                       \
    "Steps a gather must recur unchanged (position, count, type, call site, send buffer) to be a candidate.") \
  X(MAGI_REAGREE_STEPS, Int, "256", "an integer from 0 to 1000000000", 0, 1000000000,              \
    "Steps between agreement rounds while routes are agreed (0: only after the step changes).")   \
  X(MAGI_SYMM_MIN_SHARD_MIB, Int, "0", "an integer from 0 to 1048576", 0, 1048576,                 \
    "Smallest per-rank shard (MiB) a gather needs to leave NCCL; 0: any size.")                   \
  X(MAGI_WINDOW_MAX_MIB, Int, "4096", "an integer from 1 to 1048576", 1, 1048576,                  \
    "Largest staging slot (MiB) of a communicator's window; a bigger bucket stays on NCCL.")      \
  X(MAGI_DRY_RUN, Bool, "0", "0 or 1", 0, 0,                                                      \
    "Agree and decide as usual, move nothing: decisions show as 'would move' in log and trace.")     \
  X(MAGI_STATIC_WEIGHTS, Bool, "0", "0 or 1", 0, 0,                                               \
    "You assert weights do not change after warmup: shards are bound once, calls are pure peer reads.") \
  X(MAGI_VERIFY_EVERY, Int, "64", "an integer from 0 to 1000000000", 0, 1000000000,               \
    "Static weights: check a shard against its binding every this many calls (0: only the first 3).") \
  X(MAGI_BIND_MAX_MIB, Int, "16384", "an integer from 0 to 1048576", 0, 1048576,                  \
    "Static weights: most device memory (MiB) a communicator's bindings may take; gathers beyond stay on NCCL.")  \
  X(MAGI_CE_FORCE, Bool, "0", "0 or 1", 0, 0,                                                     \
    "Skip the trial that times each moved bucket both ways: agreed gathers always move.")         \
  X(MAGI_INJECT_FAULT, Enum, "none", "none, or prepare:RANK, attach:RANK, gather:RANK or slow:RANK", 0, 0, \
    "For tests: the transport of that rank of every communicator fails there, as a CUDA error "   \
    "would (slow: each bucket it serves takes 20 ms longer; gather: on the host backend every "   \
    "rank falls back to NCCL in that bucket, on the CUDA backend that rank's call fails and its " \
    "peers wait for it until the communicator is aborted).")

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
  enum class Transport : uint8_t { CopyEngine, Nccl };
  Transport transport{};
  enum class Backend : uint8_t { Cuda, Host };
  Backend backend{};
  int64_t warmup_steps{};
  int64_t reagree_steps{};
  int64_t symm_min_shard_mib{};
  int64_t window_max_mib{};
  bool dry_run{};
  bool static_weights{};
  bool ce_force{};
  struct Fault {
    enum class Where : uint8_t { None, Prepare, Attach, Gather, Slow };
    Where where = Where::None;
    int rank = -1;
  };
  Fault inject_fault{};
  int64_t verify_every{};
  int64_t bind_max_mib{};

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
