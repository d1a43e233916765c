// What the tests of a communicator's round units share (the round channel, the hello gate, the
// commit): rank 0 of a small communicator whose rounds run on fake exchanges (each peer's
// contribution is a copy of rank 0's, which the test may rewrite), a fake NCCL that counts the
// rounds launched and may refuse them, the calling thread's group as the test sets it, and the
// trace's Agreement records.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

#include "rewrite/round_channel.h"
#include "tests/rewrite/agreement_fakes.h"
#include "tests/support/options_env.h"

namespace magi::rewrite::fakes {

inline constexpr int kRoundRanks = 3;

// The state the fake NCCL and exchanges reach (their entry points are plain functions).
struct RoundWorld : TracedRounds {
  std::vector<Contribution> staged;  // rank 0's contribution to each round, in order
  std::function<void(int rank, Contribution&)> peer;  // rewrites a peer's copy of rank 0's
  int launched = 0;                                   // rounds' all-gathers NCCL was asked for
  ncclResult_t nccl_answer = ncclSuccess;
  bool exchange_throws = false;  // making a round's buffers fails
  bool ready = true;             // the rounds' all-gathers completed
  int results_read = 0;
  int made = 0;  // rounds' buffers made (not reused)
  GroupView group;

  static RoundWorld*& current() {
    static RoundWorld* world = nullptr;
    return world;
  }
};

class RoundExchange : public ce::Exchange {
 public:
  RoundExchange() : send_(kContributionBytes), recv_(kRoundRanks * kContributionBytes) {}
  void* send_buffer() override { return send_.data(); }
  void* recv_buffer() override { return recv_.data(); }
  void* stream() override { return nullptr; }
  void stage(std::span<const uint8_t> bytes) override {
    std::memcpy(send_.data(), bytes.data(), bytes.size());
    Contribution mine;
    EXPECT_TRUE(Contribution::parse(bytes, mine));
    RoundWorld::current()->staged.push_back(mine);
  }
  void issued() override {}
  bool ready() override { return RoundWorld::current()->ready; }
  std::span<const uint8_t> result() override {
    RoundWorld& w = *RoundWorld::current();
    ++w.results_read;
    Contribution mine;
    EXPECT_TRUE(Contribution::parse(send_, mine));
    for (int r = 0; r < kRoundRanks; ++r) {
      Contribution c = mine;
      c.header.rank = r;
      if (r != 0 && w.peer) w.peer(r, c);
      c.serialize(std::span<uint8_t>(recv_).subspan(static_cast<size_t>(r) * kContributionBytes,
                                                    kContributionBytes));
    }
    return recv_;
  }

 private:
  std::vector<uint8_t> send_;
  std::vector<uint8_t> recv_;
};

inline ncclResult_t round_all_gather(const void*, void*, size_t, ncclDataType_t, ncclComm_t,
                                     cudaStream_t) {
  ++RoundWorld::current()->launched;
  return RoundWorld::current()->nccl_answer;
}
inline ncclResult_t no_group_call() { return ncclSuccess; }

inline capture::CommInfo round_comm_info() {
  return {0xc0ffee, 0, 0, kRoundRanks, -1, capture::CommOrigin::InitRank, false};
}

// Rank 0's world: `transport` makes the plans' transports (none by default).
inline AgreementWorld round_world(const Options& options, RoundWorld& state,
                                  std::function<std::unique_ptr<ce::Transport>()> transport = {}) {
  RoundWorld::current() = &state;
  TransportFactory make = fake_factory(
      [transport]() -> std::unique_ptr<ce::Transport> {
        if (!transport) throw Error(ErrorKind::Usage, "no transport in this test");
        return transport();
      },
      [](int) -> std::unique_ptr<ce::Exchange> {
        if (RoundWorld::current()->exchange_throws)
          throw Error(ErrorKind::System, "no memory for a round");
        ++RoundWorld::current()->made;
        return std::make_unique<RoundExchange>();
      },
      []() -> std::unique_ptr<ce::CompletionTimer> { return nullptr; });
  return AgreementWorld{options,
                        {round_all_gather, no_group_call, no_group_call},
                        std::move(make),
                        [] { return RoundWorld::current()->group; },
                        TracedRounds::into(&state)};
}

inline Options round_options(std::map<std::string, std::string> env = {}) {
  env.emplace("MAGI_BACKEND", "host");
  return test::options_from(env);
}

}  // namespace magi::rewrite::fakes
