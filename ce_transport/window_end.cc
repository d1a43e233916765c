#include "ce_transport/window_end.h"

#include <thread>

#include "ce_transport/process.h"

namespace magi::ce {

std::string settled_name(Settled s, const std::string& ranks) {
  switch (s) {
    case Settled::Finished: return "finished";
    case Settled::PeerDied: return "rank " + ranks + " died before it finished reading it";
    case Settled::OwnStreamBehind:
      return "this rank's stream had not run its last moved gather within " +
             std::to_string(kSettleLimit.count()) + " s (work queued before it" +
             (ranks.empty() ? std::string(")") : ", or a wait on rank(s) " + ranks + ")");
    case Settled::PeersBehind:
      return "rank(s) " + ranks + " had not finished reading it within " +
             std::to_string(kSettleLimit.count()) + " s";
    case Settled::Abandoned: return "the communicator was aborted with a bucket in flight";
    case Settled::Unreadable: return "its flags could not be read";
  }
  return "?";
}

namespace {

uint64_t word_at(const uint8_t* words, size_t offset) {
  uint64_t v = 0;
  std::memcpy(&v, words + offset, sizeof(v));
  return v;
}

}  // namespace

Settled settle(MemoryOps& memory, const protocol::FlagLayout& layout, int rank,
               std::span<const pid_t> pids, uint64_t target,
               std::chrono::steady_clock::duration limit, std::string& ranks) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  for (;;) {
    const uint8_t* words = memory.read_flags_now();
    if (words == nullptr) return Settled::Unreadable;
    const bool own_done = word_at(words, layout.own()) >= target;
    ranks.clear();
    for (int r = 0; r < layout.nranks; ++r) {
      if (r == rank || word_at(words, layout.done(r)) >= target) continue;
      if (!process_alive(pids[static_cast<size_t>(r)])) {
        ranks = std::to_string(r);
        return Settled::PeerDied;
      }
      ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
    }
    if (own_done && ranks.empty()) return Settled::Finished;
    if (std::chrono::steady_clock::now() >= deadline)
      return own_done ? Settled::PeersBehind : Settled::OwnStreamBehind;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

void add_wait_releases(std::vector<FlagOp>& ops, const protocol::FlagLayout& layout, int rank,
                       uint8_t* flags, bool counters) {
  for (int r = 0; r < layout.nranks; ++r) {
    if (r == rank) continue;
    if (counters) {
      ops.push_back({FlagOp::Kind::Write, rank, flags + layout.ready(r), protocol::kReleased});
      ops.push_back({FlagOp::Kind::Write, rank, flags + layout.done(r), protocol::kReleased});
    }
    for (int slot = 0; slot < 2; ++slot) {
      ops.push_back({FlagOp::Kind::Open, rank, flags + layout.staged(slot, r), 1});
      ops.push_back({FlagOp::Kind::Open, rank, flags + layout.read(slot, r), 1});
    }
  }
}

}  // namespace magi::ce
