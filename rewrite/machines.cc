#include "rewrite/machines.h"

#include <algorithm>

namespace magi::rewrite {

Machines machines_of(std::span<const uint64_t> host_by_rank) {
  Machines m;
  const size_t n = host_by_rank.size();
  m.machine_of.assign(n, -1);
  m.local_of.assign(n, -1);
  std::vector<uint64_t> keys;       // by machine index: its key (first met in rank order)
  std::vector<int32_t> ranks_on;    // by machine index: ranks seen so far
  for (size_t r = 0; r < n; ++r) {  // rank order: a machine's index is its lowest rank's turn
    const auto it = std::find(keys.begin(), keys.end(), host_by_rank[r]);
    const size_t machine = static_cast<size_t>(it - keys.begin());
    if (it == keys.end()) {
      keys.push_back(host_by_rank[r]);
      ranks_on.push_back(0);
    }
    m.machine_of[r] = static_cast<int32_t>(machine);
    m.local_of[r] = ranks_on[machine]++;
  }
  m.count = static_cast<int32_t>(std::max<size_t>(keys.size(), 1));
  const bool even = !ranks_on.empty() && std::all_of(ranks_on.begin(), ranks_on.end(),
                                                     [&](int32_t k) { return k == ranks_on[0]; });
  if (!even) return m;
  m.per_machine = ranks_on[0];
  m.rank_at.assign(n, -1);
  for (size_t r = 0; r < n; ++r)
    m.rank_at[static_cast<size_t>(m.machine_of[r] * m.per_machine + m.local_of[r])] =
        static_cast<int32_t>(r);
  return m;
}

trace::Reason Machines::refusal() const {
  if (!spans()) return trace::Reason::None;
  if (per_machine == 0) return trace::Reason::MachinesUneven;
  if (per_machine < 2) return trace::Reason::OneRankPerMachine;
  return trace::Reason::None;
}

}  // namespace magi::rewrite
