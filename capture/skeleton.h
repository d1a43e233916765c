// Step detection: finds the repeating step of a communicator's collective sequence.
//
// Keys are rank-independent shapes (op, datatype, count, root, reduction op), so every rank of a
// communicator that issues the same collectives runs this deterministic detector on the same keys
// and reaches the same answer at the same call: later stages rely on that to pick agreement
// points without talking.
//
// O(1) per key and bounded memory, whatever the run length: a ring of the last 2 × max_step keys
// and a fixed table of last positions per key. A candidate period p comes from the distance to
// the key's previous occurrence; each key then either extends the run (key[n] == key[n-p]) or
// resets it. A run of p matches after the first p keys means two full steps: the step is found,
// then reduced to its smallest period. While found, a mismatch loses it and detection restarts.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace magi::capture {

class StepDetector {
 public:
  enum class Event : uint8_t { None, Found, Lost };

  explicit StepDetector(uint32_t max_step_calls);

  // Feeds the next collective's shape key.
  Event push(uint64_t key);

  bool found() const { return period_ != 0; }
  uint64_t keys_seen() const { return n_; }
  // While found: index (into the key sequence) of the first key of the first step of the run.
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

 private:
  uint64_t key_at(uint64_t index) const { return ring_[index % ring_.size()]; }
  void lock(uint32_t period);
  void reset_candidate();

  uint32_t max_period_;
  std::vector<uint64_t> ring_;  // last 2 × max_period keys
  struct LastSeen {
    uint64_t key;
    uint64_t index_plus_one;  // 0: empty slot
  };
  std::vector<LastSeen> last_;  // direct-mapped; a collision only costs a worse guess

  uint64_t n_ = 0;          // keys seen
  uint32_t candidate_ = 0;  // candidate period while searching, 0 = none
  uint64_t run_ = 0;        // consecutive keys with key[i] == key[i - candidate]

  uint32_t period_ = 0;     // found period, 0 = not found
  uint64_t origin_ = 0;
  uint32_t position_ = 0;
  uint64_t repeats_ = 0;
  uint64_t digest_ = 0;
  std::vector<uint64_t> step_;
};

}  // namespace magi::capture
