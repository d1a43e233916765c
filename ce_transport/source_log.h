// Static weights: what each rank read, published for its peers to compare. Private to
// ce_transport/.
//
// Why it exists. A bound gather's reads are fixed when they are queued: each rank reads its peers'
// shards where the plan says, keyed by the buffer its own call sends (rewrite/serving.h,
// BoundSources). That is exact when every rank makes the same change at the same call (layers
// gathered in another order everywhere), and wrong, on every rank, when one rank changes alone
// (it gathers layer 1 where its peers gather layer 0): nothing at the call can tell a reader what
// its peers send, and a host-side wait for it could deadlock legal programs. Nor can the owner of
// an exported shard stop its peers from reading memory its allocator gave to another tensor.
// What can be done without waiting is to find out afterwards, and say so: each rank folds every
// call's deviations (a gather that read another position's sources) into a running hash and
// publishes it per call, with plain stores into shared host memory; every rank compares the
// hashes of all ranks at the last call all of them have passed, at its own later calls and
// whenever the program asks for the communicator's asynchronous error. A difference, or a peer
// that found its peers read other bytes than a call of its sent from elsewhere (the memory they
// read given to another tensor, a shard re-homed to a block another layer had or to other
// bytes: exports.h, sent_elsewhere), is reported once on every rank, which turns into
// ncclRemoteError there (rewrite/serving.h). Nobody waits for anybody: the cost of a call
// is a few stores, and of a comparison a few loads per peer.
//
// Layout (a HostWindow of its own per rank and plan, opened by every peer): the head, then
// words: progress (the last call published), broken (the call at which this rank found the memory
// its peers read changed, 0 if never), broken_offset (that gather's slot offset), the mapping
// turns of the ranks on this rank's GPU (mapping_turns.h; used where this is the lowest), then a
// ring of kRing entries {call, hash}, each written as a sequence lock (call zeroed, hash, call) so
// a reader never pairs one call's number with another's hash. A rank more than kRing calls ahead of
// the slowest has overwritten the entry the comparison needs: the comparison then waits for a
// later common call (the hashes are cumulative, so nothing is lost, only found later).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "ce_transport/host_window.h"
#include "ce_transport/mapping_turns.h"

namespace magi::ce {

class SourceLog {
 public:
  static constexpr size_t kRing = 1024;

  // This rank's log for a plan; name() goes into the handle blob.
  void create(int rank, int nranks);
  const std::string& name() const { return own_.name(); }
  bool is_open() const { return own_.is_open(); }
  // Every peer's log (names by rank; this rank's own entry is ignored).
  void open_peers(std::span<const std::string> names);
  void close();

  // Call `call`'s gather at `own_offset` read the sources of the gather at `read_offset`.
  void deviate(uint64_t call, size_t own_offset, size_t read_offset);
  // Call `call` is queued: publishes the running hash.
  void publish(uint64_t call);
  // This rank found that its peers read, for the gather at `slot_offset`, other bytes than it
  // sends there.
  void mark_broken(uint64_t call, size_t slot_offset);

  // The first disagreement found, described, once; "" otherwise. Any thread.
  std::string check();

  // The mapping turns kept in `rank`'s log (this rank's or an opened peer's).
  std::atomic<uint64_t>* mapping_turns(int rank) const;

 private:
  static constexpr size_t kProgress = 0, kBroken = 8, kBrokenOffset = 16, kTurns = 24;
  static constexpr size_t kRingAt = kTurns + 8 * MappingTurns::kSlots;
  static constexpr size_t kWords = 3 + MappingTurns::kSlots + 2 * kRing;
  static size_t bytes() { return sizeof(WindowHead) + kWords * sizeof(uint64_t); }
  // The hash `window` published for `call`, if its ring still holds it.
  static bool hash_at(const HostWindow& window, uint64_t call, uint64_t& hash);

  int rank_ = 0;
  int nranks_ = 0;
  HostWindow own_;
  std::vector<HostWindow> peers_;  // by rank; this rank's entry stays closed
  uint64_t hash_ = 0;              // the running hash of this rank's deviations
  std::mutex check_mutex_;         // check() may come from a watchdog thread
  uint64_t checked_ = 0;           // every rank's hash agreed up to here
  bool reported_ = false;
};

}  // namespace magi::ce
