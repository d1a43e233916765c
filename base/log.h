// NCCL-style logging to stderr, by level and subsystem, silent below WARN by default:
//   host:pid:tid [rank] MAGI INFO CAPTURE comm 3f2a…: step of 12 calls found
// The level test is one relaxed load, so a disabled INFO costs nothing on the call path.
#pragma once

#include <atomic>
#include <cstdint>

namespace magi {

enum class Subsystem : uint8_t { Init = 0, Shim, Capture, Trace, Rewrite, Transport, Count };
const char* subsystem_name(Subsystem s);

namespace log_detail {
// -1 until options are read; then the level from MAGI_LOG (0 WARN, 1 INFO, 2 TRACE).
extern std::atomic<int> g_level;
extern std::atomic<uint32_t> g_subsystems;
int init_level();  // reads the options once; returns the level
void emit(int level, Subsystem subsys, const char* file, int line, const char* fmt, ...)
    __attribute__((format(printf, 5, 6)));
inline bool enabled(int level, Subsystem subsys) {
  int current = g_level.load(std::memory_order_relaxed);
  if (__builtin_expect(current < 0, 0)) current = init_level();
  return level <= current &&
         (g_subsystems.load(std::memory_order_relaxed) >> static_cast<unsigned>(subsys) & 1u);
}
}  // namespace log_detail

// The rank shown in log lines: the rank of the first communicator this process joined.
void set_log_rank(int rank);

}  // namespace magi

#define MAGI_LOG_AT(lvl, subsys, ...)                                                            \
  do {                                                                                           \
    if (::magi::log_detail::enabled(lvl, ::magi::Subsystem::subsys))                             \
      ::magi::log_detail::emit(lvl, ::magi::Subsystem::subsys, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

// WARN ignores the subsystem mask: a warning is always worth a line.
#define MAGI_WARN(subsys, ...) \
  ::magi::log_detail::emit(0, ::magi::Subsystem::subsys, __FILE__, __LINE__, __VA_ARGS__)
#define MAGI_INFO(subsys, ...) MAGI_LOG_AT(1, subsys, __VA_ARGS__)
#define MAGI_TRACE(subsys, ...) MAGI_LOG_AT(2, subsys, __VA_ARGS__)
