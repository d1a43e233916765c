// The name of a SharedFile arena's file (arena.h), for the arena and for the tests that look for
// it in /dev/shm. Under a launcher (a tag) the name carries the launch's tag, so the launcher
// removes what a killed launch leaves behind, as it does the stand-in's segments
// ("magi-standin-<tag>-"); else it is "magi-arena-<pid>". A process's further arenas add
// ".<index>".
#pragma once

#include <string>

namespace workload {

inline std::string arena_file_name(const std::string& tag, int pid, int index = 0) {
  std::string name = tag.empty() ? "magi-arena-" + std::to_string(pid)
                                 : "magi-standin-" + tag + "-arena-" + std::to_string(pid);
  return index == 0 ? name : name + "." + std::to_string(index);
}

}  // namespace workload
