#include "rewrite/recent_calls.h"

#include <algorithm>

namespace magi::rewrite {

void RecentCalls::seed(StepObservation& seen, uint64_t origin, uint32_t period, uint64_t before,
                       ce::Backend backend) const {
  if (period == 0) return;
  const uint64_t oldest = next_ > kRecentCalls ? next_ - kRecentCalls : 0;
  // Only what is still held, and only indices already added (a call not recorded is not seeded).
  const uint64_t end = std::min(before, next_);
  for (uint64_t i = std::max(origin, oldest); i < end; ++i) {
    const uint32_t position = static_cast<uint32_t>((i - origin) % period);
    if (position == 0) seen.begin_step();
    seen.observe(position, calls_[i % kRecentCalls], backend);
  }
}

}  // namespace magi::rewrite
