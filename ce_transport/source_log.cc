#include "ce_transport/source_log.h"

#include <atomic>

#include "base/base.h"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace magi::ce {

void SourceLog::create(int rank, int nranks) {
  close();
  rank_ = rank;
  nranks_ = nranks;
  own_ = HostWindow::create(bytes(), kWords * sizeof(uint64_t), nranks - 1);
}

void SourceLog::open_peers(std::span<const std::string> names) {
  peers_.clear();
  peers_.resize(static_cast<size_t>(nranks_));
  for (int r = 0; r < nranks_; ++r)
    if (r != rank_)
      peers_[static_cast<size_t>(r)] = HostWindow::open(names[r], bytes(), nranks_ - 1);
}

void SourceLog::close() {
  std::lock_guard<std::mutex> lock(check_mutex_);
  peers_.clear();
  own_.close();
  hash_ = 0;
  checked_ = 0;
  reported_ = false;
}

void SourceLog::deviate(uint64_t call, size_t own_offset, size_t read_offset) {
  const uint64_t fact[4] = {hash_, call, own_offset, read_offset};
  hash_ = XXH3_64bits(fact, sizeof(fact));
}

// The ring entry is a sequence lock made of sequentially consistent operations only (no fences:
// ThreadSanitizer does not model them): a reader that sees the same call number before and after
// reading the hash read that call's hash, since a later writer's zeroing of the number precedes
// its hash in the single total order of these operations.
void SourceLog::publish(uint64_t call) {
  const size_t slot = kRingAt + (call % kRing) * 2 * sizeof(uint64_t);
  std::atomic<uint64_t>& number = own_.flag(slot);
  number.store(0);
  own_.flag(slot + sizeof(uint64_t)).store(hash_);
  number.store(call);
  own_.flag(kProgress).store(call, std::memory_order_release);
}

void SourceLog::mark_broken(uint64_t call, size_t slot_offset) {
  if (own_.flag(kBroken).load(std::memory_order_relaxed) != 0) return;
  own_.flag(kBrokenOffset).store(slot_offset, std::memory_order_relaxed);
  own_.flag(kBroken).store(call, std::memory_order_release);
}

bool SourceLog::hash_at(const HostWindow& window, uint64_t call, uint64_t& hash) {
  const size_t slot = kRingAt + (call % kRing) * 2 * sizeof(uint64_t);
  const std::atomic<uint64_t>& number = window.flag(slot);
  if (number.load() != call) return false;
  hash = window.flag(slot + sizeof(uint64_t)).load();
  return number.load() == call;
}

std::atomic<uint64_t>* SourceLog::mapping_turns(int rank) const {
  const HostWindow& window = rank == rank_ ? own_ : peers_.at(static_cast<size_t>(rank));
  return &window.flag(kTurns);
}

std::string SourceLog::check() {
  std::lock_guard<std::mutex> lock(check_mutex_);
  if (reported_ || !own_.is_open() || peers_.size() != static_cast<size_t>(nranks_)) return {};
  auto window = [&](int r) -> const HostWindow& {
    return r == rank_ ? own_ : peers_[static_cast<size_t>(r)];
  };
  for (int r = 0; r < nranks_; ++r) {
    const uint64_t broken = window(r).flag(kBroken).load(std::memory_order_acquire);
    if (broken == 0) continue;
    reported_ = true;
    return "rank " + std::to_string(r) + " found, at its moved gather #" + std::to_string(broken) +
           ", that what its peers read for the gather at slot offset " +
           std::to_string(window(r).flag(kBrokenOffset).load(std::memory_order_relaxed)) +
           " is not what it sends there (the memory freed and given to another tensor, or a "
           "shard moved to a block another layer had): peers may have read wrong bytes";
  }
  uint64_t common = ~uint64_t{0};
  for (int r = 0; r < nranks_; ++r)
    common = std::min(common, window(r).flag(kProgress).load(std::memory_order_acquire));
  if (common <= checked_) return {};
  uint64_t first = 0;
  if (!hash_at(own_, common, first)) return {};
  for (int r = 0; r < nranks_; ++r) {
    uint64_t hash = 0;
    if (!hash_at(window(r), common, hash)) return {};  // overwritten: compare at a later call
    if (hash == first) continue;
    reported_ = true;
    return "ranks " + std::to_string(rank_) + " and " + std::to_string(r) +
           " read different positions' shards by moved gather #" + std::to_string(common) +
           " (a rank sent another position's buffer where its peers did not, e.g. layers "
           "gathered in another order on one rank only): some ranks received wrong bytes";
  }
  checked_ = common;
  return {};
}

}  // namespace magi::ce
