// The step detector (capture/skeleton.h).
//
// Searching: the candidate period is the distance from the current context (the last
// kContextKeys keys) back to where it last ended, checked key by key, so the run starts with the
// kContextKeys keys that match; each later key equal to the key one candidate back extends the
// run. A run of p means the last 2p keys are p-periodic: found. Found: each key is checked against
// the step; the first mismatch loses it and searching starts again from that key, whose context
// gives the next candidate at once. Contexts are recorded at every key, found or not, so the
// table always holds their latest ends.
//
// Cost: push() is O(1) while searching or found: one hash of the context, one cache line of the
// table, and a check of kContextKeys keys when a candidate is taken. Detection adds O(p) for the
// period reduction and the step copy, paid for by the p keys the run needed, and a backward scan
// for the origin. That scan enters an earlier detection's region only as far as the two periods
// agree, which is less than their sum (Fine and Wilf) or, when one divides the other, stops
// within a period of where that detection was lost; so each key is scanned about once and memory
// stays fixed.
#include "capture/skeleton.h"

#include <algorithm>
#include <bit>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace magi::capture {
namespace {

// Enough sets that the distinct contexts of a real step rarely evict each other; a longer step
// of all-distinct contexts still finds its period from the contexts that survive (a power of 2).
constexpr uint32_t kLastSeenSets = 1024;

}  // namespace

StepDetector::StepDetector(uint32_t max_step_calls)
    : max_period_(std::max<uint32_t>(max_step_calls, 1)),
      // Two steps of the longest for lock(), and a context more for propose() to check one
      // ending max_period back when max_period is shorter than a context.
      ring_(2ull * max_period_ + kContextKeys),
      last_(kLastSeenSets, LastSeenSet{}) {
  // Detection fills step_ on the call path: reserve it now so the call path never allocates.
  step_.reserve(max_period_);
}

// The ring needs no clearing: only keys pushed since (indices below n_) are ever read.
void StepDetector::reset() {
  window_.fill(0);
  std::fill(last_.begin(), last_.end(), LastSeenSet{});
  n_ = 0;
  candidate_ = 0;
  run_ = 0;
  period_ = 0;
  origin_ = 0;
  position_ = 0;
  repeats_ = 0;
  digest_ = 0;
  step_.clear();
  lost_period_ = 0;
  lost_digest_ = 0;
}

// Records that the context ending at key n occurred, and returns the distance to its previous
// occurrence: 0 when there is none within max_period.
uint32_t StepDetector::remember_context(uint64_t n) {
  const uint64_t* context = &window_[(n + 1) % kContextKeys];
  const uint64_t hash = XXH3_64bits(context, kContextKeys * sizeof(uint64_t));
  constexpr unsigned kShift = 64 - std::countr_zero(kLastSeenSets);
  LastSeen* ways = last_[hash >> kShift].way;
  LastSeen* oldest = &ways[0];
  for (uint32_t w = 0; w < kWays; ++w) {
    LastSeen& way = ways[w];
    if (way.index_plus_one != 0 && way.context == hash) {
      const uint64_t distance = n - (way.index_plus_one - 1);
      way.index_plus_one = n + 1;
      return distance <= max_period_ ? static_cast<uint32_t>(distance) : 0;
    }
    if (way.index_plus_one < oldest->index_plus_one) oldest = &way;
  }
  *oldest = LastSeen{hash, n + 1};
  return 0;
}

// Takes `distance` as the candidate if the context ending at key n really repeats the one that
// distance back (equal hashes of different keys only cost this check).
void StepDetector::propose(uint64_t n, uint32_t distance) {
  candidate_ = 0;
  run_ = 0;
  if (distance == 0) return;
  for (uint32_t i = 0; i < kContextKeys; ++i)
    if (key_at(n - i) != key_at(n - i - distance)) return;
  candidate_ = distance;
  run_ = kContextKeys;
}

StepDetector::Event StepDetector::push(uint64_t key) {
  const uint64_t n = n_;
  ring_[n % ring_.size()] = key;
  window_[n % kContextKeys] = key;
  window_[n % kContextKeys + kContextKeys] = key;
  n_ = n + 1;
  const uint32_t distance = n + 1 >= kContextKeys ? remember_context(n) : 0;

  if (period_ != 0) {
    const uint32_t next = position_ + 1 == period_ ? 0 : position_ + 1;
    if (key == step_[next]) {
      position_ = next;
      if (next == period_ - 1) ++repeats_;
      return Event::None;
    }
    // Lost. origin_ and repeats_ stay for the caller, and the step's period and digest move to
    // lost_*; searching restarts with this key. A push reports one event, so a step this key
    // would complete is reported on the next matching key.
    lost_period_ = period_;
    lost_digest_ = digest_;
    period_ = 0;
    position_ = 0;
    digest_ = 0;
    step_.clear();
    propose(n, distance);
    return Event::Lost;
  }

  if (candidate_ != 0 && key == key_at(n - candidate_)) {
    ++run_;
  } else {
    propose(n, distance);
  }
  if (candidate_ != 0 && run_ >= candidate_) {
    lock(candidate_);
    return Event::Found;
  }
  return Event::None;
}

// The last 2p keys are p-periodic. Reduces p to the smallest period q of the step (which divides
// p), then takes as origin the earliest index the ring still holds from which every key equals
// the key q before it: a prologue is left out, and the step starts where the repetition began.
// (A candidate from a context's most recent occurrence is usually already smallest; the
// reduction makes that a guarantee of found() rather than a property of how candidates happen to
// be chosen.)
void StepDetector::lock(uint32_t p) {
  const uint64_t last = n_ - 1;
  const uint64_t first_of_step = last + 1 - p;

  // Smallest period of the step as a cyclic sequence: the prefix function of its p keys gives
  // the smallest period s of the string; the step repeats a shorter unit exactly when s divides
  // p. step_ is the scratch for the prefix function before it receives the step.
  step_.resize(p);
  step_[0] = 0;
  for (uint32_t i = 1; i < p; ++i) {
    uint64_t k = step_[i - 1];
    const uint64_t key = key_at(first_of_step + i);
    while (k > 0 && key != key_at(first_of_step + k)) k = step_[k - 1];
    if (key == key_at(first_of_step + k)) ++k;
    step_[i] = k;
  }
  const uint32_t shortest = p - static_cast<uint32_t>(step_[p - 1]);
  const uint32_t q = p % shortest == 0 ? shortest : p;

  const uint64_t oldest = n_ > ring_.size() ? n_ - ring_.size() : 0;
  uint64_t origin = last + 1 - 2ull * p;
  while (origin > oldest && key_at(origin - 1) == key_at(origin - 1 + q)) --origin;

  step_.resize(q);
  for (uint32_t i = 0; i < q; ++i) step_[i] = key_at(origin + i);
  period_ = q;
  origin_ = origin;
  position_ = static_cast<uint32_t>((last - origin) % q);
  repeats_ = (last - origin + 1) / q;
  digest_ = digest_of(step_);
  candidate_ = 0;
  run_ = 0;
}

uint64_t StepDetector::digest_of(std::span<const uint64_t> keys) {
  return XXH3_64bits(keys.data(), keys.size() * sizeof(uint64_t));
}

}  // namespace magi::capture
