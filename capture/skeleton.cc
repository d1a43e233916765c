// The step detector (capture/skeleton.h).
//
// Searching: a candidate period comes from the distance to the current key's most recent
// occurrence; the run counts consecutive keys equal to the key one candidate back. A run of p
// (counting the key that gave the candidate) means the last 2p keys are p-periodic: found.
// Found: each key is checked against the step; the first mismatch loses it and searching starts
// again from that key, whose previous occurrence gives the next candidate at once.
//
// Cost: push() is O(1) while searching or found. Detection adds O(p) for the period reduction
// and the step copy, paid for by the p keys the run needed, and a backward scan for the origin.
// That scan enters an earlier detection's region only as far as the two periods agree, which is
// less than their sum (Fine and Wilf) or, when one divides the other, stops within a period of
// where that detection was lost; so each key is scanned about once and memory stays fixed.
#include "capture/skeleton.h"

#include <algorithm>
#include <bit>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace magi::capture {
namespace {

// Enough slots that the distinct shapes of a real step rarely evict each other; a longer step
// of all-distinct keys still finds its period from the keys whose slots survive (a power of 2).
constexpr uint32_t kLastSeenSlots = 4096;

}  // namespace

StepDetector::StepDetector(uint32_t max_step_calls)
    : max_period_(std::max<uint32_t>(max_step_calls, 1)),
      ring_(2ull * max_period_),
      last_(kLastSeenSlots, LastSeen{0, 0}) {
  // Detection fills step_ on the call path: reserve it now so the call path never allocates.
  step_.reserve(max_period_);
}

StepDetector::Event StepDetector::push(uint64_t key) {
  const uint64_t n = n_;
  ring_[n % ring_.size()] = key;

  // Keys are hashes already, but a multiplicative mix keeps any key pattern spread over the slots.
  constexpr unsigned kShift = 64 - std::countr_zero(kLastSeenSlots);
  LastSeen& slot = last_[(key * 0x9E3779B97F4A7C15ull) >> kShift];
  uint32_t distance = 0;  // to this key's previous occurrence; 0 when unknown or beyond reach
  if (slot.index_plus_one != 0 && slot.key == key) {
    const uint64_t d = n - (slot.index_plus_one - 1);
    if (d <= max_period_) distance = static_cast<uint32_t>(d);
  }
  slot = LastSeen{key, n + 1};
  n_ = n + 1;

  if (period_ != 0) {
    const uint32_t next = position_ + 1 == period_ ? 0 : position_ + 1;
    if (key == step_[next]) {
      position_ = next;
      if (next == period_ - 1) ++repeats_;
      return Event::None;
    }
    // Lost. origin_ and repeats_ stay for the caller; searching restarts with this key. A push
    // reports one event, so a step this key would complete is reported on the next matching key.
    period_ = 0;
    position_ = 0;
    digest_ = 0;
    step_.clear();
    candidate_ = distance;
    run_ = distance != 0 ? 1 : 0;
    return Event::Lost;
  }

  if (candidate_ != 0 && key == key_at(n - candidate_)) {
    ++run_;
  } else {
    // The previous occurrence matches this key by construction, so the new run starts at 1.
    candidate_ = distance;
    run_ = distance != 0 ? 1 : 0;
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
// (A candidate from a key's most recent occurrence is already smallest; the reduction makes that
// a guarantee of found() rather than a property of how candidates happen to be chosen.)
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
  digest_ = XXH3_64bits(step_.data(), step_.size() * sizeof(uint64_t));
  reset_candidate();
}

void StepDetector::reset_candidate() {
  candidate_ = 0;
  run_ = 0;
}

}  // namespace magi::capture
