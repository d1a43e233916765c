// The name of a SharedFile arena's file (arena.h), for the arena and for the tests that look for
// it in /dev/shm. Under a launcher (a tag) the name carries the launch's tag, so the launcher
// removes what a killed launch leaves behind, as it does the stand-in's segments
// ("magi-standin-<tag>-"); else it is "magi-arena-<pid>". A process's further arenas add
// ".<index>". The host backend reads in place only names under 40 bytes: with the launchers'
// tags (8 characters at most) the longest, a 7-digit pid's arena 999, is 39.
#pragma once

#include <string>

namespace workload {

inline std::string arena_file_name(const std::string& tag, int pid, int index = 0) {
  std::string name = tag.empty() ? "magi-arena-" + std::to_string(pid)
                                 : "magi-standin-" + tag + "-arena-" + std::to_string(pid);
  return index == 0 ? name : name + "." + std::to_string(index);
}

}  // namespace workload
