#include "ce_transport/process.h"

#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace magi::ce {

// kill(pid, 0) alone is not enough: a killed process stays a zombie until its parent reaps it,
// and a zombie still answers. Its state letter in /proc/<pid>/stat says so.
bool process_alive(pid_t pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%ld/stat", static_cast<long>(pid));
  FILE* stat = std::fopen(path, "re");
  if (stat == nullptr) return errno != ENOENT;
  char text[512];
  const size_t n = std::fread(text, 1, sizeof(text) - 1, stat);
  std::fclose(stat);
  text[n] = '\0';
  const char* close_paren = std::strrchr(text, ')');  // the command name may hold anything
  if (close_paren == nullptr || close_paren[1] != ' ') return true;
  const char state = close_paren[2];
  return state != 'Z' && state != 'X';
}

}  // namespace magi::ce
