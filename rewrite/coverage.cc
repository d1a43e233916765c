#include "rewrite/coverage.h"

#include <algorithm>

namespace magi::rewrite {

void Coverage::count_served(std::span<const NcclGather> calls, bool by_transport, bool via_nccl,
                            uint64_t first_collective, bool captured_now) {
  for (const NcclGather& g : calls) {
    if (by_transport) {
      ++moved;
      captured += captured_now ? 1 : 0;
      moved_bytes += g.count * datatype_bytes(static_cast<uint8_t>(g.dtype));
      first_moved = std::min(first_moved, first_collective);
    } else if (!via_nccl) {
      ++fell_back;
    }
  }
}

std::string Coverage::summary(const std::string& exploring_cost) const {
  std::string text = std::to_string(moved) + " of " + std::to_string(gathers) + " all-gathers (" +
                     std::to_string(moved_bytes) + " of " + std::to_string(bytes) +
                     " bytes sent) served off NCCL, " + std::to_string(fell_back) +
                     " fell back to NCCL";
  if (moved != 0) text += "; the first at collective #" + std::to_string(first_moved);
  if (captured != 0)
    text += "; " + std::to_string(captured) +
            " of them captured into CUDA graphs, moved again at every replay (replays are not "
            "counted: the library sees no call)";
  return text + "; exploring cost " + exploring_cost;
}

void Coverage::say(uint64_t comm_identity, const std::string& exploring_cost) const {
  if (gathers == 0) return;
  MAGI_INFO(Rewrite, "comm %012llx: %s", short_id(comm_identity), summary(exploring_cost).c_str());
}

}  // namespace magi::rewrite
