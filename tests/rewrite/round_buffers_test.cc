// The round-buffer pool alone, in one process (rewrite/round_buffers.h): buffers are reused from
// round to round, freed only once their round completed, and never waited for at the end.
#include "rewrite/round_buffers.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace magi::rewrite {
namespace {

// What became of the fake buffers: how many were made, and which were freed.
struct Ledger {
  int made = 0;
  std::vector<int> freed;
};

class FakeExchange : public ce::Exchange {
 public:
  FakeExchange(int id, Ledger& ledger) : id_(id), ledger_(ledger) {}
  ~FakeExchange() override { ledger_.freed.push_back(id_); }
  void* send_buffer() override { return nullptr; }
  void* recv_buffer() override { return nullptr; }
  void* stream() override { return nullptr; }
  void stage(std::span<const uint8_t>) override {}
  void issued() override {}
  bool ready() override { return complete; }
  std::span<const uint8_t> result() override { return {}; }

  bool complete = false;  // whether its round's all-gather completed

 private:
  int id_;
  Ledger& ledger_;
};

std::unique_ptr<ce::Exchange> fake(int id, Ledger& ledger, bool complete = false) {
  auto exchange = std::make_unique<FakeExchange>(id, ledger);
  exchange->complete = complete;
  return exchange;
}

// A maker of new buffers for take(), numbered from 100.
auto maker(Ledger& ledger) {
  return [&ledger] { return fake(100 + ledger.made++, ledger, true); };
}

TEST(RoundBuffers, TheNextRoundTakesTheReadRoundsBuffersInsteadOfMakingNew) {
  Ledger ledger;
  RoundBuffers pool(0xc0ffee);
  std::unique_ptr<ce::Exchange> first = pool.take(maker(ledger));
  EXPECT_EQ(ledger.made, 1);
  ce::Exchange* const buffers = first.get();
  pool.keep_spare(first);
  EXPECT_EQ(first, nullptr);
  const std::unique_ptr<ce::Exchange> second = pool.take(maker(ledger));
  EXPECT_EQ(second.get(), buffers);
  EXPECT_EQ(ledger.made, 1);
  EXPECT_TRUE(ledger.freed.empty());
}

TEST(RoundBuffers, OneSpareIsKeptAndARoundReadBesideItKeepsItsOwnBuffers) {
  Ledger ledger;
  RoundBuffers pool(0xc0ffee);
  std::unique_ptr<ce::Exchange> a = fake(1, ledger, true), b = fake(2, ledger, true);
  pool.keep_spare(a);
  pool.keep_spare(b);
  EXPECT_EQ(a, nullptr);
  ASSERT_NE(b, nullptr);  // its owner frees it
  b.reset();
  EXPECT_EQ(ledger.freed, std::vector<int>{2});
}

TEST(RoundBuffers, RetiredBuffersAreFreedOnlyOnceTheirRoundCompleted) {
  Ledger ledger;
  RoundBuffers pool(0xc0ffee);
  auto first = fake(1, ledger), second = fake(2, ledger);
  FakeExchange& one = static_cast<FakeExchange&>(*first);
  FakeExchange& two = static_cast<FakeExchange&>(*second);
  pool.retire(std::move(first));
  pool.retire(std::move(second));
  pool.free_ready();
  EXPECT_TRUE(ledger.freed.empty());
  EXPECT_TRUE(pool.any_retired());

  one.complete = true;
  pool.free_ready();  // the first completed becomes the spare
  EXPECT_TRUE(ledger.freed.empty());
  EXPECT_TRUE(pool.any_retired());

  two.complete = true;
  pool.free_ready();  // a spare is kept already: freed
  EXPECT_EQ(ledger.freed, std::vector<int>{2});
  EXPECT_FALSE(pool.any_retired());
  EXPECT_EQ(pool.take(maker(ledger)).get(), &one);
  EXPECT_EQ(ledger.made, 0);
}

// A static plan's publish round is larger: its buffers are kept apart from the standard spare,
// reused by the next publish of the same size, and replaced by those of a plan of another size.
TEST(RoundBuffers, ALargerRoundsBuffersAreKeptApartAndReusedOnlyAtTheirSize) {
  Ledger ledger;
  RoundBuffers pool(0xc0ffee);
  const size_t large = 4 * kContributionBytes, larger = 8 * kContributionBytes;
  std::unique_ptr<ce::Exchange> standard = fake(1, ledger, true);
  ce::Exchange* const standard_buffers = standard.get();
  pool.keep_spare(standard);
  std::unique_ptr<ce::Exchange> publish = pool.take(maker(ledger), large);  // made: 100
  EXPECT_EQ(ledger.made, 1);  // not the standard spare
  ce::Exchange* const publish_buffers = publish.get();
  pool.keep_spare(publish, large);
  EXPECT_EQ(publish, nullptr);
  std::unique_ptr<ce::Exchange> again = pool.take(maker(ledger), large);
  EXPECT_EQ(again.get(), publish_buffers);
  std::unique_ptr<ce::Exchange> next = pool.take(maker(ledger));
  EXPECT_EQ(next.get(), standard_buffers);
  EXPECT_EQ(ledger.made, 1);

  // A plan of another size: its buffers replace the older large ones, which are freed.
  pool.keep_spare(again, large);
  std::unique_ptr<ce::Exchange> other = pool.take(maker(ledger), larger);  // made: 101
  EXPECT_EQ(ledger.made, 2);
  pool.keep_spare(other, larger);
  EXPECT_EQ(ledger.freed, std::vector<int>{100});
  std::unique_ptr<ce::Exchange> reused = pool.take(maker(ledger), larger);
  EXPECT_EQ(ledger.made, 2);
  std::unique_ptr<ce::Exchange> anew = pool.take(maker(ledger), large);  // made: 102
  EXPECT_EQ(ledger.made, 3);
}

TEST(RoundBuffers, RetiringNoBuffersRetiresNothing) {
  RoundBuffers pool(0xc0ffee);
  pool.retire(nullptr);
  EXPECT_FALSE(pool.any_retired());
}

// Reading a round may issue the next one (a refinement, a publish), which takes the spare first;
// or leave by an exception. Either way the read round's buffers are kept once it is over.
TEST(RoundBuffers, AReadRoundsBuffersAreKeptWhateverPathItsReadingTakes) {
  Ledger ledger;
  RoundBuffers pool(0xc0ffee);
  std::unique_ptr<ce::Exchange> spare = fake(1, ledger, true);
  pool.keep_spare(spare);
  std::unique_ptr<ce::Exchange> read = fake(2, ledger, true);
  ce::Exchange* const read_buffers = read.get();
  std::unique_ptr<ce::Exchange> next;
  {
    const RoundBuffers::KeepWhenRead keep(pool, read);
    next = pool.take(maker(ledger));  // the spare: the read round still holds its own
    EXPECT_NE(read, nullptr);
  }
  EXPECT_EQ(read, nullptr);
  EXPECT_EQ(pool.take(maker(ledger)).get(), read_buffers);

  std::unique_ptr<ce::Exchange> thrown_from = fake(3, ledger, true);
  ce::Exchange* const thrown_buffers = thrown_from.get();
  try {
    const RoundBuffers::KeepWhenRead keep(pool, thrown_from);
    throw std::runtime_error("a reading that fails");
  } catch (const std::runtime_error&) {}
  EXPECT_EQ(pool.take(maker(ledger)).get(), thrown_buffers);
  EXPECT_EQ(ledger.made, 0);
}

TEST(RoundBuffers, ARoundStillInFlightAtTheEndIsLeftAllocatedAndSaidOnce) {
  Ledger ledger;
  auto in_flight = fake(1, ledger);
  FakeExchange* const left = static_cast<FakeExchange*>(in_flight.get());
  testing::internal::CaptureStderr();
  {
    RoundBuffers pool(0xc0ffee);
    pool.retire(std::move(in_flight));
    pool.retire(fake(2, ledger, true));
    pool.free_ready();
    pool.retire(fake(3, ledger, true));  // completed, not yet collected
  }
  const std::string log = testing::internal::GetCapturedStderr();
  std::sort(ledger.freed.begin(), ledger.freed.end());
  EXPECT_EQ(ledger.freed, (std::vector<int>{2, 3}));  // never the one in flight
  size_t warnings = 0;
  for (size_t at = log.find("still in flight"); at != std::string::npos;
       at = log.find("still in flight", at + 1))
    ++warnings;
  EXPECT_EQ(warnings, 1u) << log;
  EXPECT_NE(log.find("comm 000000c0ffee: an agreement round was still in flight at destroy; its "
                     "buffers are left allocated"),
            std::string::npos)
      << log;
  delete left;  // NCCL's, in the library; the test's to free
}

}  // namespace
}  // namespace magi::rewrite
