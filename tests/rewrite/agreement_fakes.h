// What the agreement unit tests share: the fake transport (counts what it serves, moves it all),
// the round and decision records an agreement writes to its trace, and the factory for a world
// whose transport and exchange are the test's.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "rewrite/agreement.h"

namespace magi::rewrite::fakes {

// The Agreement and Decision records an agreement traced, in order.
struct TracedRounds {
  std::vector<trace::AgreementRecord> rounds;
  std::vector<trace::DecisionRecord> decisions;

  // A sink appending to `to`, which must outlive the agreement.
  static TraceSink into(TracedRounds* to) {
    return [to](trace::RecordType type, const void* payload, uint32_t bytes) {
      if (type == trace::RecordType::Agreement)
        to->rounds.push_back(copy<trace::AgreementRecord>(payload, bytes));
      if (type == trace::RecordType::Decision)
        to->decisions.push_back(copy<trace::DecisionRecord>(payload, bytes));
    };
  }

 private:
  template <typename Record>
  static Record copy(const void* payload, uint32_t bytes) {
    Record r{};
    EXPECT_EQ(bytes, sizeof r);
    std::memcpy(&r, payload, std::min<size_t>(bytes, sizeof r));
    return r;
  }
};

// Serves every gather it is handed (Moved) and calls `on_gather` first, which may throw (a
// transport failing) or advance a fake clock.
class MovingTransport : public ce::Transport {
 public:
  explicit MovingTransport(std::function<void()> on_gather, int expected_ranks = 0)
      : on_gather_(std::move(on_gather)), expected_ranks_(expected_ranks) {}
  void prepare(const ce::WindowPlan& plan, ce::HandleBlob& out) override {
    bytes_ = 2 * plan.slot_bytes;
    out.bytes[0] = 0x5a;
    if (plans != nullptr) plans->push_back(plan);
  }
  const ce::SourceTable& sources() const override { return sources_; }
  void attach(std::span<const ce::HandleBlob> blobs, std::span<const ce::SourceTable>) override {
    if (expected_ranks_ > 0) {
      EXPECT_EQ(blobs.size(), static_cast<size_t>(expected_ranks_));
    }
  }
  Served gather(std::span<const ce::GatherOp> bucket, void*, Timing timing,
                ce::PartWriter*) override {
    if (timings != nullptr) timings->push_back(timing);
    if (buckets != nullptr) buckets->emplace_back(bucket.begin(), bucket.end());
    if (on_gather_) on_gather_();
    return Served::Moved;
  }
  // Where to note how each bucket was served, in order (none: not noted).
  std::vector<Timing>* timings = nullptr;
  std::vector<ce::WindowPlan>* plans = nullptr;               // likewise, each plan prepared
  std::vector<std::vector<ce::GatherOp>>* buckets = nullptr;  // likewise, each bucket's gathers
  void release() override {}
  void abandon() override {}
  size_t window_bytes() const override { return bytes_; }
  ce::WindowMemory memory() const override { return {}; }

 private:
  std::function<void()> on_gather_;
  int expected_ranks_;
  size_t bytes_ = 0;
  ce::SourceTable sources_;
};

// A factory whose transports are `transport()`'s, exchanges `exchange(rank)`'s and timers
// `timer()`'s; every communicator is on one host (locality 42).
template <typename MakeTransport, typename MakeExchange, typename MakeTimer>
TransportFactory fake_factory(MakeTransport transport, MakeExchange exchange, MakeTimer timer) {
  TransportFactory make;
  make.transport = [transport](const capture::CommInfo&) { return transport(); };
  make.exchange = [exchange](const capture::CommInfo& info, size_t bytes) {
    EXPECT_EQ(bytes, kContributionBytes) << "the fake exchanges hold standard rounds only";
    return exchange(info.rank);
  };
  make.timer = [timer] { return timer(); };
  make.locality = [](const capture::CommInfo&) { return ce::Locality{42, -1, 0}; };
  return make;
}

}  // namespace magi::rewrite::fakes
