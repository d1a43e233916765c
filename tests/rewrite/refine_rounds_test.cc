// Refined steps, with every rank of one communicator played in this process, call by call in
// lockstep: each rank's round bytes go to a table shared by the fake exchanges, so every rank
// reads what every rank really contributed. The program's step is, by shapes, one all-gather;
// by each rank's own facts it is L layers, each with its own send buffer. Buffers are part of a
// gather's key with static weights only: there the step is refined; the default mode moves the
// one position as it is.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "rewrite/agreement.h"
#include "tests/rewrite/agreement_fakes.h"
#include "tests/support/options_env.h"

namespace magi::rewrite {
namespace {

constexpr int kRanks = 4;
constexpr int kLayers = 4;
constexpr uint64_t kDigest = 0x5a3e;
constexpr size_t kShard = 256;  // floats

using Kind = Route::Kind;

// Every rank's contribution to each round, by (round number, kind: the rounds of one agreement
// share a number) then rank.
using RoundTable = std::map<std::pair<uint32_t, uint8_t>, std::vector<std::vector<uint8_t>>>;
RoundTable* g_rounds = nullptr;

ncclResult_t fake_all_gather(const void*, void*, size_t, ncclDataType_t, ncclComm_t, cudaStream_t) {
  return ncclSuccess;
}
ncclResult_t fake_group() { return ncclSuccess; }

class TableExchange : public ce::Exchange {
 public:
  explicit TableExchange(int rank) : rank_(rank), send_(kContributionBytes) {}
  void* send_buffer() override { return send_.data(); }
  void* recv_buffer() override { return recv_.data(); }
  void* stream() override { return nullptr; }
  void stage(std::span<const uint8_t> bytes) override {
    Contribution c;
    EXPECT_TRUE(Contribution::parse(bytes, c));
    round_ = {c.header.round, c.header.kind};
    auto& slots = (*g_rounds)[round_];
    slots.resize(kRanks);
    slots[static_cast<size_t>(rank_)].assign(bytes.begin(), bytes.end());
  }
  void issued() override {}
  bool ready() override { return true; }
  std::span<const uint8_t> result() override {
    recv_.clear();
    for (const std::vector<uint8_t>& slot : (*g_rounds)[round_]) {
      EXPECT_EQ(slot.size(), kContributionBytes)
          << "a rank did not take part in round " << round_.first;
      recv_.insert(recv_.end(), slot.begin(), slot.end());
      recv_.resize(recv_.size() + kContributionBytes - slot.size());
    }
    return recv_;
  }

 private:
  int rank_;
  std::pair<uint32_t, uint8_t> round_;
  std::vector<uint8_t> send_;
  std::vector<uint8_t> recv_;
};

class NoTimer : public ce::CompletionTimer {
 public:
  void start(void*) override {}
  void stop(void*) override {}
  uint64_t elapsed_ns() override { return 0; }
};

struct Rank : fakes::TracedRounds {
  int rank = 0;
  int transport_gathers = 0;
  std::vector<Kind> routes;  // by collective index
  std::vector<std::vector<float>> layers;
  std::shared_ptr<CommAgreement> agreement;
};

enum class Mode { Default, StaticWeights };

class World {
 public:
  explicit World(Mode mode)
      : options_(test::options_from(
            {{"MAGI_BACKEND", "host"},
             {"MAGI_WARMUP_STEPS", "2"},
             {"MAGI_REAGREE_STEPS", "8"},
             {"MAGI_CE_FORCE", "1"},
             {"MAGI_STATIC_WEIGHTS", mode == Mode::StaticWeights ? "1" : "0"}})) {
    g_rounds = &rounds_;
    for (int r = 0; r < kRanks; ++r) {
      auto rank = std::make_unique<Rank>();
      Rank* me = rank.get();
      me->rank = r;
      for (int l = 0; l < kLayers; ++l) me->layers.emplace_back(kShard, float(l));
      TransportFactory make = fakes::fake_factory(
          [me] {
            return std::make_unique<fakes::MovingTransport>([me] { ++me->transport_gathers; });
          },
          [](int which) { return std::make_unique<TableExchange>(which); },
          [] { return std::make_unique<NoTimer>(); });
      AgreementWorld world{options_,
                           {fake_all_gather, fake_group, fake_group},
                           std::move(make),
                           [] { return GroupView{}; },
                           fakes::TracedRounds::into(me)};
      capture::CommInfo info{0xbeef, 0, r, kRanks, -1, capture::CommOrigin::InitRank, false};
      me->agreement = std::make_shared<CommAgreement>(
          reinterpret_cast<ncclComm_t>(uintptr_t{0x2000} + static_cast<uintptr_t>(r)), info,
          std::move(world));
      ranks.push_back(std::move(rank));
    }
  }
  ~World() {
    for (auto& r : ranks) r->agreement.reset();
    g_rounds = nullptr;
  }

  // The next collective on every rank: an all-gather of layer (index mod L), from that rank's
  // buffer for it (`buffer` may pick another).
  void call(const std::function<float*(Rank&, int layer)>& buffer = nullptr) {
    const uint64_t index = next_++;
    const int layer = static_cast<int>(index % kLayers);
    for (auto& r : ranks) {
      float* send = buffer ? buffer(*r, layer) : r->layers[static_cast<size_t>(layer)].data();
      std::vector<float> recv(kShard * kRanks);
      capture::CallArgs args{};
      args.op = trace::Op::AllGather;
      args.dtype = ncclFloat;
      args.count = kShard;
      args.root_or_peer = -1;
      args.redop = -1;
      args.sendbuf = send;
      args.recvbuf = recv.data();
      capture::CallRecord record{};
      record.callsite = 0xca11;  // one call site for every layer, as in FSDP
      record.sendbuf = reinterpret_cast<uint64_t>(send);
      record.recvbuf = reinterpret_cast<uint64_t>(recv.data());
      capture::StepView view;
      view.collective = true;
      view.event =
          index == 0 ? capture::StepDetector::Event::Found : capture::StepDetector::Event::None;
      view.found = true;
      view.position = 0;
      view.period = 1;
      view.digest = kDigest;
      view.repeats = index;
      view.collective_index = index;
      const Outcome outcome = intercept(r->agreement, args, record, view);
      const bool moved = (record.flags & trace::kCallMoved) != 0 || outcome.queued_to_move;
      r->routes.push_back(!outcome.served ? Kind::Nccl : moved ? Kind::Move : Kind::TrialNccl);
    }
  }
  void run_to(uint64_t index, const std::function<float*(Rank&, int)>& buffer = nullptr) {
    while (next_ < index) call(buffer);
  }

  // The collective index of the first record of `event` and `reason` on `rank`, or UINT64_MAX.
  static uint64_t first(const Rank& rank, trace::RoundEvent event, Reason reason) {
    for (const trace::AgreementRecord& a : rank.rounds)
      if (a.event == static_cast<uint8_t>(event) && a.reason == static_cast<uint8_t>(reason))
        return a.seq;
    return UINT64_MAX;
  }

  std::vector<std::unique_ptr<Rank>> ranks;

 private:
  Options options_;
  RoundTable rounds_;
  uint64_t next_ = 0;
};

// Default mode: a gather's buffers are no part of its key, so the one position of the shape step
// is stable from the start, moves without a refinement, and keeps moving when a rank sends a
// layer from other buffers (the staging transport copies whatever buffer a call names).
TEST(RefinedStep, DefaultModeMovesIdenticalShapesWithoutRefiningWhateverTheBuffers) {
  World world(Mode::Default);
  std::vector<float> other(kShard, 1.0f);
  uint64_t layer1_calls = 0;
  const auto changing = [&](Rank& r, int layer) {
    if (r.rank != 2 || layer != 1) return r.layers[static_cast<size_t>(layer)].data();
    return layer1_calls++ % 2 == 0 ? other.data() : r.layers[1].data();
  };
  world.run_to(200, changing);
  uint64_t first_moved = UINT64_MAX;
  for (const auto& r : world.ranks) {
    EXPECT_EQ(World::first(*r, trace::RoundEvent::Read, Reason::StepRefined), UINT64_MAX)
        << "rank " << r->rank;
    EXPECT_EQ(r->routes, world.ranks[0]->routes) << "rank " << r->rank;
  }
  const std::vector<Kind>& routes = world.ranks[0]->routes;
  for (uint64_t i = 0; i < routes.size() && first_moved == UINT64_MAX; ++i)
    if (routes[i] == Kind::Move) first_moved = i;
  // Warmup (2 steps), then propose, publish and confirm: a step each.
  ASSERT_LE(first_moved, 8u) << "moved late, or never";
  size_t moved = 0;
  for (uint64_t i = first_moved; i < routes.size(); ++i) moved += routes[i] == Kind::Move;
  // Every call from the first move on moves but those where a reagree round is read (every
  // MAGI_REAGREE_STEPS = 8 calls).
  EXPECT_GE(moved, (routes.size() - first_moved) * 7 / 8 - 1);
}

// Static weights: the shape step is one call, never stable; each rank's own facts repeat every L
// calls. Every
// rank proposes the same refinement, reads it at the same call, and from there the gathers move
// at the same call on every rank, each layer at its own position.
TEST(RefinedStep, IdenticalShapesWithABufferPerLayerMoveOnceRefined) {
  World world(Mode::StaticWeights);
  world.run_to(200);
  const uint64_t refined =
      World::first(*world.ranks[0], trace::RoundEvent::Read, Reason::StepRefined);
  ASSERT_NE(refined, UINT64_MAX) << "no refinement was agreed";
  for (const auto& r : world.ranks) {
    EXPECT_EQ(World::first(*r, trace::RoundEvent::Read, Reason::StepRefined), refined)
        << "rank " << r->rank;
    EXPECT_EQ(r->routes, world.ranks[0]->routes) << "rank " << r->rank;
  }
  const std::vector<Kind>& routes = world.ranks[0]->routes;
  uint64_t first_moved = UINT64_MAX;
  for (uint64_t i = 0; i < routes.size(); ++i) {
    if (routes[i] == Kind::Move) {
      first_moved = i;
      break;
    }
  }
  ASSERT_NE(first_moved, UINT64_MAX) << "nothing moved";
  EXPECT_GT(first_moved, refined);
  // The refined step has 4 positions: the anchor (a gather too) stays on NCCL when its round is
  // issued or read there; every other call from the first move on moves.
  size_t moved = 0;
  for (uint64_t i = first_moved; i < routes.size(); ++i) moved += routes[i] == Kind::Move;
  EXPECT_GE(moved, (routes.size() - first_moved) * 3 / 4);
  // The refinement's round record carries the reason, and each rank said so once.
  for (const auto& r : world.ranks) EXPECT_GT(r->transport_gathers, 100) << "rank " << r->rank;
  // The propose that refined carried the period and its phase on every rank.
  const trace::AgreementRecord* activated = nullptr;
  for (const trace::AgreementRecord& a : world.ranks[0]->rounds)
    if (a.event == static_cast<uint8_t>(trace::RoundEvent::Activated)) activated = &a;
  ASSERT_NE(activated, nullptr);
  EXPECT_EQ(activated->period, static_cast<uint32_t>(kLayers));
  EXPECT_EQ(activated->moved, static_cast<uint32_t>(kLayers));
}

// After the refinement, rank 2 sends layer 1 from other buffers. Nobody can tell at that call,
// so routes stay equal on every rank; the next propose finds that position not stable on rank 2
// and the AND keeps it on NCCL everywhere, while the other layers keep moving.
TEST(RefinedStep, ARankLocalBufferChangeNeverSplitsRoutes) {
  World world(Mode::StaticWeights);
  world.run_to(120);
  ASSERT_NE(World::first(*world.ranks[0], trace::RoundEvent::Read, Reason::StepRefined),
            UINT64_MAX);
  ASSERT_EQ(world.ranks[0]->routes.back(), Kind::Move);
  // Rank 2 now alternates layer 1 between two buffers, step by step: never stable there.
  std::vector<float> other(kShard, 1.0f);
  uint64_t layer1_calls = 0;
  const auto changed = [&](Rank& r, int layer) {
    if (r.rank != 2 || layer != 1) return r.layers[static_cast<size_t>(layer)].data();
    return layer1_calls++ % 2 == 0 ? other.data() : r.layers[1].data();
  };
  world.run_to(400, changed);
  for (const auto& r : world.ranks)
    EXPECT_EQ(r->routes, world.ranks[0]->routes) << "rank " << r->rank;
  // At the end: layer 1 on NCCL on every rank, the other layers moving (the anchor aside).
  const std::vector<Kind>& routes = world.ranks[0]->routes;
  size_t moved = 0;
  for (uint64_t i = 360; i < 400; ++i) {
    if (i % kLayers == 1) {
      EXPECT_EQ(routes[i], Kind::Nccl) << "call " << i;
    }
    moved += routes[i] == Kind::Move;
  }
  EXPECT_GE(moved, 20u);
  // Rank 0 recorded why: rank 2 refused that gather.
  bool refused = false;
  for (const trace::DecisionRecord& d : world.ranks[0]->decisions)
    refused = refused ||
              (d.reason == static_cast<uint8_t>(Reason::OtherRankRefused) && d.refused_by == 2);
  EXPECT_TRUE(refused);
}

// One rank whose own facts repeat with another period (its layers share a buffer) proposes no
// refinement: nobody refines, and routes stay on NCCL, equal everywhere.
TEST(RefinedStep, ARankWithoutTheRefinementKeepsEveryRankOnTheShapeStep) {
  World world(Mode::StaticWeights);
  const auto shared = [](Rank& r, int layer) {
    return r.rank == 3 ? r.layers[0].data() : r.layers[static_cast<size_t>(layer)].data();
  };
  world.run_to(200, shared);
  for (const auto& r : world.ranks) {
    EXPECT_EQ(World::first(*r, trace::RoundEvent::Read, Reason::StepRefined), UINT64_MAX);
    EXPECT_EQ(r->routes, world.ranks[0]->routes) << "rank " << r->rank;
    EXPECT_EQ(r->transport_gathers, 0) << "rank " << r->rank;
  }
}

}  // namespace
}  // namespace magi::rewrite
