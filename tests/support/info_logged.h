// Logging at INFO for every subsystem while a test runs (the level and subsystems as they were,
// once it is over): for tests that read what the library says on stderr.
#pragma once

#include <cstdint>

#include "base/base.h"

namespace magi::test {

struct InfoLogged {
  // The options are read first: reading them (once per process, at the first Options::get())
  // sets the level from MAGI_LOG, which would undo this if it came later, in the test.
  InfoLogged()
      : level((static_cast<void>(Options::get()), log_detail::g_level.exchange(1))),
        subsystems(log_detail::g_subsystems.exchange(~0u)) {}
  ~InfoLogged() {
    log_detail::g_level.store(level);
    log_detail::g_subsystems.store(subsystems);
  }
  InfoLogged(const InfoLogged&) = delete;
  InfoLogged& operator=(const InfoLogged&) = delete;
  int level;
  uint32_t subsystems;
};

}  // namespace magi::test
