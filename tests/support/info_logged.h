// Logging at INFO for every subsystem while a test runs (the level and subsystems as they were,
// once it is over): for tests that read what the library says on stderr.
#pragma once

#include <cstdint>

#include "base/base.h"

namespace magi::test {

struct InfoLogged {
  InfoLogged()
      : level(log_detail::g_level.exchange(1)),
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
