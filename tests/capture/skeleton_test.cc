// The step detector: finds a repeating step of collective shapes, leaves prologues out, loses the
// step on the first key that breaks it, and answers the same on every rank fed the same keys.
// Steps in which no shape occurs once per step (FSDP's gathers then reduce-scatters of one shape
// each) are found, and once found are kept while the keys repeat.
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

constexpr uint32_t kContext = StepDetector::kContextKeys;

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

std::vector<uint64_t> repeated(const std::vector<uint64_t>& step, int times) {
  std::vector<uint64_t> keys;
  for (int i = 0; i < times; ++i) keys.insert(keys.end(), step.begin(), step.end());
  return keys;
}

std::vector<uint64_t> distinct_keys(size_t count, uint64_t seed) {
  std::mt19937_64 random(seed);
  std::vector<uint64_t> keys(count);
  for (uint64_t& key : keys) key = random();
  return keys;
}

struct Happened {
  uint64_t index;  // of the key whose push reported it
  Event event;
  bool operator==(const Happened&) const = default;
};

std::ostream& operator<<(std::ostream& out, const Happened& h) {
  return out << (h.event == Event::Found  ? "Found"
                 : h.event == Event::Lost ? "Lost"
                                          : "None")
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

// Keys from the start of a clean repetition to the key on which a step of `period` keys is found
// when its last context occurs once per step: two repetitions, or for a period shorter than a
// context, the period and a context.
uint64_t keys_to_find(uint64_t period) { return std::max<uint64_t>(2 * period, period + kContext); }

// Repetitions of a step of `period` keys that hold keys_to_find(period) keys.
int repetitions_to_find(uint64_t period) {
  return static_cast<int>((keys_to_find(period) + period - 1) / period);
}

// ---- found, with and without what comes before and after --------------------------------------

TEST(StepDetector, StepIsFoundOnTheKeyThatCompletesItsSecondRepetition) {
  const std::vector<uint64_t> step = keys_of("abcdefghijk");
  ASSERT_GE(step.size(), kContext) << "a step shorter than a context needs more keys";
  const int repetitions = 5;
  StepDetector detector(4096);
  const std::vector<Happened> events = feed(detector, repeated(step, repetitions));

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

// reset() forgets everything it saw: what follows is found exactly as by a new detector.
TEST(StepDetector, ResetStartsOverAsANewDetector) {
  const std::vector<uint64_t> before = repeated(distinct_keys(7, 1), 5) + keys_of("xy");
  const std::vector<uint64_t> after = keys_of("qq") + repeated(distinct_keys(5, 2), 4);
  StepDetector used(64);
  feed(used, before);
  used.reset();
  EXPECT_FALSE(used.found());
  EXPECT_EQ(used.keys_seen(), 0u);
  EXPECT_EQ(used.lost_period(), 0u);
  StepDetector fresh(64);
  EXPECT_EQ(feed(used, after), feed(fresh, after));
  EXPECT_EQ(used.period(), 5u);
  EXPECT_EQ(used.origin(), fresh.origin());
  EXPECT_EQ(used.digest(), fresh.digest());
}

TEST(StepDetector, PeriodShorterThanAContextIsFoundOnceAWholeContextHasRepeated) {
  // Two repetitions of a short step are not evidence enough: the keys must also repeat for a
  // whole context, so a step of p < kContextKeys keys is found on key p + kContextKeys - 1.
  for (uint32_t period = 1; period <= kContext + 2; ++period) {
    const std::vector<uint64_t> step = distinct_keys(period, period);
    StepDetector detector(4096);
    const std::vector<Happened> events =
        feed(detector, repeated(step, repetitions_to_find(period) + 1));
    EXPECT_EQ(events, (std::vector<Happened>{{keys_to_find(period) - 1, Event::Found}}))
        << "period " << period;
    EXPECT_EQ(detector.period(), period);
    EXPECT_EQ(detector.origin(), 0u);
    EXPECT_EQ(step_of(detector), step);
  }
}

TEST(StepDetector, PrologueIsLeftOutOfTheStep) {
  const std::vector<uint64_t> prologue = keys_of("xyz");
  const std::vector<uint64_t> step = keys_of("abcd");
  const int repetitions = repetitions_to_find(step.size()) + 1;
  StepDetector detector(4096);
  const std::vector<Happened> events =
      feed(detector, prologue + repeated(step, repetitions) + keys_of("ab"));

  EXPECT_EQ(
      events,
      (std::vector<Happened>{{prologue.size() + keys_to_find(step.size()) - 1, Event::Found}}));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.origin(), prologue.size());
  EXPECT_EQ(step_of(detector), step);
  EXPECT_EQ(detector.repeats(), static_cast<uint64_t>(repetitions));
  EXPECT_EQ(detector.position(), 1u);  // "ab" of one more step
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
  // The run that finds "aab" starts only where a whole context has repeated, yet the step has
  // repeated since key 0, and that is where its origin is.
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

TEST(StepDetector, PeriodOneIsFoundOnceAContextOfEqualKeysHasRepeated) {
  const int equal_keys = static_cast<int>(kContext) + 3;
  StepDetector detector(4096);
  const std::vector<Happened> events = feed(detector, keys_of("q") + keys_of("a", equal_keys));
  EXPECT_EQ(events, (std::vector<Happened>{{1 + keys_to_find(1) - 1, Event::Found}}));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.period(), 1u);
  EXPECT_EQ(detector.origin(), 1u);
  EXPECT_EQ(detector.repeats(), static_cast<uint64_t>(equal_keys));
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

// ---- steps in which no key occurs once --------------------------------------------------------

std::string letters(char letter, int times) {
  return std::string(static_cast<size_t>(times), letter);
}

std::string repeated_letters(std::string_view unit, int times) {
  std::string text;
  for (int i = 0; i < times; ++i) text += unit;
  return text;
}

// Feeds a prologue of distinct keys, then `repetitions` of `step`, and checks what a clean
// periodic sequence promises: the step is found by the end of its third repetition (or within
// two repetitions and a context, for a step shorter than one) with its own period, that Found is
// the last event (no Lost after it: no flip-flop), and the step is still found at the end with
// every repetition counted. Events before it can only be finds of a shorter period inside the
// step's first repetitions (a run of equal keys), each lost again.
void expect_found_and_kept(const std::vector<uint64_t>& step, int repetitions,
                           const std::string& name) {
  SCOPED_TRACE(name);
  const std::vector<uint64_t> prologue = distinct_keys(3, 99);
  StepDetector detector(4096);
  const std::vector<Happened> events = feed(detector, prologue + repeated(step, repetitions));
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back().event, Event::Found) << ::testing::PrintToString(events);
  EXPECT_LT(events.back().index,
            prologue.size() + std::max<uint64_t>(3 * step.size(), 2 * step.size() + kContext));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.period(), step.size());
  EXPECT_EQ(detector.origin(), prologue.size());
  EXPECT_EQ(step_of(detector), step);
  EXPECT_EQ(detector.repeats(), static_cast<uint64_t>(repetitions));
}

TEST(StepDetector, StepsWithoutAUniqueKeyAreFoundOnTimeAndNeverLost) {
  // The key alone proposed 1 here (the previous a, the previous b) and flip-flopped between a
  // step of one key found and lost; a context occurs once per step and proposes the period.
  for (std::string_view step : {"abba", "aabb", "aaaarrrr", "ababbab", "aabbaabbb"}) {
    const std::vector<uint64_t> keys = keys_of(step);
    StepDetector detector(4096);
    const std::vector<Happened> events = feed(detector, repeated(keys, 40));
    EXPECT_EQ(events, (std::vector<Happened>{{keys_to_find(keys.size()) - 1, Event::Found}}))
        << step;
    EXPECT_EQ(detector.period(), keys.size()) << step;
    EXPECT_EQ(step_of(detector), keys) << step;
    EXPECT_EQ(detector.repeats(), 40u) << step;
  }
}

TEST(StepDetector, GathersThenReduceScattersOfOneShapeEachAreOneStep) {
  for (int layers = 1; layers <= 64; ++layers) {
    expect_found_and_kept(keys_of(letters('a', layers) + letters('r', layers)), 12,
                          "a^" + std::to_string(layers) + " r^" + std::to_string(layers));
  }
}

TEST(StepDetector, LongRunOfOneShapeThenAnotherIsOneStep) {
  for (int run = 1; run <= 100; ++run) {
    expect_found_and_kept(keys_of(letters('a', run) + "b"), 8, "a^" + std::to_string(run) + " b");
  }
}

TEST(StepDetector, ForwardGathersThenBackwardGatherReduceScatterPairsAreOneStep) {
  // FSDP training: every layer's gather forward, then a gather and a reduce-scatter per layer
  // backward. Every pair of keys occurs more than once per step; some longer context does not.
  for (int layers = 1; layers <= 32; ++layers) {
    const std::string n = std::to_string(layers);
    expect_found_and_kept(keys_of(letters('a', layers) + repeated_letters("ar", layers)), 8,
                          "a^" + n + " (ar)^" + n);
    expect_found_and_kept(keys_of(repeated_letters("ab", layers) + repeated_letters("ac", layers)),
                          8, "(ab)^" + n + " (ac)^" + n);
  }
}

// Whether some run of kContextKeys keys of the step, read cyclically, occurs once per step.
bool has_a_context_occurring_once(const std::vector<uint64_t>& step) {
  std::vector<std::vector<uint64_t>> contexts;
  for (size_t i = 0; i < step.size(); ++i) {
    std::vector<uint64_t> context;
    for (size_t k = 0; k < kContext; ++k) context.push_back(step[(i + k) % step.size()]);
    contexts.push_back(context);
  }
  std::sort(contexts.begin(), contexts.end());
  for (size_t i = 0; i < contexts.size(); ++i) {
    const bool same_as_previous = i > 0 && contexts[i] == contexts[i - 1];
    const bool same_as_next = i + 1 < contexts.size() && contexts[i] == contexts[i + 1];
    if (!same_as_previous && !same_as_next) return true;
  }
  return false;
}

bool is_primitive(const std::vector<uint64_t>& step) {
  for (size_t q = 1; q < step.size(); ++q) {
    if (step.size() % q != 0) continue;
    const auto shifted = step.begin() + static_cast<ptrdiff_t>(q);
    if (std::equal(shifted, step.end(), step.begin())) return false;
  }
  return true;
}

TEST(StepDetector, StepIsFoundExactlyWhenOneOfItsContextsOccursOncePerStep) {
  // The rule of skeleton.h, checked both ways: random steps of a few shapes (most have such a
  // context; long ones of 2 shapes often have none), and `a^m b a^(m+1) b`, `a^m bb a^(m+1) bb`
  // (none has one once m >= kContextKeys: the documented limit).
  std::vector<std::pair<std::string, std::vector<uint64_t>>> steps;
  std::mt19937_64 random(20240611);
  for (int i = 0; i < 340; ++i) {
    const size_t shapes = 2 + random() % 3;
    const size_t length = i < 300 ? 2 + random() % 300 : 1000 + random() % 3000;
    std::vector<uint64_t> step(length);
    for (uint64_t& key : step) key = key_of(static_cast<char>('a' + random() % shapes));
    steps.emplace_back("random #" + std::to_string(i) + ", " + std::to_string(shapes) +
                           " shapes, " + std::to_string(length) + " keys",
                       step);
  }
  for (int m = 1; m <= static_cast<int>(kContext) + 4; ++m) {
    const std::string a = letters('a', m), more_a = letters('a', m + 1);
    steps.emplace_back("a^m b a^(m+1) b, m " + std::to_string(m), keys_of(a + "b" + more_a + "b"));
    steps.emplace_back("a^m bb a^(m+1) bb, m " + std::to_string(m),
                       keys_of(a + "bb" + more_a + "bb"));
  }

  int found = 0, never = 0;
  for (const auto& [name, step] : steps) {
    if (!is_primitive(step)) continue;
    if (has_a_context_occurring_once(step)) {
      ++found;
      expect_found_and_kept(step, 6, name);
      continue;
    }
    ++never;
    SCOPED_TRACE(name);
    StepDetector detector(4096);
    for (uint64_t key : distinct_keys(3, 99) + repeated(step, 6)) {
      detector.push(key);
      ASSERT_NE(detector.period(), step.size());
    }
  }
  // Both sides of the rule must be exercised, or the check proves little.
  EXPECT_GT(found, 250);
  EXPECT_GE(never, 15);
}

// ---- the limit on step length -----------------------------------------------------------------

TEST(StepDetector, StepsUpToTheLimitAreFound) {
  const uint32_t limit = 4096;
  for (uint32_t period : {limit, limit - 1}) {
    const std::vector<uint64_t> step = distinct_keys(period, period);
    StepDetector detector(limit);
    const std::vector<Happened> events = feed(detector, repeated(step, 3));
    // With this many distinct contexts some are forgotten by the table of last positions, which
    // can delay the candidate by a few keys (see KeysSharingTableSlotsOnlyDelayDetection).
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
  // Keys that interrupt the step lose it. A candidate from a context before the interruption can
  // hold across it until it meets the interruption, so the resumed step is found no earlier than
  // from a clean start, and up to about a repetition later: within three repetitions of where it
  // resumed, or two and a context for a short step.
  for (std::string_view text : {"abc", "abcdefghij", "aaaaaaaarrrrrrrr", "abba"}) {
    for (std::string_view interruption_text : {"x", "xyz"}) {
      for (size_t phase : {size_t{0}, size_t{1}, text.size() / 2}) {
        const std::vector<uint64_t> step = keys_of(text);
        // The step continues from `phase`, is interrupted, and resumes where it stopped.
        std::vector<uint64_t> rotated(step.begin() + static_cast<ptrdiff_t>(phase), step.end());
        rotated.insert(rotated.end(), step.begin(), step.begin() + static_cast<ptrdiff_t>(phase));
        const int repetitions = repetitions_to_find(step.size()) + 2;
        const std::vector<uint64_t> before =
            repeated(step, repetitions) +
            std::vector<uint64_t>(step.begin(), step.begin() + static_cast<ptrdiff_t>(phase));
        const std::vector<uint64_t> interruption = keys_of(interruption_text);
        StepDetector detector(4096);
        const std::vector<Happened> events =
            feed(detector, before + interruption + repeated(rotated, repetitions));

        SCOPED_TRACE(std::string(text) + " interrupted by " + std::string(interruption_text) +
                     " at position " + std::to_string(phase));
        const uint64_t lost_at = before.size();
        const uint64_t resumed_at = lost_at + interruption.size();
        const uint64_t p = step.size();
        ASSERT_GE(events.size(), 3u);
        EXPECT_EQ(events[0], (Happened{keys_to_find(p) - 1, Event::Found}));
        EXPECT_EQ(events[1], (Happened{lost_at, Event::Lost}));
        EXPECT_EQ(events.back().event, Event::Found);
        EXPECT_GE(events.back().index, resumed_at + keys_to_find(p) - 1);
        EXPECT_LT(events.back().index, resumed_at + std::max(3 * p, 2 * p + kContext));
        ASSERT_TRUE(detector.found());
        EXPECT_EQ(detector.period(), p);
        EXPECT_EQ(detector.origin(), resumed_at);
        EXPECT_EQ(step_of(detector), rotated);
        EXPECT_EQ(detector.repeats(), static_cast<uint64_t>(repetitions));
      }
    }
  }
}

TEST(StepDetector, KeyThatLosesTheStepCanCompleteTheNextOne) {
  // a^k b repeats, then an a comes where b should: the step is lost, yet that a ends a whole
  // context of a's that repeats one key back, so it completes a step of one key. A push reports
  // one event, so that step is reported on the next a.
  const std::vector<uint64_t> step = keys_of(letters('a', kContext) + "b");
  const int repetitions = 3;
  StepDetector detector(4096);
  const std::vector<uint64_t> keys =
      repeated(step, repetitions) + keys_of(letters('a', kContext + 3));
  const std::vector<Happened> events = feed(detector, keys);
  const uint64_t lost_at = repetitions * step.size() + kContext;
  EXPECT_EQ(events, (std::vector<Happened>{{2 * step.size() - 1, Event::Found},
                                           {lost_at, Event::Lost},
                                           {lost_at + 1, Event::Found}}));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.period(), 1u);
  EXPECT_EQ(detector.origin(), lost_at - kContext);  // the a's since the last b
  EXPECT_EQ(detector.repeats(), keys.size() - (lost_at - kContext));
}

TEST(StepDetector, AnotherStepAfterTheLossIsFound) {
  StepDetector detector(4096);
  const std::vector<uint64_t> first = keys_of("abc", repetitions_to_find(3));
  const std::vector<Happened> events =
      feed(detector, first + keys_of("pq", repetitions_to_find(2) + 1));
  ASSERT_EQ(events.size(), 3u);
  EXPECT_EQ(events[1], (Happened{first.size(), Event::Lost}));
  EXPECT_EQ(events[2], (Happened{first.size() + keys_to_find(2) - 1, Event::Found}));
  EXPECT_EQ(detector.period(), 2u);
  EXPECT_EQ(detector.origin(), first.size());
  EXPECT_EQ(step_of(detector), keys_of("pq"));
}

TEST(StepDetector, LostStepKeepsItsPeriodAndDigestReadable) {
  // A Lost record describes the step that was lost, after period() and digest() went to 0.
  const std::vector<uint64_t> first = keys_of("abcdefghij");
  const std::vector<uint64_t> second = keys_of("pqrstuvwxyz");
  StepDetector detector(4096);
  feed(detector, repeated(first, 3));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.lost_period(), 0u) << "nothing lost yet";
  EXPECT_EQ(detector.lost_digest(), 0u);

  ASSERT_EQ(detector.push(key_of('!')), Event::Lost);
  EXPECT_EQ(detector.period(), 0u);
  EXPECT_EQ(detector.digest(), 0u);
  EXPECT_EQ(detector.lost_period(), first.size());
  EXPECT_EQ(detector.lost_digest(), digest_of(first));
  EXPECT_EQ(detector.repeats(), 3u);
  EXPECT_EQ(detector.origin(), 0u);

  // They stay until the next loss, which replaces them.
  const uint64_t second_origin = detector.keys_seen();
  feed(detector, repeated(second, 3));
  ASSERT_TRUE(detector.found());
  EXPECT_EQ(detector.lost_period(), first.size());
  EXPECT_EQ(detector.lost_digest(), digest_of(first));
  ASSERT_EQ(detector.push(key_of('!')), Event::Lost);
  EXPECT_EQ(detector.lost_period(), second.size());
  EXPECT_EQ(detector.lost_digest(), digest_of(second));
  EXPECT_EQ(detector.repeats(), 3u);
  EXPECT_EQ(detector.origin(), second_origin);
}

// ---- keys -------------------------------------------------------------------------------------

TEST(StepDetector, ZeroIsAnOrdinaryKey) {
  const std::vector<uint64_t> step = {0, key_of('a'), key_of('b')};
  StepDetector detector(4096);
  const std::vector<Happened> events =
      feed(detector, repeated(step, repetitions_to_find(step.size())));
  EXPECT_EQ(events, (std::vector<Happened>{{keys_to_find(step.size()) - 1, Event::Found}}));
  EXPECT_EQ(step_of(detector), step);

  StepDetector zeros(4096);
  EXPECT_EQ(feed(zeros, std::vector<uint64_t>(keys_to_find(1), 0)),
            (std::vector<Happened>{{keys_to_find(1) - 1, Event::Found}}));
  EXPECT_EQ(zeros.period(), 1u);
}

TEST(StepDetector, KeysSharingTableSlotsOnlyDelayDetection) {
  // More distinct contexts than the table of last positions holds (4096): some must be
  // forgotten before they repeat, yet a context that survived still proposes the period, before
  // the third repetition ends.
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
    for (uint64_t times = 1 + random() % 12; times > 0; --times)
      keys.insert(keys.end(), step.begin(), step.end());
  }
  keys.resize(length);
  return keys;
}

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
    ASSERT_EQ(one.lost_period(), other.lost_period()) << "key " << i;
    ASSERT_EQ(one.lost_digest(), other.lost_digest()) << "key " << i;
  }
}

// The algorithm of skeleton.h spelt out with the whole history at hand: previous occurrences of
// a context by a backward search, periodicity by direct comparison.
class ReferenceDetector {
 public:
  explicit ReferenceDetector(uint32_t limit) : limit_(limit) {}

  Event push(uint64_t key) {
    const uint64_t n = keys_.size();
    keys_.push_back(key);
    const uint32_t distance = context_distance(n);
    if (period != 0) {
      const uint32_t next = (position + 1) % period;
      if (key == step[next]) {
        position = next;
        if (next == period - 1) ++repeats;
        return Event::None;
      }
      lost_period = period;
      lost_digest = digest_of(step);
      period = position = 0;
      step.clear();
      propose(distance);
      return Event::Lost;
    }
    if (candidate_ != 0 && key == keys_[n - candidate_]) {
      ++run_;
    } else {
      propose(distance);
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
  uint32_t lost_period = 0;
  uint64_t lost_digest = 0;

 private:
  // Distance from the context ending at key n back to where it last ended, if within the limit.
  uint32_t context_distance(uint64_t n) const {
    if (n + 1 < kContext) return 0;
    for (uint64_t d = 1; d <= limit_ && n - d + 1 >= kContext; ++d) {
      bool same = true;
      for (uint32_t i = 0; i < kContext && same; ++i) same = keys_[n - i] == keys_[n - d - i];
      if (same) return static_cast<uint32_t>(d);
    }
    return 0;
  }

  void propose(uint32_t distance) {
    candidate_ = distance;
    run_ = distance != 0 ? kContext : 0;
  }

  bool periodic(uint64_t first, uint64_t last, uint32_t q) const {
    for (uint64_t i = first + q; i <= last; ++i)
      if (keys_[i] != keys_[i - q]) return false;
    return true;
  }

  void find(uint64_t last, uint32_t p) {
    const uint64_t first = last + 1 - 2ull * p;
    uint32_t q = 1;
    while (p % q != 0 || !periodic(first, last, q)) ++q;
    const uint64_t held = 2ull * limit_ + kContext;  // keys the detector's ring holds
    const uint64_t oldest = keys_.size() > held ? keys_.size() - held : 0;
    origin = first;
    while (origin > oldest && keys_[origin - 1] == keys_[origin - 1 + q]) --origin;
    period = q;
    step.assign(keys_.begin() + static_cast<ptrdiff_t>(origin),
                keys_.begin() + static_cast<ptrdiff_t>(origin + q));
    position = static_cast<uint32_t>((last - origin) % q);
    repeats = (last - origin + 1) / q;
    candidate_ = 0;
    run_ = 0;
  }

  uint32_t limit_;
  std::vector<uint64_t> keys_;
  uint32_t candidate_ = 0;
  uint64_t run_ = 0;
};

TEST(StepDetector, MatchesTheStraightforwardReferenceOnRandomSequences) {
  // The reference remembers every context; the detector's table forgets one only once four newer
  // contexts share its set, far more than these short sequences (limit at most 8) bring within
  // reach of each other.
  int found = 0;
  int lost = 0;
  for (uint64_t seed = 1; seed <= 400; ++seed) {
    std::mt19937_64 random(seed);
    const uint32_t limit = 2 + static_cast<uint32_t>(random() % 7);
    const std::vector<uint64_t> keys = random_sequence(random, 300, limit);
    StepDetector detector(limit);
    ReferenceDetector reference(limit);
    for (size_t i = 0; i < keys.size(); ++i) {
      const Event event = detector.push(keys[i]);
      ASSERT_EQ(event, reference.push(keys[i])) << "seed " << seed << ", key " << i;
      found += event == Event::Found;
      lost += event == Event::Lost;
      ASSERT_EQ(detector.period(), reference.period) << "seed " << seed << ", key " << i;
      ASSERT_EQ(detector.repeats(), reference.repeats) << "seed " << seed << ", key " << i;
      ASSERT_EQ(detector.lost_period(), reference.lost_period) << "seed " << seed << ", key " << i;
      ASSERT_EQ(detector.lost_digest(), reference.lost_digest) << "seed " << seed << ", key " << i;
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
