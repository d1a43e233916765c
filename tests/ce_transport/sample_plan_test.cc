// Which lines a static binding's check compares (ce_transport/sample_plan.h): where they lie,
// the short last line, that P = stride / 256 consecutive checks cover every byte, at most 64 KiB
// a set, and shards smaller than a line.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "ce_transport/sample_plan.h"

namespace magi::ce {
namespace {

constexpr size_t kLine = SamplePlan::kLine;

// Every line of `set` lies inside a shard of `bytes`, full lines before the short one.
void expect_well_formed(const SampleSet& set, size_t bytes) {
  for (size_t i = 0; i < set.lines(); ++i) {
    EXPECT_LE(set.offset(i) + set.line_bytes(i), bytes) << "line " << i;
    EXPECT_GT(set.line_bytes(i), 0u) << "line " << i;
  }
  EXPECT_LT(set.tail_bytes, kLine);
  EXPECT_LE(set.bytes(), SamplePlan::kMaxSetBytes);
  EXPECT_LE(set.lines(), SamplePlan::kMaxLines);
}

// How many times each byte of a shard of `bytes` is compared by the sweeps of checks
// first..first+count-1.
std::vector<int> sweep_coverage(size_t bytes, uint64_t first, uint64_t count) {
  const SamplePlan plan(bytes);
  std::vector<int> seen(bytes, 0);
  for (uint64_t k = first; k < first + count; ++k) {
    const SampleSet set = plan.sweep(k);
    expect_well_formed(set, bytes);
    for (size_t i = 0; i < set.lines(); ++i)
      for (size_t b = 0; b < set.line_bytes(i); ++b) ++seen[set.offset(i) + b];
  }
  return seen;
}

TEST(SamplePlan, LinesStrideAndAnchorOfALargeShard) {
  const SamplePlan plan(size_t{1} << 30);  // 1 GiB: 256 lines, 4 MiB apart
  EXPECT_EQ(plan.lines(), 256u);
  EXPECT_EQ(plan.stride(), size_t{4} << 20);
  EXPECT_EQ(plan.sweep_period(), (size_t{4} << 20) / kLine);
  const SampleSet anchor = plan.anchor();
  EXPECT_EQ(anchor.first, 0u);
  EXPECT_EQ(anchor.rows, 256u);
  EXPECT_EQ(anchor.tail_bytes, 0u);
  EXPECT_EQ(anchor.offset(1), size_t{4} << 20);
  EXPECT_EQ(anchor.offset(255), size_t{255} * (4 << 20));
  EXPECT_EQ(anchor.bytes(), SamplePlan::kMaxSetBytes);
  // The sweep moves one line a check, and comes back to the anchor after P checks.
  EXPECT_EQ(plan.sweep(1).first, kLine);
  EXPECT_EQ(plan.sweep(7).offset(3), 7 * kLine + 3 * (size_t{4} << 20));
  EXPECT_EQ(plan.sweep(plan.sweep_period()).first, 0u);
  EXPECT_EQ(plan.sweep(plan.sweep_period() + 2).first, 2 * kLine);
}

TEST(SamplePlan, TheLastLineIsShortWhereTheShardEndsInsideIt) {
  // 1000 bytes: 4 lines, 256 apart; the last one holds bytes 768..999.
  const SamplePlan small(1000);
  EXPECT_EQ(small.lines(), 4u);
  EXPECT_EQ(small.stride(), kLine);
  const SampleSet a = small.anchor();
  EXPECT_EQ(a.rows, 3u);
  EXPECT_EQ(a.tail_bytes, 232u);
  EXPECT_EQ(a.offset(3), 768u);
  EXPECT_EQ(a.bytes(), 1000u);
  // 1 MiB + 100: stride rounded up (4352), so 256 lines reach past the end; the sweep's lines
  // past the end are left out and the one across it is short.
  const size_t bytes = (size_t{1} << 20) + 100;
  const SamplePlan big(bytes);
  EXPECT_EQ(big.lines(), 256u);
  EXPECT_EQ(big.stride() % kLine, 0u);
  EXPECT_GE(big.lines() * big.stride(), bytes);
  bool some_short = false;
  for (uint64_t k = 0; k < big.sweep_period(); ++k) {
    const SampleSet set = big.sweep(k);
    expect_well_formed(set, bytes);
    some_short = some_short || set.tail_bytes != 0;
  }
  EXPECT_TRUE(some_short);
}

TEST(SamplePlan, EveryPConsecutiveChecksCoverEveryByte) {
  for (const size_t bytes :
       {size_t{1}, size_t{255}, size_t{256}, size_t{257}, size_t{1000}, size_t{4099}, size_t{65536},
        size_t{65537}, size_t{76800}, size_t{300'001}, size_t{1} << 20, (size_t{1} << 20) + 100,
        size_t{3} << 20}) {
    const SamplePlan plan(bytes);
    const uint64_t p = plan.sweep_period();
    for (const uint64_t first : {uint64_t{0}, uint64_t{5}}) {
      const std::vector<int> seen = sweep_coverage(bytes, first, p);
      size_t missed = 0;
      for (const int n : seen) missed += n == 0 ? 1 : 0;
      EXPECT_EQ(missed, 0u) << bytes << " bytes, checks " << first << ".." << first + p - 1;
    }
    // One check fewer leaves some byte out (unless one check covers the whole shard).
    if (p > 1) {
      const std::vector<int> seen = sweep_coverage(bytes, 0, p - 1);
      size_t missed = 0;
      for (const int n : seen) missed += n == 0 ? 1 : 0;
      EXPECT_GT(missed, 0u) << bytes;
    }
  }
}

TEST(SamplePlan, ASetIsAtMost64KiB) {
  for (size_t bytes = 1; bytes < (size_t{1} << 34); bytes = bytes * 3 + 7) {
    const SamplePlan plan(bytes);
    EXPECT_LE(plan.lines(), SamplePlan::kMaxLines);
    expect_well_formed(plan.anchor(), bytes);
    expect_well_formed(plan.sweep(plan.sweep_period() / 2 + 1), bytes);
    expect_well_formed(plan.sweep(plan.sweep_period() - 1), bytes);
  }
  // Up to 64 KiB a shard is compared whole at every check.
  for (const size_t bytes : {size_t{300}, size_t{65536}}) {
    const SamplePlan plan(bytes);
    EXPECT_EQ(plan.sweep_period(), 1u);
    EXPECT_EQ(plan.anchor().bytes(), bytes);
  }
}

TEST(SamplePlan, ShardsSmallerThanALineAreOneShortLine) {
  for (const size_t bytes : {size_t{1}, size_t{3}, size_t{255}}) {
    const SamplePlan plan(bytes);
    EXPECT_EQ(plan.lines(), 1u);
    EXPECT_EQ(plan.sweep_period(), 1u);
    const SampleSet a = plan.anchor();
    EXPECT_EQ(a.rows, 0u);
    EXPECT_EQ(a.tail_bytes, bytes);
    EXPECT_EQ(a.lines(), 1u);
    EXPECT_EQ(a.offset(0), 0u);
  }
  const SamplePlan empty(0);
  EXPECT_EQ(empty.lines(), 0u);
  EXPECT_EQ(empty.anchor().lines(), 0u);
  EXPECT_EQ(empty.sweep(3).bytes(), 0u);
}

TEST(SamplePlan, SameLinesLooksOnlyAtTheSetsLines) {
  const size_t bytes = size_t{1} << 20;
  std::vector<uint8_t> shard(bytes, 1), binding(bytes, 1);
  const SamplePlan plan(bytes);
  EXPECT_TRUE(same_lines(shard.data(), binding.data(), plan.anchor()));
  shard[plan.stride() + 300] = 2;  // between anchor lines, on sweep 1's second line
  EXPECT_TRUE(same_lines(shard.data(), binding.data(), plan.anchor()));
  EXPECT_FALSE(same_lines(shard.data(), binding.data(), plan.sweep(1)));
  EXPECT_TRUE(same_lines(shard.data(), binding.data(), plan.sweep(2)));
  shard[bytes - 1] = 2;  // the shard's last byte: on the last line of the last sweep
  EXPECT_FALSE(same_lines(shard.data(), binding.data(), plan.sweep(plan.sweep_period() - 1)));
}

}  // namespace
}  // namespace magi::ce
