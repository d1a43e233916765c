// The step detector: finds a repeating step of collective shapes, leaves prologues out, loses the
// step on the first key that breaks it, and answers the same on every rank fed the same keys.
#include "capture/skeleton.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <ostream>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace magi::capture {
namespace {

using Event = StepDetector::Event;

// Letters stand for shapes; the keys are spread over 64 bits as real shape hashes are.
uint64_t key_of(char letter) {
  const char text[2] = {letter, 0};
  return XXH3_64bits(text, 1);
}

std::vector<uint64_t> keys_of(std::string_view letters, int times = 1) {
  std::vector<uint64_t> keys;
  for (int i = 0; i < times; ++i)
    for (char letter : letters) keys.push_back(key_of(letter));
  return keys;
}

std::vector<uint64_t> operator+(std::vector<uint64_t> a, const std::vector<uint64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Happened {
  uint64_t index;  // of the key whose push reported it
  Event event;
  bool operator==(const Happened&) const = default;
};

std::ostream& operator<<(std::ostream& out, const Happened& h) {
  return out << (h.event == Event::Found ? "Found" : h.event == Event::Lost ? "Lost" : "None")
             << "@" << h.index;
}

std::vector<Happened> feed(StepDetector& detector, const std::vector<uint64_t>& keys) {
  std::vector<Happened> events;
  for (uint64_t key : keys) {
    const uint64_t index = detector.keys_seen();
    const Event event = detector.push(key);
    if (event != Event::None) events.push_back({index, event});
  }
  return events;
}

std::vector<uint64_t> step_of(const StepDetector& detector) {
  return {detector.step().begin(), detector.step().end()};
}

uint64_t digest_of(const std::vector<uint64_t>& step) {
  return XXH3_64bits(step.data(), step.size() * sizeof(uint64_t));
}

// ---- found, with and without what comes before and after --------------------------------------

TEST(StepDetector, StepIsFoundOnTheKeyThatCompletesItsSecondRepetition) {
  const std::vector<uint64_t> step = keys_of("abc");
  const int repetitions = 5;
  StepDetector detector(4096);
  const std::vector<Happened> events = feed(detector, keys_of("abc", repetitions));

  const uint64_t second_step_done = 2 * step.size() - 1;
  EXPECT_EQ(events, (std::vector<Happened>{{second_step_done, Event::Found}}));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.period(), step.size());
  EXPECT_EQ(detector.origin(), 0u);
  EXPECT_EQ(step_of(detector), step);
  EXPECT_EQ(detector.digest(), digest_of(step));
  EXPECT_EQ(detector.repeats(), static_cast<uint64_t>(repetitions));
  EXPECT_EQ(detector.position(), step.size() - 1);
}

TEST(StepDetector, PrologueIsLeftOutOfTheStep) {
  const std::vector<uint64_t> prologue = keys_of("xyz");
  const std::vector<uint64_t> step = keys_of("abcd");
  StepDetector detector(4096);
  const std::vector<Happened> events =
      feed(detector, prologue + keys_of("abcd", 3) + keys_of("ab"));

  EXPECT_EQ(events,
            (std::vector<Happened>{{prologue.size() + 2 * step.size() - 1, Event::Found}}));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.origin(), prologue.size());
  EXPECT_EQ(step_of(detector), step);
  EXPECT_EQ(detector.repeats(), 3u);
  EXPECT_EQ(detector.position(), 1u);  // "ab" of a fourth step
}

TEST(StepDetector, OriginIsTheEarliestKeyFromWhichTheKeysRepeat) {
  // The prologue "cd" happens to be the end of the step: the repetition begins at key 0, and the
  // step is reported from there, rotated.
  StepDetector detector(4096);
  feed(detector, keys_of("cd") + keys_of("abcd", 3));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.origin(), 0u);
  EXPECT_EQ(step_of(detector), keys_of("cdab"));
  EXPECT_EQ(detector.repeats(), 3u);
  EXPECT_EQ(detector.position(), 1u);
}

TEST(StepDetector, OriginReachesBackBeforeTheRunThatFoundTheStep) {
  // "aa" looks like a step of one key until b breaks it; the run that finally finds "aab" starts
  // at the first b, yet the step has repeated since key 0, and that is where its origin is.
  const int repetitions = 4;
  StepDetector detector(4096);
  const std::vector<Happened> events = feed(detector, keys_of("aab", repetitions));
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().event, Event::Found);
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.origin(), 0u);
  EXPECT_EQ(step_of(detector), keys_of("aab"));
  EXPECT_EQ(detector.repeats(), static_cast<uint64_t>(repetitions));
}

TEST(StepDetector, EpilogueLosesTheStepAndKeepsHowLongItLasted) {
  const int repetitions = 4;
  const std::vector<uint64_t> keys = keys_of("abc", repetitions) + keys_of("ab") + keys_of("z");
  StepDetector detector(4096);
  const std::vector<Happened> events = feed(detector, keys);

  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].event, Event::Found);
  EXPECT_EQ(events[1], (Happened{keys.size() - 1, Event::Lost}));
  EXPECT_FALSE(detector.found());
  EXPECT_EQ(detector.repeats(), static_cast<uint64_t>(repetitions));  // the partial step is not one
  EXPECT_EQ(detector.period(), 0u);
  EXPECT_EQ(detector.digest(), 0u);
  EXPECT_TRUE(detector.step().empty());
}

TEST(StepDetector, PeriodOneIsFoundOnTheSecondEqualKey) {
  StepDetector detector(4096);
  const std::vector<Happened> events = feed(detector, keys_of("q") + keys_of("a", 6));
  EXPECT_EQ(events, (std::vector<Happened>{{2, Event::Found}}));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.period(), 1u);
  EXPECT_EQ(detector.origin(), 1u);
  EXPECT_EQ(detector.repeats(), 6u);
  EXPECT_EQ(detector.position(), 0u);
}

TEST(StepDetector, SmallestPeriodIsReported) {
  StepDetector detector(4096);
  feed(detector, keys_of("ab", 8));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.period(), 2u);
  EXPECT_EQ(step_of(detector), keys_of("ab"));
  EXPECT_EQ(detector.repeats(), 8u);
}

// ---- the limit on step length -----------------------------------------------------------------

std::vector<uint64_t> distinct_keys(size_t count, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<uint64_t> keys(count);
  for (uint64_t& key : keys) key = random();
  return keys;
}

std::vector<uint64_t> repeated(const std::vector<uint64_t>& step, int times) {
  std::vector<uint64_t> keys;
  for (int i = 0; i < times; ++i) keys.insert(keys.end(), step.begin(), step.end());
  return keys;
}

TEST(StepDetector, StepsUpToTheLimitAreFound) {
  const uint32_t limit = 4096;
  for (uint32_t period : {limit, limit - 1}) {
    const std::vector<uint64_t> step = distinct_keys(period, period);
    StepDetector detector(limit);
    const std::vector<Happened> events = feed(detector, repeated(step, 3));
    // With this many distinct keys some share a slot of the table of last positions, which can
    // delay the candidate by a few keys (see KeysSharingTableSlotsOnlyDelayDetection).
    ASSERT_EQ(events.size(), 1u) << period;
    EXPECT_EQ(events[0].event, Event::Found);
    EXPECT_GE(events[0].index, 2ull * period - 1);
    EXPECT_LT(events[0].index, 3ull * period);
    ASSERT_TRUE(detector.found()) << period;
    EXPECT_EQ(detector.origin(), 0u);
    EXPECT_EQ(detector.period(), period);
    EXPECT_EQ(step_of(detector), step);
    EXPECT_EQ(detector.repeats(), 3u);
  }
}

TEST(StepDetector, StepLongerThanTheLimitIsNeverFound) {
  const uint32_t limit = 64;
  StepDetector detector(limit);
  const std::vector<Happened> events = feed(detector, repeated(distinct_keys(limit + 1, 7), 20));
  EXPECT_TRUE(events.empty());
  EXPECT_FALSE(detector.found());
}

// ---- losing and finding again -----------------------------------------------------------------

TEST(StepDetector, LostStepIsFoundAgainWhenItResumes) {
  const std::vector<uint64_t> step = keys_of("abc");
  const std::vector<uint64_t> before = keys_of("abc", 3);
  const std::vector<uint64_t> interruption = keys_of("x");
  StepDetector detector(4096);
  const std::vector<Happened> events = feed(detector, before + interruption + keys_of("abc", 3));

  const uint64_t lost_at = before.size();
  const uint64_t resumed_at = lost_at + interruption.size();
  EXPECT_EQ(events, (std::vector<Happened>{{2 * step.size() - 1, Event::Found},
                                           {lost_at, Event::Lost},
                                           {resumed_at + 2 * step.size() - 1, Event::Found}}));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.origin(), resumed_at);
  EXPECT_EQ(step_of(detector), step);
  EXPECT_EQ(detector.repeats(), 3u);
}

TEST(StepDetector, KeyThatLosesTheStepCanBeginTheNextOne) {
  // "ab" repeats, then "b" breaks it and repeats itself: the b that broke the step is the
  // first of the new one, which is reported on the next key since a push reports one event.
  StepDetector detector(4096);
  const std::vector<uint64_t> keys = keys_of("ab", 3) + keys_of("b", 4);
  const std::vector<Happened> events = feed(detector, keys);
  const uint64_t lost_at = 6;
  EXPECT_EQ(events, (std::vector<Happened>{{3, Event::Found},
                                           {lost_at, Event::Lost},
                                           {lost_at + 1, Event::Found}}));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.period(), 1u);
  EXPECT_EQ(detector.origin(), lost_at - 1);  // that b repeats the b of the last "ab"
  EXPECT_EQ(detector.repeats(), 5u);
}

TEST(StepDetector, AnotherStepAfterTheLossIsFound) {
  StepDetector detector(4096);
  const std::vector<uint64_t> first = keys_of("abc", 3);
  const std::vector<Happened> events = feed(detector, first + keys_of("pq", 4));
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[1], (Happened{first.size(), Event::Lost}));
  EXPECT_EQ(events[2], (Happened{first.size() + 3, Event::Found}));
  EXPECT_EQ(detector.period(), 2u);
  EXPECT_EQ(detector.origin(), first.size());
  EXPECT_EQ(step_of(detector), keys_of("pq"));
}

// ---- keys -------------------------------------------------------------------------------------

TEST(StepDetector, ZeroIsAnOrdinaryKey) {
  const std::vector<uint64_t> step = {0, key_of('a'), key_of('b')};
  StepDetector detector(4096);
  const std::vector<Happened> events = feed(detector, repeated(step, 3));
  EXPECT_EQ(events, (std::vector<Happened>{{2 * step.size() - 1, Event::Found}}));
  EXPECT_EQ(step_of(detector), step);

  StepDetector zeros(4096);
  EXPECT_EQ(feed(zeros, std::vector<uint64_t>(4, 0)), (std::vector<Happened>{{1, Event::Found}}));
  EXPECT_EQ(zeros.period(), 1u);
}

TEST(StepDetector, KeysSharingTableSlotsOnlyDelayDetection) {
  // More distinct keys than the table of last positions has slots (about 4096): some must
  // share a slot and lose their last position, yet a key whose slot survived still proposes
  // the period, before the third repetition ends.
  const uint32_t period = 5000;
  const std::vector<uint64_t> step = distinct_keys(period, 11);
  StepDetector detector(8192);
  const std::vector<Happened> events = feed(detector, repeated(step, 3));
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].event, Event::Found);
  EXPECT_GE(events[0].index, 2ull * period - 1);
  EXPECT_LT(events[0].index, 3ull * period);
  EXPECT_EQ(detector.period(), period);
  EXPECT_EQ(detector.origin(), 0u);
  EXPECT_EQ(step_of(detector), step);
}

// ---- determinism, and a straightforward reference ---------------------------------------------

const uint64_t kAlphabet[] = {0, key_of('a'), key_of('b'), key_of('c'), key_of('d'), key_of('e')};

// Structured random sequences: repeated steps of random length (sometimes over the limit) drawn
// from a small alphabet that includes 0, with noise between them.
std::vector<uint64_t> random_sequence(std::mt19937_64& random, size_t length, uint32_t limit) {
  const auto& alphabet = kAlphabet;
  const auto pick = [&](size_t letters) { return alphabet[random() % letters]; };
  std::vector<uint64_t> keys;
  while (keys.size() < length) {
    const size_t letters = 1 + random() % std::size(alphabet);
    if (random() % 3 == 0) {
      for (uint64_t noise = 1 + random() % 3; noise > 0; --noise) keys.push_back(pick(letters));
      continue;
    }
    std::vector<uint64_t> step(1 + random() % (limit + 2));
    for (uint64_t& key : step) key = pick(letters);
    for (uint64_t times = 1 + random() % 5; times > 0; --times)
      keys.insert(keys.end(), step.begin(), step.end());
  }
  keys.resize(length);
  return keys;
}

// The algorithm of skeleton.h spelt out with the whole history at hand: previous occurrences by
// a backward search, periodicity by direct comparison.
class ReferenceDetector {
 public:
  explicit ReferenceDetector(uint32_t limit) : limit_(limit) {}

  Event push(uint64_t key) {
    const uint64_t n = keys_.size();
    uint32_t distance = 0;
    for (uint64_t i = n; i-- > 0;) {
      if (keys_[i] != key) continue;
      if (n - i <= limit_) distance = static_cast<uint32_t>(n - i);
      break;
    }
    keys_.push_back(key);
    if (period != 0) {
      const uint32_t next = (position + 1) % period;
      if (key == step[next]) {
        position = next;
        if (next == period - 1) ++repeats;
        return Event::None;
      }
      period = position = 0;
      step.clear();
      candidate_ = distance;
      run_ = distance != 0;
      return Event::Lost;
    }
    if (candidate_ != 0 && key == keys_[n - candidate_]) {
      ++run_;
    } else {
      candidate_ = distance;
      run_ = distance != 0;
    }
    if (candidate_ == 0 || run_ < candidate_) return Event::None;
    find(n, candidate_);
    return Event::Found;
  }

  uint32_t period = 0;
  uint64_t origin = 0;
  uint32_t position = 0;
  uint64_t repeats = 0;
  std::vector<uint64_t> step;

 private:
  bool periodic(uint64_t first, uint64_t last, uint32_t q) const {
    for (uint64_t i = first + q; i <= last; ++i)
      if (keys_[i] != keys_[i - q]) return false;
    return true;
  }

  void find(uint64_t last, uint32_t p) {
    const uint64_t first = last + 1 - 2ull * p;
    uint32_t q = 1;
    while (p % q != 0 || !periodic(first, last, q)) ++q;
    const uint64_t oldest = keys_.size() > 2ull * limit_ ? keys_.size() - 2ull * limit_ : 0;
    origin = first;
    while (origin > oldest && keys_[origin - 1] == keys_[origin - 1 + q]) --origin;
    period = q;
    step.assign(keys_.begin() + static_cast<ptrdiff_t>(origin),
                keys_.begin() + static_cast<ptrdiff_t>(origin + q));
    position = static_cast<uint32_t>((last - origin) % q);
    repeats = (last - origin + 1) / q;
    candidate_ = run_ = 0;
  }

  uint32_t limit_;
  std::vector<uint64_t> keys_;
  uint32_t candidate_ = 0;
  uint32_t run_ = 0;
};

TEST(StepDetector, SameKeysGiveTheSameEventsAtTheSameKeys) {
  std::mt19937_64 random(20240601);
  const std::vector<uint64_t> keys = random_sequence(random, 20000, 40);
  StepDetector one(40);
  StepDetector other(40);
  for (size_t i = 0; i < keys.size(); ++i) {
    ASSERT_EQ(one.push(keys[i]), other.push(keys[i])) << "key " << i;
    ASSERT_EQ(one.period(), other.period()) << "key " << i;
    ASSERT_EQ(one.origin(), other.origin()) << "key " << i;
    ASSERT_EQ(one.digest(), other.digest()) << "key " << i;
  }
}

TEST(StepDetector, MatchesTheStraightforwardReferenceOnRandomSequences) {
  // The reference remembers every position; the detector's table forgets a key whose slot
  // another key took. So first make sure no two letters share a slot: two that did could never
  // propose their distance to each other, and "xyxy" would not be found on its last key.
  for (uint64_t x : kAlphabet)
    for (uint64_t y : kAlphabet) {
      if (x == y) continue;
      StepDetector pair(2);
      ASSERT_EQ(feed(pair, {x, y, x, y}), (std::vector<Happened>{{3, Event::Found}}))
          << "the alphabet has two keys sharing a slot; pick other letters";
    }

  int found = 0;
  int lost = 0;
  for (uint64_t seed = 1; seed <= 400; ++seed) {
    std::mt19937_64 random(seed);
    const uint32_t limit = 2 + static_cast<uint32_t>(random() % 7);
    const std::vector<uint64_t> keys = random_sequence(random, 150, limit);
    StepDetector detector(limit);
    ReferenceDetector reference(limit);
    for (size_t i = 0; i < keys.size(); ++i) {
      const Event event = detector.push(keys[i]);
      ASSERT_EQ(event, reference.push(keys[i])) << "seed " << seed << ", key " << i;
      found += event == Event::Found;
      lost += event == Event::Lost;
      ASSERT_EQ(detector.period(), reference.period) << "seed " << seed << ", key " << i;
      ASSERT_EQ(detector.repeats(), reference.repeats) << "seed " << seed << ", key " << i;
      if (!detector.found()) continue;
      ASSERT_EQ(detector.origin(), reference.origin) << "seed " << seed << ", key " << i;
      ASSERT_EQ(detector.position(), reference.position) << "seed " << seed << ", key " << i;
      ASSERT_EQ(step_of(detector), reference.step) << "seed " << seed << ", key " << i;
      ASSERT_EQ(detector.digest(), digest_of(reference.step)) << "seed " << seed << ", key " << i;
      // What "found" promises, checked against the keys themselves: every key since the origin
      // repeats the key one period earlier, and the step is the keys from the origin.
      for (uint64_t k = detector.origin() + detector.period(); k <= i; ++k)
        ASSERT_EQ(keys[k], keys[k - detector.period()]) << "seed " << seed << ", key " << i;
    }
  }
  // The sequences must exercise both transitions, or the comparison proves little.
  EXPECT_GT(found, 100);
  EXPECT_GT(lost, 100);
}

}  // namespace
}  // namespace magi::capture
