#include "base/log.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "base/host.h"
#include "base/options.h"

namespace magi {
namespace {
std::atomic<int> g_rank{-1};
}  // namespace

namespace log_detail {
std::atomic<int> g_level{-1};
std::atomic<uint32_t> g_subsystems{~0u};

int init_level() {
  Options::get();  // sets g_level and g_subsystems
  return g_level.load(std::memory_order_relaxed);
}

void emit(int level, Subsystem subsys, const char* file, int line, const char* fmt, ...) {
  static constexpr const char* kLevels[] = {"WARN", "INFO", "TRACE"};
  char message[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(message, sizeof(message), fmt, args);
  va_end(args);

  char rank[16] = "-";
  if (const int r = g_rank.load(std::memory_order_relaxed); r >= 0)
    snprintf(rank, sizeof(rank), "%d", r);
  char where[96] = "";
  if (level >= 2) {  // TRACE lines say where they come from; WARN/INFO stay short
    const char* base = std::strrchr(file, '/');
    snprintf(where, sizeof(where), " %s:%d", base ? base + 1 : file, line);
  }
  // One write(2) per line so lines of concurrent threads and ranks never interleave.
  char out[1280];
  const int n = snprintf(out, sizeof(out), "%s:%d:%ld [%s] MAGI %s %s%s %s\n", short_host_name(),
                         static_cast<int>(getpid()), static_cast<long>(syscall(SYS_gettid)), rank,
                         kLevels[level < 0   ? 0
                                 : level > 2 ? 2
                                             : level],
                         subsystem_name(subsys), where, message);
  if (n > 0) {
    size_t len = static_cast<size_t>(n);
    if (len >= sizeof(out)) {  // truncated: keep the line a line
      len = sizeof(out) - 1;
      out[len - 1] = '\n';
    }
    [[maybe_unused]] ssize_t ignored = write(STDERR_FILENO, out, len);
  }
}
}  // namespace log_detail

const char* subsystem_name(Subsystem s) {
  switch (s) {
    case Subsystem::Init: return "INIT";
    case Subsystem::Shim: return "SHIM";
    case Subsystem::Capture: return "CAPTURE";
    case Subsystem::Trace: return "TRACE";
    case Subsystem::Rewrite: return "REWRITE";
    case Subsystem::Transport: return "TRANSPORT";
    case Subsystem::Count: break;
  }
  return "?";
}

void set_log_rank(int rank) {
  int expected = -1;
  g_rank.compare_exchange_strong(expected, rank, std::memory_order_relaxed);
}

}  // namespace magi
