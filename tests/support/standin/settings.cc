#include "tests/support/standin/settings.h"

#include <cstdlib>
#include <cstring>

#include "tests/support/standin/report.h"

namespace standin {
namespace {

Settings read_settings() {
  Settings s;
  if (const char* v = std::getenv("STANDIN_MISMATCH")) {
    if (std::strcmp(v, "error") == 0) {
      s.mismatch = MismatchPolicy::Error;
    } else if (std::strcmp(v, "block") != 0 && *v != '\0') {
      report("STANDIN_MISMATCH=%s not understood (block|error); blocking", v);
    }
  }
  if (const char* v = std::getenv("STANDIN_TIMEOUT_S")) {
    char* end = nullptr;
    double seconds = std::strtod(v, &end);
    if (end != v && *end == '\0' && seconds >= 0) {
      s.timeout_s = seconds;
    } else {
      report("STANDIN_TIMEOUT_S=%s is not a number of seconds; waiting forever", v);
    }
  }
  if (const char* v = std::getenv("STANDIN_SLOT_KIB")) {
    char* end = nullptr;
    long kib = std::strtol(v, &end, 10);
    if (end != v && *end == '\0' && kib >= 1 && kib <= (1L << 20)) {
      s.slot_bytes = static_cast<size_t>(kib) * 1024;
    } else {
      report("STANDIN_SLOT_KIB=%s is not in 1..1048576; using %zu", v, s.slot_bytes / 1024);
    }
  }
  if (const char* v = std::getenv("STANDIN_DELAY_US")) {
    char* end = nullptr;
    const long us = std::strtol(v, &end, 10);
    if (end != v && *end == '\0' && us >= 0 && us <= 10'000'000) {
      s.delay_us = us;
    } else {
      report("STANDIN_DELAY_US=%s is not in 0..10000000; no delay", v);
    }
  }
  if (const char* v = std::getenv("STANDIN_GROUP_ORDER")) {
    if (std::strcmp(v, "size") == 0) {
      s.group_order_by_size = true;
    } else if (std::strcmp(v, "issue") != 0 && *v != '\0') {
      report("STANDIN_GROUP_ORDER=%s not understood (issue|size); in call order", v);
    }
  }
  if (const char* v = std::getenv("STANDIN_PINNED_STAGING")) {
    if (std::strcmp(v, "1") == 0) {
      s.pinned_staging = true;
    } else if (std::strcmp(v, "0") != 0 && *v != '\0') {
      report("STANDIN_PINNED_STAGING=%s not understood (0|1); pageable staging", v);
    }
  }
  if (const char* v = std::getenv("STANDIN_SHM_TAG")) {
    // Only characters that are safe in a file name and cannot end the tag early.
    for (const char* c = v; *c != '\0' && s.shm_tag.size() < 32; ++c) {
      bool safe = (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9');
      if (safe) s.shm_tag += *c;
    }
  }
  return s;
}

}  // namespace

const Settings& Settings::get() {
  static const Settings settings = read_settings();
  return settings;
}

}  // namespace standin
