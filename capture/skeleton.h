// Step detection: finds the repeating step of a communicator's collective sequence.
//
// Keys are rank-independent shapes (op, datatype, count, root, reduction op), so every rank of a
// communicator that issues the same collectives runs this deterministic detector on the same keys
// and reaches the same answer at the same call: later stages rely on that to pick agreement
// points without talking.
//
// What it does. A context is a run of kContextKeys consecutive keys; one ends at every key from
// the kContextKeys-th on. A table remembers where each context last ended. At each key the
// candidate period p is the distance back to where the current context last ended, taken only if
// p <= max_step and the keys themselves (not just their hashes) match there; its run then counts
// those kContextKeys matching keys. While searching, a key equal to the key p back extends the
// run, and any other key replaces the candidate with the one its own context gives (or none). A
// run of p keys means the last 2p keys are p-periodic: the step is found, reduced to its smallest
// period, and its origin taken back to where the repetition began. While found, each key is
// checked against the step; a mismatch loses it, and that key's context gives the next candidate.
//
// Why a context. In a periodic stretch the distance back to a context's previous occurrence is
// the period exactly when that context occurs once per step. A candidate that is not a multiple
// of the period breaks at such a context (else the context would repeat at a shorter distance),
// and that context then proposes the period. So a step is found, and then kept while the keys
// repeat, exactly when one of its cyclic kContextKeys-grams occurs once per step; from a clean
// start, by the end of its third repetition.
// Why kContextKeys is 8, and what shorter contexts missed (measured): ARCHITECTURE.md, "Design
// notes: step detection".
//
// Limits, all rank-independent and so the same on every rank:
//  - A step whose every cyclic kContextKeys-gram occurs at least twice per step is never found
//    as a whole, e.g. `a^m b a^(m+1) b` for m >= kContextKeys.
//  - A pure `aaaa…` is period 1 by any rule that sees only keys, and is reported so.
//  - A period p below kContextKeys is found after p + kContextKeys keys, not 2p.
//  - Before a step is established, kContextKeys + 1 equal keys inside it are found as a step of
//    one key, lost at the next other key; once it is, they are only positions of the step.
//  - After an interruption, a candidate from a context before it can hold across it until it
//    meets the interruption: the resumed step is found up to about a repetition later than from
//    a clean start.
//  - The table forgets a context once newer ones fill its set; a step with more distinct contexts
//    than the table holds is found from those that survive, a little later.
//
// Cost: O(1) per key and allocation-free after construction: a hash of kContextKeys keys, one
// cache line of the table, and a check of kContextKeys keys when a candidate is taken (finding a
// step adds O(p), paid for by the p keys its run needed; see skeleton.cc). Memory: a ring of the
// last 2 × max_step + kContextKeys keys and a table of 4096 contexts (64 KiB).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace magi::capture {

class StepDetector {
 public:
  enum class Event : uint8_t { None, Found, Lost };

  // Keys in a context: the candidate period comes from the previous occurrence of the last this
  // many keys.
  static constexpr uint32_t kContextKeys = 8;

  explicit StepDetector(uint32_t max_step_calls);
  // Starts over as if newly made, keeping its memory (clears the 64 KiB table: not per call).
  void reset();

  // Feeds the next collective's shape key.
  Event push(uint64_t key);

  bool found() const { return period_ != 0; }
  uint64_t keys_seen() const { return n_; }
  // While found: index (into the key sequence) of the first key of the first step of the run.
  // After Lost: the lost run's.
  uint64_t origin() const { return origin_; }
  uint32_t period() const { return period_; }
  // While found: position of the last pushed key within its step, 0..period-1.
  uint32_t position() const { return position_; }
  // While found: complete steps since origin. After Lost: how many the lost run had.
  uint64_t repeats() const { return repeats_; }
  // While found: the step's keys, from position 0.
  std::span<const uint64_t> step() const { return step_; }
  // XXH3 of step(); 0 when not found.
  uint64_t digest() const { return digest_; }
  // What digest() says of a step of these keys (rewrite/ names a step of one call with it).
  static uint64_t digest_of(std::span<const uint64_t> keys);
  // The period and digest of the step most recently lost (what period() and digest() said just
  // before the Lost push); 0 before any loss.
  uint32_t lost_period() const { return lost_period_; }
  uint64_t lost_digest() const { return lost_digest_; }

 private:
  uint64_t key_at(uint64_t index) const { return ring_[index % ring_.size()]; }
  uint32_t remember_context(uint64_t n);
  void propose(uint64_t n, uint32_t distance);
  void lock(uint32_t period);

  uint32_t max_period_;
  std::vector<uint64_t> ring_;  // last 2 × max_period + kContextKeys keys
  // The last kContextKeys keys, written twice so that they always lie in order in one stretch.
  std::array<uint64_t, 2 * kContextKeys> window_{};

  struct LastSeen {
    uint64_t context;
    uint64_t index_plus_one;  // of the context's last key; 0: empty way
  };
  // One cache line per set; a full set forgets its least recently seen context, which only costs
  // a worse guess.
  static constexpr uint32_t kWays = 4;
  struct alignas(64) LastSeenSet {
    LastSeen way[kWays];
  };
  std::vector<LastSeenSet> last_;

  uint64_t n_ = 0;          // keys seen
  uint32_t candidate_ = 0;  // candidate period while searching, 0 = none
  uint64_t run_ = 0;        // consecutive keys with key[i] == key[i - candidate]

  uint32_t period_ = 0;  // found period, 0 = not found
  uint64_t origin_ = 0;
  uint32_t position_ = 0;
  uint64_t repeats_ = 0;
  uint64_t digest_ = 0;
  std::vector<uint64_t> step_;

  uint32_t lost_period_ = 0;
  uint64_t lost_digest_ = 0;
};

}  // namespace magi::capture
