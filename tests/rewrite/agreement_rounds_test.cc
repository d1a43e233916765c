// One communicator's agreement driven in one process: this test plays rank 0's program call by
// call, and every other rank's side of each round (a fake exchange hands back rank 0's own
// contribution together with the peers' the test writes). The world is fake throughout: NCCL
// counts calls, the transport and the timers run on a clock the fakes advance, the group state
// and the trace are the test's.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "rewrite/agreement.h"
#include "rewrite/hello.h"
#include "tests/rewrite/agreement_fakes.h"
#include "tests/support/has_line.h"
#include "tests/support/info_logged.h"
#include "tests/support/options_env.h"

namespace magi::rewrite {
namespace {

constexpr int kRanks = 4;
constexpr uint32_t kPeriod = 3;  // position 0: an all-reduce (the anchor); 1 and 2: all-gathers
constexpr uint64_t kDigest = 0xd15e57;
constexpr uint64_t kNcclGatherNs = 100;

// What the fakes saw and what they do; the NCCL calls are plain function pointers, so the state
// they reach is the file's.
struct Fakes : fakes::TracedRounds {
  std::vector<Contribution> contributed;  // rank 0's contribution to each round, in order
  // Writes rank `rank`'s contribution to a round, starting from a copy of rank 0's.
  std::function<void(int rank, Contribution&)> peer;
  int results_read = 0;
  int rounds_launched = 0;
  int nccl_gathers = 0;  // the program's gathers that reached NCCL
  int group_starts = 0;
  int group_ends = 0;
  int transports_made = 0;
  int transport_gathers = 0;
  uint64_t moved_ns = 500;     // what a bucket costs on the transport (fake clock)
  bool gather_throws = false;  // once transport_gathers reaches gathers_before_throw
  int gathers_before_throw = 0;
  bool timer_stop_throws = false;
  uint64_t clock_ns = 0;
  GroupView group;
  uint32_t group_ordinal = 0;  // of the open group, recorded in calls made while group.depth > 0
  std::vector<ce::Transport::Timing> timings;      // how the transport served each bucket
  std::vector<ce::WindowPlan> plans;               // each plan a transport prepared
  std::vector<std::vector<ce::GatherOp>> buckets;  // each bucket the transport served
  // A bucket whose first gather is read at this slot offset costs `slow_ns` instead.
  size_t slow_slot = SIZE_MAX;
  uint64_t slow_ns = 0;
  // Rounds at a graph capture (the board): rank 0's contribution to each, in order, and whether
  // the next ones are abandoned (why) rather than agreed.
  std::vector<Contribution> board_contributed;
  std::string board_abandons;
  int boards_opened = 0;
};
Fakes* g_fakes = nullptr;

ncclResult_t fake_all_gather(const void*, void*, size_t count, ncclDataType_t dtype, ncclComm_t,
                             cudaStream_t) {
  if (dtype == ncclUint8 && count == kContributionBytes) {
    ++g_fakes->rounds_launched;
  } else {
    ++g_fakes->nccl_gathers;
    g_fakes->clock_ns += kNcclGatherNs;
  }
  return ncclSuccess;
}
ncclResult_t fake_group_start() {
  ++g_fakes->group_starts;
  return ncclSuccess;
}
ncclResult_t fake_group_end() {
  ++g_fakes->group_ends;
  return ncclSuccess;
}

class FakeExchange : public ce::Exchange {
 public:
  explicit FakeExchange(int rank)
      : rank_(rank), send_(kContributionBytes), recv_(kRanks * kContributionBytes) {}
  void* send_buffer() override { return send_.data(); }
  void* recv_buffer() override { return recv_.data(); }
  void* stream() override { return nullptr; }
  void stage(std::span<const uint8_t> bytes) override {
    std::memcpy(send_.data(), bytes.data(), bytes.size());
    Contribution mine;
    EXPECT_TRUE(Contribution::parse(bytes, mine));
    g_fakes->contributed.push_back(mine);
  }
  void issued() override {}
  bool ready() override { return true; }
  std::span<const uint8_t> result() override {
    ++g_fakes->results_read;
    Contribution mine;
    EXPECT_TRUE(Contribution::parse(send_, mine));
    for (int r = 0; r < kRanks; ++r) {
      Contribution c = mine;
      c.header.rank = r;
      if (r != rank_ && g_fakes->peer) g_fakes->peer(r, c);
      c.serialize(std::span<uint8_t>(recv_).subspan(static_cast<size_t>(r) * kContributionBytes,
                                                    kContributionBytes));
    }
    return recv_;
  }

 private:
  int rank_;
  std::vector<uint8_t> send_;
  std::vector<uint8_t> recv_;
};

// The board of rounds at a graph capture: rank 0's contribution, and every other rank's as the
// test writes it (Fakes::peer), each of the size rank 0 gave.
class FakeBoard : public ce::RoundBoard {
 public:
  ce::BoardRound exchange(std::span<const uint8_t> mine, std::chrono::milliseconds) override {
    ce::BoardRound round;
    Contribution own;
    EXPECT_TRUE(Contribution::parse(mine, own));
    g_fakes->board_contributed.push_back(own);
    if (!g_fakes->board_abandons.empty()) {
      round.why = g_fakes->board_abandons;
      return round;
    }
    round.outcome = ce::BoardRound::Outcome::Agreed;
    round.all.resize(mine.size() * kRanks);
    for (int r = 0; r < kRanks; ++r) {
      Contribution c = own;
      c.header.rank = r;
      if (r != 0 && g_fakes->peer) g_fakes->peer(r, c);
      c.serialize(std::span<uint8_t>(round.all).subspan(r * mine.size(), mine.size()));
    }
    return round;
  }
};

class FakeTimer : public ce::CompletionTimer {
 public:
  void start(void*) override { start_ = g_fakes->clock_ns; }
  void stop(void*) override {
    if (g_fakes->timer_stop_throws) throw Error(ErrorKind::Cuda, "cannot record the stop event");
    stop_ = g_fakes->clock_ns;
  }
  uint64_t elapsed_ns() override { return stop_ - start_; }

 private:
  uint64_t start_ = 0;
  uint64_t stop_ = 0;
};

Options options_with(std::map<std::string, std::string> env) {
  env.emplace("MAGI_BACKEND", "host");
  env.emplace("MAGI_WARMUP_STEPS", "2");
  env.emplace("MAGI_REAGREE_STEPS", "8");
  return test::options_from(env);
}

using Kind = Route::Kind;
using Env = std::map<std::string, std::string>;

// Rank 0 of a 4-rank communicator whose step is [all-reduce, all-gather, all-gather].
class Rank0 {
 public:
  explicit Rank0(std::map<std::string, std::string> env) : options_(options_with(std::move(env))) {
    g_fakes = &fakes;
    TransportFactory make = fakes::fake_factory(
        [] {
          ++g_fakes->transports_made;
          auto transport = std::make_unique<fakes::MovingTransport>(
              [] {
                if (g_fakes->gather_throws &&
                    g_fakes->transport_gathers >= g_fakes->gathers_before_throw)
                  throw std::runtime_error("not one of ours");
                ++g_fakes->transport_gathers;
                const bool slow = g_fakes->buckets.back().front().slot_offset == g_fakes->slow_slot;
                g_fakes->clock_ns += slow ? g_fakes->slow_ns : g_fakes->moved_ns;
              },
              kRanks);
          transport->timings = &g_fakes->timings;
          transport->plans = &g_fakes->plans;
          transport->buckets = &g_fakes->buckets;
          return transport;
        },
        [](int rank) { return std::make_unique<FakeExchange>(rank); },
        [] { return std::make_unique<FakeTimer>(); });
    make.board = [](const capture::CommInfo&) -> std::unique_ptr<ce::RoundBoard> {
      ++g_fakes->boards_opened;
      return std::make_unique<FakeBoard>();
    };
    AgreementWorld world{options_,
                         {fake_all_gather, fake_group_start, fake_group_end},
                         std::move(make),
                         [] { return g_fakes->group; },
                         fakes::TracedRounds::into(&fakes)};
    capture::CommInfo info{0xc0ffee, 0, 0, kRanks, -1, capture::CommOrigin::InitRank, false};
    agreement_ = std::make_shared<CommAgreement>(comm(), info, std::move(world));
  }
  ~Rank0() { g_fakes = nullptr; }

  static ncclComm_t comm() { return reinterpret_cast<ncclComm_t>(uintptr_t{0x1000}); }

  // The program's next collective; returns the route it took (seen through rewrite's call path).
  Kind call(std::optional<capture::StepDetector::Event> event = std::nullopt, bool found = true) {
    const uint64_t index = next_++;
    const uint32_t position = static_cast<uint32_t>((index - base_) % kPeriod);
    capture::CallArgs args{};
    args.op = position == 0 ? trace::Op::AllReduce : trace::Op::AllGather;
    args.dtype = ncclFloat;
    args.count = position == 0 ? 4096 : position == 1 || same_sizes ? 1000 : 64;
    args.root_or_peer = -1;
    args.redop = position == 0 ? 0 : -1;
    args.sendbuf = position == 0 ? reduce_ : position == 1 ? send1_ : send2_;
    if (position != 0 && sends[position] != nullptr) args.sendbuf = sends[position];
    args.recvbuf = position == 0 ? reduce_ : position == 1 ? recv1_ : recv2_;
    capture::CallRecord record{};
    if (capturing) record.flags |= trace::kCallCapturing;
    record.callsite = 1000 + position;
    // Every other step from other call sites: this rank's own facts repeat every 2 steps.
    if (alternating_callsites && ((index - base_) / kPeriod) % 2 == 1) record.callsite += 100;
    record.sendbuf = reinterpret_cast<uint64_t>(args.sendbuf);
    record.recvbuf = reinterpret_cast<uint64_t>(args.recvbuf);
    if (fakes.group.depth > 0) {
      record.flags |= trace::kCallInGroup;
      record.group = fakes.group_ordinal;
    }
    capture::StepView view;
    view.collective = true;
    view.event = event.value_or(index == base_ && found ? capture::StepDetector::Event::Found
                                                        : capture::StepDetector::Event::None);
    view.found = found;
    view.position = found ? position : 0;
    view.period = found ? kPeriod : 0;
    view.digest = found ? kDigest : 0;
    view.collective_index = index;
    view.origin = found ? base_ : 0;
    const Outcome outcome = intercept(agreement_, args, record, view);
    last = outcome;
    // A call queued in a group is traced once the group ends: its route is the outcome's.
    const bool moved = (record.flags & trace::kCallMoved) != 0 || outcome.queued_to_move;
    if (record.flags & trace::kCallWouldMove) {
      EXPECT_FALSE(outcome.served);
      return Kind::WouldMove;
    }
    if (!outcome.served) {
      EXPECT_FALSE(moved);
      return Kind::Nccl;
    }
    return moved ? Kind::Move : Kind::TrialNccl;
  }
  Outcome last;             // of the last call()
  bool capturing = false;   // the next calls are captured into a CUDA graph
  bool same_sizes = false;  // both gathers send 1000 floats (the second's buffers have room)
  bool alternating_callsites = false;  // the step's own facts repeat every 2 shape steps
  // The send buffer of the gather at each position, where not its own.
  const void* sends[kPeriod] = {};
  // A block of 1000 floats that is neither gather's own.
  float* spare() { return spare_; }
  const void* own_send(uint32_t position) const { return position == 1 ? send1_ : send2_; }
  // The gather's receive buffer: as its send buffer (rank 0), the gather is in place.
  const void* own_recv(uint32_t position) const { return position == 1 ? recv1_ : recv2_; }
  // Whole steps; returns the routes of every call, by collective index.
  std::vector<Kind> steps(int n) {
    std::vector<Kind> kinds;
    for (int i = 0; i < n * static_cast<int>(kPeriod); ++i) kinds.push_back(call());
    return kinds;
  }
  // Until collective `index` (excluded).
  void run_to(uint64_t index) {
    while (next_ < index) call();
  }
  // The step is found again from the next call on (after a loss).
  void refind() { base_ = next_; }
  uint64_t next() const { return next_; }

  // The rounds issued so far: (collective index, kind).
  std::vector<std::pair<uint64_t, RoundKind>> issued() const {
    std::vector<std::pair<uint64_t, RoundKind>> out;
    for (const trace::AgreementRecord& r : fakes.rounds)
      if (r.event == static_cast<uint8_t>(trace::RoundEvent::Issued))
        out.push_back({r.seq, static_cast<RoundKind>(r.kind)});
    return out;
  }
  const trace::AgreementRecord* find(trace::RoundEvent event, RoundKind kind) const {
    for (const trace::AgreementRecord& r : fakes.rounds)
      if (r.event == static_cast<uint8_t>(event) && r.kind == static_cast<uint8_t>(kind)) return &r;
    return nullptr;
  }

  Fakes fakes;
  std::shared_ptr<CommAgreement> agreement_;

 private:
  Options options_;
  uint64_t next_ = 0;
  uint64_t base_ = 0;
  float reduce_[4096] = {};
  float send1_[1000] = {};
  float recv1_[4000] = {};
  float send2_[1000] = {};
  float recv2_[4000] = {};
  float spare_[1000] = {};
};

using Issued = std::vector<std::pair<uint64_t, RoundKind>>;

// With MAGI_WARMUP_STEPS=W the first propose comes at the anchor of step W + 1: index 3W.
TEST(AgreementRounds, NoRoundBeforeTheWarmupStepsAreComplete) {
  for (const int warmup : {1, 2, 3}) {
    Rank0 rank(Env{{"MAGI_WARMUP_STEPS", std::to_string(warmup)}});
    const uint64_t first = static_cast<uint64_t>(3 * warmup);
    rank.run_to(first);
    EXPECT_EQ(rank.fakes.rounds_launched, 1) << "warmup " << warmup;  // the hello
    EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello}}));
    rank.call();
    EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello}, {first, RoundKind::Propose}}))
        << "warmup " << warmup;
    ASSERT_EQ(rank.fakes.contributed.size(), 2u);
    const Contribution& c = rank.fakes.contributed[1];
    EXPECT_EQ(c.header.gathers, 2u);
    EXPECT_EQ(c.header.period, kPeriod);
    for (const GatherEntry& e : c.entries) EXPECT_EQ(e.reason, 0) << "position " << e.position;
  }
}

// Propose at the anchor of step 3 (index 6), each round read a call later (a quarter of a step
// of 3, at least one call): publish at 7, confirm at 8, read at 9: the gathers of the step that
// begins there move, on every rank at the same call.
TEST(AgreementRounds, AnAgreedPlanMovesAtTheSameCallOnceConfirmed) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  const std::vector<Kind> kinds = rank.steps(8);
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello},
                                   {6, RoundKind::Propose},
                                   {7, RoundKind::Publish},
                                   {8, RoundKind::Confirm}}));
  for (uint64_t i = 0; i < 10; ++i) EXPECT_EQ(kinds[i], Kind::Nccl) << "call " << i;
  for (uint64_t i = 10; i < kinds.size(); ++i)
    EXPECT_EQ(kinds[i], i % kPeriod == 0 ? Kind::Nccl : Kind::Move) << "call " << i;
  const trace::AgreementRecord* activated =
      rank.find(trace::RoundEvent::Activated, RoundKind::Confirm);
  ASSERT_NE(activated, nullptr);
  EXPECT_EQ(activated->seq, 9u);
  EXPECT_EQ(activated->moved, 2u);
  EXPECT_EQ(rank.fakes.transports_made, 1);
  EXPECT_EQ(rank.fakes.transport_gathers, 10);
  EXPECT_EQ(rank.fakes.nccl_gathers, 0);
  // Publish and confirm carry the plan and say this rank can serve it.
  ASSERT_EQ(rank.fakes.contributed.size(), 4u);
  for (size_t r = 2; r < 4; ++r) {
    EXPECT_NE(rank.fakes.contributed[r].header.decision_hash, 0u);
    EXPECT_TRUE(rank.fakes.contributed[r].header.flags & kCanServe);
  }
}

// The phase says where the communicator is at every call: watching until the propose (index 6),
// then one phase per round in flight, and Active from the confirm's read (index 9) on.
TEST(AgreementRounds, ACommunicatorsPhaseFollowsItsRoundsFromWatchingToActive) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  std::vector<Phase> phases;
  for (int i = 0; i < 18; ++i) {
    rank.call();
    phases.push_back(rank.agreement_->phase());
  }
  for (uint64_t i = 0; i < phases.size(); ++i) {
    const Phase expected = i < 6    ? Phase::Watching
                           : i == 6 ? Phase::Proposing
                           : i == 7 ? Phase::Publishing
                           : i == 8 ? Phase::Confirming
                                    : Phase::Active;
    EXPECT_EQ(phases[i], expected) << "call " << i << ": " << phase_name(phases[i]);
  }
  // A step lost ends the plan at that very call.
  rank.call(capture::StepDetector::Event::Lost, false);
  EXPECT_EQ(rank.agreement_->phase(), Phase::Watching);
  EXPECT_TRUE(rank.agreement_->watching());
}

// A rank on NCCL takes no part from its creation on, and says its hello all the same.
TEST(AgreementRounds, ARankThatTakesNoPartIsOffFromTheStart) {
  Rank0 rank(Env{{"MAGI_TRANSPORT", "nccl"}});
  EXPECT_EQ(rank.agreement_->phase(), Phase::Off);
  rank.steps(4);
  EXPECT_EQ(rank.agreement_->phase(), Phase::Off);
  EXPECT_FALSE(rank.agreement_->watching());
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello}}));
}

// A peer that holds the gathers ineligible for good (their memory): the AND refuses them
// everywhere, nothing is published, and the next propose comes MAGI_REAGREE_STEPS (8) steps
// after the read one (step 4 -> 12).
TEST(AgreementRounds, APeerThatRefusesKeepsEverythingOnNcclUntilTheNextPropose) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.fakes.peer = [](int r, Contribution& c) {
    if (r == 2 && c.header.kind == static_cast<uint8_t>(RoundKind::Propose))
      for (GatherEntry& e : c.entries) e.reason = static_cast<uint8_t>(Reason::DeviceMemory);
  };
  const std::vector<Kind> kinds = rank.steps(14);
  for (uint64_t i = 0; i < kinds.size(); ++i) EXPECT_EQ(kinds[i], Kind::Nccl) << "call " << i;
  EXPECT_EQ(rank.issued(),
            (Issued{{0, RoundKind::Hello}, {6, RoundKind::Propose}, {33, RoundKind::Propose}}));
  EXPECT_EQ(rank.fakes.transports_made, 0);
  ASSERT_GE(rank.fakes.decisions.size(), 2u);
  for (size_t d = 0; d < 2; ++d) {
    EXPECT_EQ(rank.fakes.decisions[d].refused_by, 2);
    EXPECT_EQ(rank.fakes.decisions[d].reason, static_cast<uint8_t>(Reason::OtherRankRefused));
    EXPECT_EQ(rank.fakes.decisions[d].verdict, static_cast<uint8_t>(trace::Verdict::Stays));
  }
}

// Gathers not yet stable on a peer: the round moved less than it could, so the next propose
// comes soon, not MAGI_REAGREE_STEPS later: 1, 2, 4 … steps after each read, doubling from the
// first (ExplorationPolicy); once the peer's gathers are stable, the plan moves at the same call
// on every rank.
TEST(AgreementRounds, AGatherNotYetStableOnAPeerIsProposedAgainSoonBackingOff) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_REAGREE_STEPS", "64"}});
  bool settled = false;
  rank.fakes.peer = [&settled](int r, Contribution& c) {
    if (!settled && r == 3 && c.header.kind == static_cast<uint8_t>(RoundKind::Propose))
      for (GatherEntry& e : c.entries) e.reason = static_cast<uint8_t>(Reason::NotStable);
  };
  // Step s (counted at the anchor from 1) begins at index 3 (s - 1). Each propose is read a
  // call after its issue, and the wait counts from the step after the issue, as when it was read
  // there: propose at step 3, then (3 + 1) + 1 = 5, (5 + 1) + 2 = 8, (8 + 1) + 4 = 13,
  // (13 + 1) + 8 = 22, (22 + 1) + 16 = 39: no more rounds than when each was read a step later.
  Issued expected = {{0, RoundKind::Hello}};
  for (const uint64_t step : {3, 5, 8, 13, 22, 39})
    expected.push_back({3 * (step - 1), RoundKind::Propose});
  rank.run_to(3 * 38 + 1);  // up to the read of the propose of step 39, excluded
  EXPECT_EQ(rank.issued(), expected);
  EXPECT_EQ(rank.fakes.rounds_launched, static_cast<int>(expected.size()));
  ASSERT_FALSE(rank.fakes.decisions.empty());
  EXPECT_EQ(rank.fakes.decisions.back().reason, static_cast<uint8_t>(Reason::OtherRankRefused));
  // Settled when that propose is read (index 115): publish there, confirm at 116, the plan moves
  // from the read at 117.
  settled = true;
  std::vector<Kind> kinds;
  for (int i = 0; i < 4 * static_cast<int>(kPeriod); ++i) kinds.push_back(rank.call());
  EXPECT_EQ(rank.issued().back(), (std::pair<uint64_t, RoundKind>{116, RoundKind::Confirm}));
  for (size_t i = 0; i < kinds.size(); ++i) {
    const uint64_t index = 115 + i;
    const Kind expected_kind = index > 117 && index % kPeriod != 0 ? Kind::Move : Kind::Nccl;
    EXPECT_EQ(kinds[i], expected_kind) << "call " << index;
  }
}

// The anchor's call inside the program's open group: the group so far is launched, the round
// goes alone, the group reopens; the round counts like any other, and the plan moves.
TEST(AgreementRounds, ARoundIssuedInsideAGroupLaunchesAloneAndCounts) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.run_to(6);
  rank.fakes.group = {1, false, 3};
  EXPECT_EQ(rank.call(), Kind::Nccl);
  rank.fakes.group = {};
  EXPECT_EQ(group_ended(ncclSuccess), ncclSuccess);
  EXPECT_EQ(rank.fakes.group_ends, 1);           // the group so far, launched before the round
  EXPECT_EQ(rank.fakes.group_starts, 1);         // and opened again after it
  ASSERT_EQ(rank.fakes.contributed.size(), 2u);  // the hello, and this propose
  EXPECT_FALSE(rank.fakes.contributed[1].header.flags & kIssuedInGroup);
  const std::vector<Kind> kinds = rank.steps(4);  // indices 7..18
  EXPECT_EQ(rank.fakes.results_read, 4);
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello},
                                   {6, RoundKind::Propose},
                                   {7, RoundKind::Publish},
                                   {8, RoundKind::Confirm}}));
  EXPECT_EQ(kinds[10 - 7], Kind::Move);
  EXPECT_EQ(kinds[8 - 7], Kind::Nccl);
}

// Every step one group (ncclGroupStart, the three calls, ncclGroupEnd): every round is issued
// inside it, launched alone, and the moved gathers are served at each group's end.
TEST(AgreementRounds, AStepThatIsOneGroupMoves) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  std::vector<Kind> kinds;
  for (uint32_t step = 0; step < 8; ++step) {
    rank.fakes.group_ordinal = step + 1;
    for (uint32_t c = 0; c < kPeriod; ++c) {
      rank.fakes.group = {1, false, c + 1};
      kinds.push_back(rank.call());
    }
    rank.fakes.group = {};
    EXPECT_EQ(group_ended(ncclSuccess), ncclSuccess);
  }
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello},
                                   {6, RoundKind::Propose},
                                   {7, RoundKind::Publish},
                                   {8, RoundKind::Confirm}}));
  for (uint64_t i = 9; i < kinds.size(); ++i)
    EXPECT_EQ(kinds[i], i % kPeriod == 0 ? Kind::Nccl : Kind::Move) << "call " << i;
  EXPECT_EQ(rank.fakes.transport_gathers, 5);  // one bucket a step (the group): steps 3 to 7
  EXPECT_EQ(rank.fakes.nccl_gathers, 0);
}

// Groups that straddle steps (each ncclGroupStart before a step's gathers, its ncclGroupEnd after
// the next step's first call): each group is a bucket of its own step part, the rounds read at
// the anchor inside it launch alone, and the gathers move, served at each group's end. (The first
// step groups otherwise — its position 0 is in no group — so the first propose finds the
// groupings unsettled, and the next comes soon.)
TEST(AgreementRounds, GroupsThatStraddleStepsMove) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  std::vector<Kind> kinds;
  kinds.push_back(rank.call());  // index 0, position 0: outside any group
  for (uint32_t group = 1; group <= 10; ++group) {
    rank.fakes.group_ordinal = group;
    for (uint32_t c = 0; c < kPeriod; ++c) {  // positions 1 and 2, then the next step's 0
      rank.fakes.group = {1, false, c + 1};
      kinds.push_back(rank.call());
    }
    rank.fakes.group = {};
    EXPECT_EQ(group_ended(ncclSuccess), ncclSuccess);
  }
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello},
                                   {6, RoundKind::Propose},
                                   {12, RoundKind::Propose},
                                   {13, RoundKind::Publish},
                                   {14, RoundKind::Confirm}}));
  // Activated at 15, inside the group [13, 14, 15]: 13 and 14 were routed to NCCL before it.
  for (uint64_t i = 16; i < kinds.size(); ++i)
    EXPECT_EQ(kinds[i], i % kPeriod == 0 ? Kind::Nccl : Kind::Move) << "call " << i;
  EXPECT_EQ(kinds[14], Kind::Nccl);
  EXPECT_EQ(rank.fakes.transport_gathers, 5);  // one bucket (positions 1 and 2) a group: 16..30
  EXPECT_EQ(rank.fakes.nccl_gathers, 0);
  EXPECT_EQ(rank.fakes.group_ends, 4);  // the groups launched early, one for each round
}

// A round read at an anchor inside the program's open group may end the plan (here a peer
// refuses at the next propose): the gathers the group queued under it go to NCCL at the group's
// end, as on every rank (all read the same round at the same call), never to a dropped window.
TEST(AgreementRounds, GathersQueuedUnderAPlanThatEndsInsideTheirGroupGoToNccl) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_REAGREE_STEPS", "2"}});
  bool refuse = false;
  rank.fakes.peer = [&refuse](int r, Contribution& c) {
    if (refuse && r == 1 && c.header.kind == static_cast<uint8_t>(RoundKind::Propose))
      for (GatherEntry& e : c.entries) e.reason = static_cast<uint8_t>(Reason::DeviceMemory);
  };
  // Moving from index 9; the next proposes come MAGI_REAGREE_STEPS (2) steps after the step of
  // the last round's issue: at 15 (read at 16) and at 24, read at 25.
  rank.run_to(22);
  refuse = true;
  rank.fakes.group_ordinal = 9;
  rank.fakes.group = {1, false, 1};
  EXPECT_EQ(rank.call(), Kind::Move);  // 22: queued
  rank.fakes.group = {1, false, 2};
  EXPECT_EQ(rank.call(), Kind::Move);  // 23: queued
  rank.fakes.group = {1, false, 3};
  EXPECT_EQ(rank.call(), Kind::Nccl);  // 24: the propose is issued, launched alone
  rank.fakes.group = {1, false, 4};
  EXPECT_EQ(rank.call(), Kind::Nccl);  // 25: the propose is read, refused: the plan ends here
  rank.fakes.group = {};
  const int nccl_before = rank.fakes.nccl_gathers;
  const int moved_before = rank.fakes.transport_gathers;
  EXPECT_EQ(group_ended(ncclSuccess), ncclSuccess);
  EXPECT_EQ(rank.fakes.nccl_gathers, nccl_before + 2);
  EXPECT_EQ(rank.fakes.transport_gathers, moved_before);
  const trace::AgreementRecord* off = rank.find(trace::RoundEvent::Deactivated, RoundKind::Propose);
  ASSERT_NE(off, nullptr);
  EXPECT_EQ(off->seq, 25u);
}

// Inside a group holding Send/Recv the round cannot launch alone: it stays in the group (no early
// launch), this rank votes no and never reads it, and every rank moves the anchor one position
// on and proposes again a step later.
TEST(AgreementRounds, ARoundThatCannotLeaveItsGroupVotesNoAndTheAnchorMovesOn) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.run_to(6);
  rank.fakes.group = {1, true, 3};
  EXPECT_EQ(rank.call(), Kind::Nccl);
  rank.fakes.group = {};
  EXPECT_EQ(group_ended(ncclSuccess), ncclSuccess);
  EXPECT_EQ(rank.fakes.rounds_launched, 2);  // the hello, and this one
  EXPECT_EQ(rank.fakes.group_ends, 0);
  EXPECT_EQ(rank.fakes.group_starts, 0);
  ASSERT_EQ(rank.fakes.contributed.size(), 2u);
  EXPECT_TRUE(rank.fakes.contributed[1].header.flags & kIssuedInGroup);
  rank.run_to(11);
  EXPECT_EQ(rank.fakes.results_read, 1);  // the hello; voted no: the answer is known unread
  const trace::AgreementRecord* read = rank.find(trace::RoundEvent::Read, RoundKind::Propose);
  ASSERT_NE(read, nullptr);
  EXPECT_EQ(read->seq, 7u);
  EXPECT_EQ(read->reason, static_cast<uint8_t>(Reason::AnchorInGroup));
  // The anchor is now position 1: the next propose is issued at index 10, a step after the void
  // one, and read at 11.
  EXPECT_EQ(rank.issued(),
            (Issued{{0, RoundKind::Hello}, {6, RoundKind::Propose}, {10, RoundKind::Propose}}));
  const std::vector<Kind> kinds = rank.steps(4);
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello},
                                   {6, RoundKind::Propose},
                                   {10, RoundKind::Propose},
                                   {11, RoundKind::Publish},
                                   {12, RoundKind::Confirm}}));
  // Read at index 13 (position 1, step 5): that gather and the one after it move.
  EXPECT_EQ(kinds[13 - 11], Kind::Move);
  EXPECT_EQ(kinds[12 - 11], Kind::Nccl);
  EXPECT_EQ(kinds[14 - 11], Kind::Move);
}

// The step is lost while a confirm round is pending (issued at 8, due at 9): the round is
// abandoned, nothing activates.
TEST(AgreementRounds, AStepLostDropsThePendingRound) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.run_to(9);
  EXPECT_EQ(rank.call(capture::StepDetector::Event::Lost, false), Kind::Nccl);
  const trace::AgreementRecord* abandoned =
      rank.find(trace::RoundEvent::Abandoned, RoundKind::Confirm);
  ASSERT_NE(abandoned, nullptr);
  EXPECT_EQ(abandoned->seq, 9u);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(rank.call(std::nullopt, false), Kind::Nccl);
  EXPECT_EQ(rank.find(trace::RoundEvent::Activated, RoundKind::Confirm), nullptr);
}

// The step is lost after activation: the plan is dropped at that call; found again, the warmup
// starts over before the next propose.
TEST(AgreementRounds, AStepLostDropsThePlanAndTheWarmupStartsOver) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.run_to(18);
  EXPECT_EQ(rank.call(), Kind::Nccl);  // index 18, position 0
  EXPECT_EQ(rank.call(), Kind::Move);  // index 19
  EXPECT_EQ(rank.call(capture::StepDetector::Event::Lost, false), Kind::Nccl);  // index 20
  const trace::AgreementRecord* off = rank.find(trace::RoundEvent::Deactivated, RoundKind::Propose);
  ASSERT_NE(off, nullptr);
  EXPECT_EQ(off->seq, 20u);
  EXPECT_EQ(off->reason, static_cast<uint8_t>(Reason::Deviated));
  rank.refind();  // index 21 is position 0 of a step found again
  const std::vector<Kind> kinds = rank.steps(3);
  for (const Kind k : kinds) EXPECT_EQ(k, Kind::Nccl);
  const Issued issued = rank.issued();
  ASSERT_GE(issued.size(), 3u);
  EXPECT_EQ(Issued(issued.end() - 3, issued.end()),
            (Issued{{27, RoundKind::Propose}, {28, RoundKind::Publish}, {29, RoundKind::Confirm}}));
}

// The plan read at index 7 is committed (publish at 7, confirm at 8): its gathers at 7 and 8 go
// to NCCL anyway, and are timed there (TrialNccl: the trial's NCCL side). Activated at step 4
// (index 9), they move, timed, for MAGI_WARMUP_STEPS = 2 steps; the cost round is issued at step
// 6 and read a step later. No call went to NCCL on purpose. The fake transport is five times
// slower than NCCL, so every bucket goes back to NCCL, and the same plan is not tried again.
TEST(AgreementRounds, TheCostTrialTimesNcclWhileCommittingAndKeepsNcclWhereNcclWasFaster) {
  Rank0 rank(Env{});
  const std::vector<Kind> kinds = rank.steps(16);
  auto at = [&](int step, uint32_t position) {
    return kinds[static_cast<size_t>((step - 1) * 3) + position];
  };
  EXPECT_EQ(at(3, 1), Kind::TrialNccl);
  EXPECT_EQ(at(3, 2), Kind::TrialNccl);
  for (const int step : {4, 5, 6}) {
    EXPECT_EQ(at(step, 1), Kind::Move) << "step " << step;
    EXPECT_EQ(at(step, 2), Kind::Move) << "step " << step;
  }
  for (int step = 7; step <= 16; ++step) {
    EXPECT_EQ(at(step, 1), Kind::Nccl) << "step " << step;
    EXPECT_EQ(at(step, 2), Kind::Nccl) << "step " << step;
  }
  // The next propose MAGI_REAGREE_STEPS (8) steps after the step of the confirm's issue (3).
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello},
                                   {6, RoundKind::Propose},
                                   {7, RoundKind::Publish},
                                   {8, RoundKind::Confirm},
                                   {15, RoundKind::Cost},
                                   {33, RoundKind::Propose}}));
  const Contribution& cost = rank.fakes.contributed[4];
  ASSERT_EQ(cost.costs.size(), 2u);
  for (const BucketCost& b : cost.costs) {
    EXPECT_EQ(b.moved_ns, 500u);
    EXPECT_EQ(b.nccl_ns, kNcclGatherNs);
  }
  const trace::AgreementRecord* off = rank.find(trace::RoundEvent::Deactivated, RoundKind::Propose);
  ASSERT_NE(off, nullptr);
  EXPECT_EQ(off->seq, 18u);
  EXPECT_EQ(off->reason, static_cast<uint8_t>(Reason::NcclFaster));
  // The propose at step 12 agrees the same plan again: read a call later, it moves nothing.
  const trace::AgreementRecord& last = rank.fakes.rounds.back();
  EXPECT_EQ(last.seq, 34u);
  EXPECT_EQ(last.event, static_cast<uint8_t>(trace::RoundEvent::Read));
  EXPECT_EQ(last.moved, 0u);
  EXPECT_EQ(rank.fakes.transports_made, 1);
}

// A timed plan's confirm waits until each of its buckets went to NCCL once since the propose
// read, so the trial never has to send a call there on purpose. Here the anchor has moved to
// position 1 (the first propose sat in a Send/Recv group): the propose issued at 10 is read at
// 11 (position 2, to NCCL and timed), the publish at 12, and the confirm, due at 13, waits for
// position 1's call there to go to NCCL too: read at 14, the plan moves from that call, both
// buckets timed both ways, with no alternation.
TEST(AgreementRounds, ATimedConfirmWaitsUntilEveryBucketWentToNcclOnce) {
  Rank0 rank(Env{});
  rank.run_to(6);
  rank.fakes.group = {1, true, 3};
  EXPECT_EQ(rank.call(), Kind::Nccl);
  rank.fakes.group = {};
  EXPECT_EQ(group_ended(ncclSuccess), ncclSuccess);
  std::vector<Kind> kinds(7, Kind::Nccl);
  for (int i = 7; i < 22; ++i) kinds.push_back(rank.call());
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello},
                                   {6, RoundKind::Propose},
                                   {10, RoundKind::Propose},
                                   {11, RoundKind::Publish},
                                   {12, RoundKind::Confirm},
                                   {19, RoundKind::Cost}}));
  EXPECT_EQ(kinds[10], Kind::Nccl);  // before the propose read
  EXPECT_EQ(kinds[11], Kind::TrialNccl);
  EXPECT_EQ(kinds[13], Kind::TrialNccl);  // the confirm is due, position 1 not yet timed
  const trace::AgreementRecord* activated =
      rank.find(trace::RoundEvent::Activated, RoundKind::Confirm);
  ASSERT_NE(activated, nullptr);
  EXPECT_EQ(activated->seq, 14u);
  for (uint64_t i = 14; i < 21; ++i)
    EXPECT_EQ(kinds[i], i % kPeriod == 0 ? Kind::Nccl : Kind::Move) << "call " << i;
  ASSERT_EQ(rank.fakes.contributed.size(), 6u);
  const Contribution& cost = rank.fakes.contributed[5];
  ASSERT_EQ(cost.costs.size(), 2u);
  for (const BucketCost& b : cost.costs) {
    EXPECT_EQ(b.moved_ns, 500u);
    EXPECT_EQ(b.nccl_ns, kNcclGatherNs);
  }
}

// The same trial with a transport faster than NCCL: every bucket keeps moving.
TEST(AgreementRounds, TheCostRoundKeepsMovingWhatWasFaster) {
  Rank0 rank(Env{});
  rank.fakes.moved_ns = 20;
  const std::vector<Kind> kinds = rank.steps(14);
  for (size_t i = 30; i < kinds.size(); ++i)
    EXPECT_EQ(kinds[i], i % kPeriod == 0 ? Kind::Nccl : Kind::Move) << "call " << i;
  EXPECT_EQ(rank.find(trace::RoundEvent::Deactivated, RoundKind::Propose), nullptr);
}

// Static weights under the cost trial, which keeps position 1 on NCCL (its bucket is slow on the
// transport) and position 2 moving. Then the program re-homes both layers, each into the block
// the one before had: position 1's shard to a new block, position 2's to position 1's old one.
// Position 1's call, on NCCL, still says where its shard went: position 2's call then finds a
// block nobody's shard lives in, and reads its own binding (with a check owed). Were the calls
// NCCL serves not followed, that block would still be position 1's home, and position 2 would
// read position 1's binding on every peer: wrong bytes.
TEST(AgreementRounds, HomesFollowTheCallsTheCostRoundKeptOnNccl) {
  Rank0 rank(Env{{"MAGI_STATIC_WEIGHTS", "1"}});
  rank.same_sizes = true;
  rank.fakes.moved_ns = 20;
  rank.fakes.slow_slot = 0;
  rank.fakes.slow_ns = 500;
  std::vector<Kind> kinds = rank.steps(12);
  ASSERT_EQ(rank.next() % kPeriod, 0u);
  // Position 1's shard is the one at slot 0: the trial timed it slow, and NCCL kept it.
  size_t own_slot_2 = SIZE_MAX;
  for (const std::vector<ce::GatherOp>& b : rank.fakes.buckets) {
    ASSERT_EQ(b.size(), 1u);
    EXPECT_EQ(b.front().slot_offset == 0, b.front().sendbuf == rank.own_send(1));
    if (b.front().sendbuf == rank.own_send(2)) own_slot_2 = b.front().slot_offset;
  }
  ASSERT_NE(own_slot_2, SIZE_MAX);
  EXPECT_EQ(rank.steps(1), (std::vector<Kind>{Kind::Nccl, Kind::Nccl, Kind::Move}));
  EXPECT_FALSE(rank.fakes.buckets.back().front().verify_now);

  rank.sends[1] = rank.spare();
  rank.sends[2] = rank.own_send(1);
  EXPECT_EQ(rank.steps(1), (std::vector<Kind>{Kind::Nccl, Kind::Nccl, Kind::Move}));
  const ce::GatherOp& moved = rank.fakes.buckets.back().front();
  EXPECT_EQ(moved.sendbuf, rank.own_send(1));
  EXPECT_EQ(moved.slot_offset, own_slot_2);  // its own binding, not position 1's
  EXPECT_EQ(moved.own_offset, ce::GatherOp::kOwn);
  EXPECT_TRUE(moved.verify_now);  // the new home is checked against that binding
  // From then on the new home is simply position 2's.
  EXPECT_EQ(rank.steps(1), (std::vector<Kind>{Kind::Nccl, Kind::Nccl, Kind::Move}));
  EXPECT_EQ(rank.fakes.buckets.back().front().slot_offset, own_slot_2);
  EXPECT_FALSE(rank.fakes.buckets.back().front().verify_now);
}

// Timers that cannot stop leave every bucket unmeasured: the calls are still served, and the
// cost round keeps the plan moving. The routes do not follow the timers, which are this rank's
// own: every bucket went to NCCL before the activation (the committing step), so nothing
// alternates, as on a peer whose timers did stop; after the activation every gather moves.
TEST(AgreementRounds, ATimerThatCannotStopLeavesTheTrialUnmeasured) {
  Rank0 rank(Env{});
  rank.fakes.timer_stop_throws = true;
  const std::vector<Kind> kinds = rank.steps(14);
  EXPECT_EQ(kinds[7], Kind::TrialNccl);  // committing (indices 7 and 8)
  EXPECT_EQ(kinds[8], Kind::TrialNccl);
  int trial_nccl = 0;
  for (size_t i = 0; i < kinds.size(); ++i) {
    if (kinds[i] == Kind::TrialNccl) ++trial_nccl;
    if (i < 10 || i % kPeriod == 0) continue;
    EXPECT_EQ(kinds[i], Kind::Move) << "call " << i;
  }
  EXPECT_EQ(trial_nccl, 2);
  EXPECT_EQ(rank.fakes.nccl_gathers, 2);
  ASSERT_GE(rank.fakes.contributed.size(), 5u);
  const Contribution& cost = rank.fakes.contributed[4];
  ASSERT_EQ(cost.costs.size(), 2u);
  for (const BucketCost& b : cost.costs) {
    EXPECT_EQ(b.moved_ns, 0u);
    EXPECT_EQ(b.nccl_ns, 0u);
  }
}

// MAGI_REAGREE_STEPS=0: one agreement, then no round ever again.
TEST(AgreementRounds, ReagreeZeroMeansNoFurtherRounds) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_REAGREE_STEPS", "0"}});
  const std::vector<Kind> kinds = rank.steps(40);
  EXPECT_EQ(rank.fakes.rounds_launched, 4);  // hello, propose, publish, confirm
  EXPECT_EQ(kinds.back(), Kind::Move);
  Rank0 refused(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_REAGREE_STEPS", "0"}});
  refused.fakes.peer = [](int r, Contribution& c) {
    if (r == 1) c.header.host = 7;  // a peer on another node
  };
  refused.steps(40);
  EXPECT_EQ(refused.issued(), (Issued{{0, RoundKind::Hello}, {6, RoundKind::Propose}}));
}

// MAGI_DRY_RUN=1: the read propose activates a plan that only reports (WouldMove); no window.
TEST(AgreementRounds, DryRunReportsWouldMoveAndMovesNothing) {
  Rank0 rank(Env{{"MAGI_DRY_RUN", "1"}});
  const std::vector<Kind> kinds = rank.steps(8);
  for (uint64_t i = 0; i < 7; ++i) EXPECT_EQ(kinds[i], Kind::Nccl) << "call " << i;
  for (uint64_t i = 7; i < kinds.size(); ++i)
    EXPECT_EQ(kinds[i], i % kPeriod == 0 ? Kind::Nccl : Kind::WouldMove) << "call " << i;
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello}, {6, RoundKind::Propose}}));
  EXPECT_EQ(rank.fakes.transports_made, 0);
  EXPECT_EQ(rank.fakes.nccl_gathers, 0);  // the shim forwards WouldMove calls, not rewrite/
  const trace::AgreementRecord* on = rank.find(trace::RoundEvent::Activated, RoundKind::Propose);
  ASSERT_NE(on, nullptr);
  EXPECT_EQ(on->seq, 7u);  // read a call after its issue
}

// A moved call whose serving throws (here not even a magi::Error) is never sent to NCCL alone:
// its peers serve it through the transport, and the route would split. It fails, unmarked, and
// the next propose refuses every gather (TransportFailed), so all ranks leave together.
TEST(AgreementRounds, AThrowWhileServingAMovedCallFailsItAndNeverForwardsItAlone) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.run_to(10);  // the first call of the plan activated at 9
  rank.fakes.gather_throws = true;
  EXPECT_EQ(rank.call(), Kind::TrialNccl);  // served, not moved
  EXPECT_TRUE(rank.last.served);
  EXPECT_EQ(rank.last.result, ncclInternalError);
  EXPECT_EQ(rank.fakes.transport_gathers, 0);
  EXPECT_EQ(rank.fakes.nccl_gathers, 0);
  rank.fakes.gather_throws = false;
  const size_t before = rank.fakes.contributed.size();
  rank.steps(300);  // to the next propose (MAGI_REAGREE_STEPS)
  std::vector<GatherEntry> proposed;
  for (size_t i = before; i < rank.fakes.contributed.size(); ++i)
    if (rank.fakes.contributed[i].header.kind == static_cast<uint8_t>(RoundKind::Propose))
      proposed = rank.fakes.contributed[i].entries;
  ASSERT_FALSE(proposed.empty());
  for (const GatherEntry& e : proposed)
    EXPECT_EQ(e.reason, static_cast<uint8_t>(Reason::TransportFailed));
}

// Inside a group the calls are queued (served at the group's end). A throw there: what was
// served stays served, a moved call not yet served fails (never forwarded alone), and the
// group's end says so.
TEST(AgreementRounds, AThrowAtTheGroupsEndFailsTheMovedCallsNotYetServed) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.run_to(16);
  rank.fakes.group = {1, false, 1};
  EXPECT_EQ(rank.call(), Kind::Move);  // queued
  EXPECT_EQ(rank.call(), Kind::Move);  // queued, another bucket
  rank.fakes.group = {};
  rank.fakes.gather_throws = true;
  rank.fakes.gathers_before_throw = rank.fakes.transport_gathers + 1;
  EXPECT_EQ(group_ended(ncclSuccess), ncclInternalError);
  EXPECT_EQ(rank.fakes.transport_gathers, rank.fakes.gathers_before_throw);
  EXPECT_EQ(rank.fakes.nccl_gathers, 0);
}

// A gather captured into a CUDA graph at an agreed position: with static weights it moves on the
// plan in force, and the transport records it for the graph (Timing::Captured, never timed). In
// the default mode the plan in force has no graph slots (nothing was captured when it was
// agreed): that plan ends at the first captured gather, and one with graph slots is agreed there,
// at the capture, through the board. Either way the route is the plan's by position.
TEST(AgreementRounds, CapturedGathersMoveOnThePlanInForceOrOneAgreedAtTheCapture) {
  using Timing = ce::Transport::Timing;
  for (const bool static_weights : {true, false}) {
    SCOPED_TRACE(static_weights ? "static weights" : "default mode");
    Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_STATIC_WEIGHTS", static_weights ? "1" : "0"}});
    rank.run_to(33);  // the step of the next propose (read at 34), eager: no round in the capture
    ASSERT_EQ(rank.next() % 3, 0u);
    EXPECT_EQ(rank.steps(1), (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move}));
    const size_t eager = rank.fakes.timings.size();
    const int launched = rank.fakes.rounds_launched;
    rank.capturing = true;
    const std::vector<Kind> captured = rank.steps(1);
    rank.capturing = false;
    EXPECT_EQ(captured, (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move}));
    EXPECT_EQ(rank.fakes.timings.size(), eager + 2);
    for (size_t i = eager; i < rank.fakes.timings.size(); ++i)
      EXPECT_EQ(rank.fakes.timings[i], Timing::Captured);
    EXPECT_EQ(rank.fakes.rounds_launched, launched);  // no NCCL round at a capture
    EXPECT_EQ(rank.fakes.board_contributed.size(), static_weights ? 0u : 3u);
    ASSERT_EQ(rank.fakes.plans.size(), static_weights ? 1u : 2u);
    EXPECT_EQ(rank.fakes.plans.back().graph_slots, !static_weights);
    // Eager again after the capture: the plan goes on.
    EXPECT_EQ(rank.steps(1), (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move}));
    EXPECT_NE(rank.fakes.timings.back(), Timing::Captured);
  }
}

// The default mode: a captured gather moves only on a plan with graph slots. always: the first
// plan has them; auto: the capture itself ends the plan without them and agrees one with them,
// at the captured call; never: never, and nothing is agreed at the capture. The log says which,
// once for each answer.
TEST(AgreementRounds, CapturedGathersInTheDefaultModeMoveOnAPlanWithGraphSlots) {
  using Timing = ce::Transport::Timing;
  for (const std::string setting : {"auto", "always", "never"}) {
    SCOPED_TRACE("MAGI_GRAPH_SLOTS=" + setting);
    const test::InfoLogged info;
    Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_GRAPH_SLOTS", setting}});
    testing::internal::CaptureStderr();
    rank.run_to(33);  // the step of the next propose (read at 34), eager: no round in the capture
    EXPECT_EQ(rank.steps(1), (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move}));
    ASSERT_EQ(rank.fakes.plans.size(), 1u);
    EXPECT_EQ(rank.fakes.plans[0].graph_slots, setting == "always");
    EXPECT_FALSE(rank.fakes.plans[0].bound);
    auto captured_step = [&] {
      const size_t before = rank.fakes.timings.size();
      rank.capturing = true;
      const std::vector<Kind> kinds = rank.steps(1);
      rank.capturing = false;
      for (size_t i = before; i < rank.fakes.timings.size(); ++i)
        EXPECT_EQ(rank.fakes.timings[i], Timing::Captured);
      return kinds;
    };
    const std::vector<Kind> moved{Kind::Nccl, Kind::Move, Kind::Move};
    const std::vector<Kind> stays{Kind::Nccl, Kind::Nccl, Kind::Nccl};
    EXPECT_EQ(captured_step(), setting == "never" ? stays : moved);
    ASSERT_EQ(rank.fakes.plans.size(), setting == "auto" ? 2u : 1u);
    EXPECT_EQ(rank.fakes.plans.back().graph_slots, setting != "never");
    EXPECT_EQ(rank.fakes.board_contributed.size(), setting == "auto" ? 3u : 0u);
    // Eager steps, and a second graph on the same plan: no round at its capture.
    rank.steps(12);
    EXPECT_EQ(rank.steps(1), moved);
    EXPECT_EQ(captured_step(), setting == "never" ? stays : moved);
    EXPECT_EQ(rank.fakes.board_contributed.size(), setting == "auto" ? 3u : 0u);
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_EQ(test::count_lines(log, "; graph slots)"), setting == "never" ? 0u : 1u) << log;
    EXPECT_EQ(test::count_lines(log, "agreed at a CUDA graph capture"), setting == "auto" ? 1u : 0u)
        << log;
    EXPECT_EQ(test::count_lines(log, "move with the plan, on its graph slots"),
              setting == "never" ? 0u : 1u)
        << log;
    EXPECT_EQ(test::count_lines(log, "stay on NCCL on every rank: MAGI_GRAPH_SLOTS=never"),
              setting == "never" ? 1u : 0u)
        << log;
  }
}

// A graph captured before any plan was active keeps its gathers on NCCL at every replay, whatever
// is agreed later: the log says so once, with what to do about it.
TEST(AgreementRounds, AGatherCapturedBeforeAnyPlanIsActiveIsSaidToStayOnNccl) {
  const test::InfoLogged info;
  Rank0 rank(
      Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_STATIC_WEIGHTS", "1"}, {"MAGI_CAPTURE_WAIT_MS", "0"}});
  rank.run_to(9);
  testing::internal::CaptureStderr();
  rank.capturing = true;
  EXPECT_EQ(rank.steps(2), std::vector<Kind>(6, Kind::Nccl));
  rank.capturing = false;
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(test::count_lines(log,
                              "a gather captured into a CUDA graph at collective #10, before "
                              "any plan was active: that graph keeps its gathers on NCCL"),
            1u)
      << log;
  EXPECT_TRUE(rank.fakes.timings.empty());
}

// A graph captured before any plan was active: its first captured gather is agreed at the
// capture, through the board (propose, publish, confirm, within that call), in both modes, and
// the graph's gathers move from there; no NCCL round is issued during the capture. The plan stays
// in force after it.
// Shards a peer could map where they lie (a memfd shared mapping): at a capture a static plan
// reads every shard in place, or leaves it on NCCL (StepObservation::entries).
class SharedShards {
 public:
  SharedShards() {
    fd_ = memfd_create("agreement-rounds-shards", 0);
    EXPECT_GE(fd_, 0);
    EXPECT_EQ(ftruncate(fd_, kBytes), 0);
    base_ = mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    EXPECT_NE(base_, MAP_FAILED);
  }
  ~SharedShards() {
    munmap(base_, kBytes);
    close(fd_);
  }
  // 1000 floats for the gather at `position` (1 or 2).
  const void* shard(uint32_t position) const {
    return static_cast<const char*>(base_) + (position - 1) * 4096;
  }

 private:
  static constexpr size_t kBytes = 8192;
  int fd_ = -1;
  void* base_ = nullptr;
};

TEST(AgreementRounds, AGatherCapturedBeforeAnyPlanIsAgreedAtTheCaptureAndMoves) {
  using Timing = ce::Transport::Timing;
  for (const bool static_weights : {true, false}) {
    SCOPED_TRACE(static_weights ? "static weights" : "default mode");
    const test::InfoLogged info;
    Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_STATIC_WEIGHTS", static_weights ? "1" : "0"}});
    const SharedShards shards;
    for (uint32_t p : {1u, 2u}) rank.sends[p] = shards.shard(p);
    rank.run_to(3);  // one eager step: the hello issued, no propose yet
    const int launched = rank.fakes.rounds_launched;
    testing::internal::CaptureStderr();
    rank.capturing = true;
    const std::vector<Kind> captured = rank.steps(2);
    rank.capturing = false;
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_EQ(captured, (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move, Kind::Nccl,
                                           Kind::Move, Kind::Move}));
    EXPECT_EQ(rank.fakes.rounds_launched, launched);
    ASSERT_EQ(rank.fakes.board_contributed.size(), 3u);
    EXPECT_EQ(rank.fakes.board_contributed[0].header.kind,
              static_cast<uint8_t>(RoundKind::Propose));
    EXPECT_EQ(rank.fakes.board_contributed[1].header.kind,
              static_cast<uint8_t>(RoundKind::Publish));
    EXPECT_EQ(rank.fakes.board_contributed[2].header.kind,
              static_cast<uint8_t>(RoundKind::Confirm));
    for (const Contribution& c : rank.fakes.board_contributed)
      EXPECT_EQ(c.header.flags & kIssuedInGroup, 0u);
    // Captured positions are candidates at a capture (one look suffices).
    for (const GatherEntry& e : rank.fakes.board_contributed[0].entries)
      EXPECT_EQ(e.reason, 0) << "position " << e.position;
    ASSERT_EQ(rank.fakes.plans.size(), 1u);
    EXPECT_EQ(rank.fakes.plans[0].bound, static_weights);
    EXPECT_EQ(rank.fakes.plans[0].graph_slots, !static_weights);
    for (const Timing t : rank.fakes.timings) EXPECT_EQ(t, Timing::Captured);
    EXPECT_EQ(rank.fakes.timings.size(), 4u);
    const trace::AgreementRecord* activated =
        rank.find(trace::RoundEvent::Activated, RoundKind::Confirm);
    ASSERT_NE(activated, nullptr);
    EXPECT_EQ(activated->seq, 4u);
    EXPECT_EQ(test::count_lines(log,
                                "round [0-9]+ agreed at a CUDA graph capture \\(collective "
                                "#4\\): 2 of 2 gathers of the step leave NCCL from here, in "
                                "this graph and after it; untimed, decided by MAGI_CE_FORCE=1"),
              1u)
        << log;
    EXPECT_EQ(test::count_lines(log, "before any plan was active"), 0u) << log;
    EXPECT_EQ(rank.agreement_->phase(), Phase::Active);
    EXPECT_EQ(rank.steps(1), (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move}));
  }
}

// A step whose own facts repeat over 2 shape steps (call sites alternating) is refined at the
// capture itself, as an eager read would refine it, and proposed again at once on the longer
// step: the graph's gathers move, each at its refined position. (A MAGI_WARMUP_STEPS no eager
// step reaches: only the hello comes before the capture.)
TEST(AgreementRounds, AStepRefinedAtACaptureIsProposedAgainThereAndMoves) {
  const test::InfoLogged info;
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_WARMUP_STEPS", "1000"}});
  rank.alternating_callsites = true;
  rank.run_to(18);  // six eager steps: the own facts repeated twice
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello}}));
  testing::internal::CaptureStderr();
  rank.capturing = true;
  const std::vector<Kind> captured = rank.steps(2);
  rank.capturing = false;
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(captured, (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move, Kind::Nccl, Kind::Move,
                                         Kind::Move}))
      << log;
  ASSERT_EQ(rank.fakes.board_contributed.size(), 4u) << log;
  EXPECT_EQ(rank.fakes.board_contributed[0].header.kind, static_cast<uint8_t>(RoundKind::Propose));
  EXPECT_EQ(rank.fakes.board_contributed[1].header.kind, static_cast<uint8_t>(RoundKind::Propose));
  EXPECT_EQ(rank.fakes.board_contributed[1].header.period, 2 * kPeriod);
  EXPECT_EQ(test::count_lines(log, "the step is 6 collectives"), 1u) << log;
  EXPECT_EQ(test::count_lines(log,
                              "agreed at a CUDA graph capture \\(collective #19\\): 4 of 4 "
                              "gathers"),
            1u)
      << log;
}

// Untimed, a captured bucket moves by what eager cost rounds measured of its size, else by the
// size rule (1 MiB a rank): these shards of 4 KB stay, on every rank, said with the reason.
TEST(AgreementRounds, WithoutTimingSmallCapturedBucketsStayByTheSizeRule) {
  const test::InfoLogged info;
  Rank0 rank(Env{{"MAGI_STATIC_WEIGHTS", "1"}});
  const SharedShards shards;
  for (uint32_t p : {1u, 2u}) rank.sends[p] = shards.shard(p);
  rank.run_to(3);
  testing::internal::CaptureStderr();
  rank.capturing = true;
  EXPECT_EQ(rank.steps(1), std::vector<Kind>(3, Kind::Nccl));
  rank.capturing = false;
  const std::string log = testing::internal::GetCapturedStderr();
  ASSERT_EQ(rank.fakes.board_contributed.size(), 1u);  // the propose only
  EXPECT_TRUE(rank.fakes.plans.empty());
  EXPECT_EQ(test::count_lines(log,
                              "agreed at the capture, and stay on NCCL: every bucket is "
                              "below the size rule"),
            1u)
      << log;
  const trace::AgreementRecord* read = rank.find(trace::RoundEvent::Read, RoundKind::Propose);
  ASSERT_NE(read, nullptr);
  EXPECT_EQ(read->moved, 0u);
}

// Untimed, a captured bucket of a size the communicator's eager cost rounds judged keeps that
// verdict: where the copy engine won it (50 ns against NCCL's 100 on the fake clock) the plan
// agreed at the capture moves it, and says what decided; where NCCL won it, it stays, said so.
TEST(AgreementRounds, WithoutTimingACapturedBucketKeepsItsSizesEagerVerdict) {
  for (const uint64_t moved_ns : {50u, 500u}) {
    SCOPED_TRACE(moved_ns);
    const test::InfoLogged info;
    Rank0 rank(Env{});
    rank.fakes.moved_ns = moved_ns;
    rank.steps(40);  // the eager plan, its trial and its cost round, read
    const bool copy_engine_won = moved_ns < kNcclGatherNs;
    ASSERT_EQ(rank.steps(1), copy_engine_won
                                 ? (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move})
                                 : std::vector<Kind>(3, Kind::Nccl));
    testing::internal::CaptureStderr();
    rank.capturing = true;
    const std::vector<Kind> captured = rank.steps(1);
    rank.capturing = false;
    const std::string log = testing::internal::GetCapturedStderr();
    if (copy_engine_won) {
      EXPECT_EQ(captured, (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move}));
      EXPECT_EQ(test::count_lines(log,
                                  "agreed at a CUDA graph capture .*untimed, decided by the "
                                  "eager cost rounds' size verdicts"),
                1u)
          << log;
    } else {
      EXPECT_EQ(captured, std::vector<Kind>(3, Kind::Nccl));
      EXPECT_EQ(test::count_lines(log,
                                  "agreed at the capture, and stay on NCCL: NCCL was faster "
                                  "for its bucket \\(timed both ways\\)"),
                1u)
          << log;
    }
  }
}

// Static weights at a capture: a shard that cannot be read where it lies (this process's own
// memory) is not bound there (a binding's copy needs the program's work finished, a wait a
// capture refuses and that would end it): it stays on NCCL on every rank, with the reason.
TEST(AgreementRounds, StaticShardsThatCannotBeReadInPlaceStayAtACapture) {
  const test::InfoLogged info;
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_STATIC_WEIGHTS", "1"}});
  rank.run_to(3);
  testing::internal::CaptureStderr();
  rank.capturing = true;
  EXPECT_EQ(rank.steps(1), std::vector<Kind>(3, Kind::Nccl));
  rank.capturing = false;
  const std::string log = testing::internal::GetCapturedStderr();
  ASSERT_EQ(rank.fakes.board_contributed.size(), 1u);
  for (const GatherEntry& e : rank.fakes.board_contributed[0].entries)
    EXPECT_EQ(e.reason, static_cast<uint8_t>(Reason::NotInPlaceAtCapture)) << e.position;
  EXPECT_TRUE(rank.fakes.plans.empty());
  EXPECT_EQ(test::count_lines(log,
                              "stay on NCCL: static weights at a CUDA graph capture: its "
                              "shard cannot be read where it lies"),
            1u)
      << log;
}

// Static weights at a capture, gathers in place (FSDP's): a transient shard is neither read in
// place nor bound, so the whole plan stages, on graph slots, and the captured gathers move.
TEST(AgreementRounds, StaticGathersInPlaceAtACaptureStageOnGraphSlotsAndMove) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_STATIC_WEIGHTS", "1"}});
  for (uint32_t p : {1u, 2u}) rank.sends[p] = rank.own_recv(p);
  rank.run_to(3);
  rank.capturing = true;
  EXPECT_EQ(rank.steps(1), (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move}));
  rank.capturing = false;
  ASSERT_EQ(rank.fakes.board_contributed.size(), 3u);
  for (const GatherEntry& e : rank.fakes.board_contributed[0].entries) {
    EXPECT_EQ(e.reason, 0) << e.position;
    EXPECT_TRUE(e.flags & kEntryInPlace) << e.position;
  }
  ASSERT_EQ(rank.fakes.plans.size(), 1u);
  EXPECT_FALSE(rank.fakes.plans[0].bound);
  EXPECT_TRUE(rank.fakes.plans[0].graph_slots);
}

// A round at a capture that does not reach every rank (one did not capture, or is gone) is
// abandoned on every rank that took part: the captured gathers stay on NCCL, said at WARN, and
// the communicator takes no more rounds at capture; eager rounds go on.
TEST(AgreementRounds, AnAbandonedRoundAtACaptureKeepsNcclAndEndsRoundsAtCapture) {
  const test::InfoLogged info;
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}, {"MAGI_STATIC_WEIGHTS", "1"}});
  rank.fakes.board_abandons = "rank 2 did not come within 20000 ms";
  rank.run_to(9);
  testing::internal::CaptureStderr();
  rank.capturing = true;
  EXPECT_EQ(rank.steps(3), std::vector<Kind>(9, Kind::Nccl));
  rank.capturing = false;
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rank.fakes.board_contributed.size(), 1u);
  EXPECT_EQ(test::count_lines(log,
                              "MAGI WARN .*a round at a CUDA graph capture \\(collective "
                              "#10\\) was abandoned: rank 2 did not come within 20000 ms"),
            1u)
      << log;
  ASSERT_NE(rank.find(trace::RoundEvent::Abandoned, RoundKind::Propose), nullptr);
  // Eager rounds still agree a plan (the first eager propose finds the captured step's calls).
  rank.steps(12);
  EXPECT_EQ(rank.steps(1), (std::vector<Kind>{Kind::Nccl, Kind::Move, Kind::Move}));
}

// A peer that cannot serve what it captured (its window failed) refuses the publish at the
// capture: every rank reads it, and the graph keeps NCCL.
TEST(AgreementRounds, APeerRefusingAtTheCaptureKeepsTheGraphOnNccl) {
  const test::InfoLogged info;
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.run_to(9);
  rank.fakes.peer = [](int r, Contribution& c) {
    if (r == 3 && c.header.kind == static_cast<uint8_t>(RoundKind::Publish)) {
      c.header.flags &= ~kCanServe;
      c.header.reason = static_cast<uint8_t>(Reason::TransportFailed);
    }
  };
  testing::internal::CaptureStderr();
  rank.capturing = true;
  EXPECT_EQ(rank.steps(1), std::vector<Kind>(3, Kind::Nccl));
  rank.capturing = false;
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rank.fakes.board_contributed.size(), 2u);  // propose, publish
  EXPECT_EQ(test::count_lines(log, "stay on NCCL: not every rank could serve the plan"), 1u) << log;
  EXPECT_EQ(rank.agreement_->phase(), Phase::Watching);
}

// The hello: issued at the first collective not captured into a CUDA graph (the round's
// all-gather must run now), before any other round, carrying this rank's schedule settings.
TEST(AgreementRounds, TheHelloIsIssuedAtTheFirstCollectiveNotCaptured) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.capturing = true;
  rank.call();
  rank.call();
  EXPECT_EQ(rank.fakes.rounds_launched, 0);
  rank.capturing = false;
  rank.call();
  EXPECT_EQ(rank.fakes.rounds_launched, 1);
  EXPECT_EQ(rank.issued(), (Issued{{2, RoundKind::Hello}}));
  ASSERT_EQ(rank.fakes.contributed.size(), 1u);
  const Contribution& hello = rank.fakes.contributed[0];
  EXPECT_EQ(hello.header.kind, static_cast<uint8_t>(RoundKind::Hello));
  EXPECT_EQ(hello.header.round, 0u);
  ScheduleSettings s{};
  ASSERT_EQ(hello.table.size(), sizeof s);
  std::memcpy(&s, hello.table.data(), sizeof s);
  EXPECT_EQ(s.warmup_steps, 2);
  EXPECT_EQ(s.reagree_steps, 8);
  EXPECT_EQ(s.max_step_calls, 4096);
  EXPECT_EQ(s.ce_force, 1);
  EXPECT_EQ(s.backend, static_cast<uint8_t>(Options::Backend::Host));
  EXPECT_EQ(s.transport, static_cast<uint8_t>(Options::Transport::CopyEngine));
  EXPECT_EQ(s.backend_available, 1);
  rank.run_to(7);
  EXPECT_EQ(rank.issued(), (Issued{{2, RoundKind::Hello}, {6, RoundKind::Propose}}));
}

// Read where the first other round is due (the propose at index 6), not before: until then a
// rank has no reason to wait for it.
TEST(AgreementRounds, TheHelloIsReadOnlyWhenTheFirstRoundIsDue) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.run_to(6);
  EXPECT_EQ(rank.fakes.results_read, 0);
  EXPECT_EQ(rank.find(trace::RoundEvent::Read, RoundKind::Hello), nullptr);
  rank.call();
  EXPECT_EQ(rank.fakes.results_read, 1);
  const trace::AgreementRecord* read = rank.find(trace::RoundEvent::Read, RoundKind::Hello);
  ASSERT_NE(read, nullptr);
  EXPECT_EQ(read->seq, 6u);
  EXPECT_EQ(read->reason, static_cast<uint8_t>(Reason::None));
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello}, {6, RoundKind::Propose}}));
}

ScheduleSettings settings_in(const Contribution& c) {
  ScheduleSettings s{};
  EXPECT_EQ(c.table.size(), sizeof s);
  std::memcpy(&s, c.table.data(), std::min(sizeof s, c.table.size()));
  return s;
}

// A peer whose settings differ (or that cannot take part): nothing is issued after the hello,
// every call stays on NCCL, and the read says why.
TEST(AgreementRounds, DifferingSettingsIssueNothingAfterTheHello) {
  const std::vector<std::function<void(ScheduleSettings&)>> skews = {
      [](ScheduleSettings& s) { s.warmup_steps = 5; },
      [](ScheduleSettings& s) { s.reagree_steps = 10; },
      [](ScheduleSettings& s) { s.max_step_calls = 3; },
      [](ScheduleSettings& s) { s.ce_force = 0; },
      [](ScheduleSettings& s) { s.transport = static_cast<uint8_t>(Options::Transport::Nccl); },
      [](ScheduleSettings& s) { s.backend = static_cast<uint8_t>(Options::Backend::Cuda); },
      [](ScheduleSettings& s) { s.backend_available = 0; }};
  for (size_t k = 0; k < skews.size(); ++k) {
    Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
    rank.fakes.peer = [&](int r, Contribution& c) {
      if (r != 3 || c.header.kind != static_cast<uint8_t>(RoundKind::Hello)) return;
      ScheduleSettings s = settings_in(c);
      skews[k](s);
      c.table = hello_payload(s);
    };
    const std::vector<Kind> kinds = rank.steps(30);
    EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello}})) << "skew " << k;
    EXPECT_EQ(rank.fakes.rounds_launched, 1) << "skew " << k;
    for (const Kind kind : kinds) EXPECT_EQ(kind, Kind::Nccl) << "skew " << k;
    const trace::AgreementRecord* read = rank.find(trace::RoundEvent::Read, RoundKind::Hello);
    ASSERT_NE(read, nullptr) << "skew " << k;
    EXPECT_EQ(read->seq, 6u);
    EXPECT_EQ(read->reason, static_cast<uint8_t>(Reason::SettingsDiffer)) << "skew " << k;
  }
}

// Inside a group holding Send/Recv the hello cannot be launched alone: this rank votes no and
// never waits for it; a peer that voted no keeps this rank off too.
TEST(AgreementRounds, AHelloInASendRecvGroupVotesNoAndNothingFollows) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.fakes.group = {1, true, 2};
  rank.call();
  rank.fakes.group = {};
  EXPECT_EQ(group_ended(ncclSuccess), ncclSuccess);
  EXPECT_EQ(rank.fakes.group_ends, 0);  // not launched early
  ASSERT_EQ(rank.fakes.contributed.size(), 1u);
  EXPECT_TRUE(rank.fakes.contributed[0].header.flags & kIssuedInGroup);
  const std::vector<Kind> kinds = rank.steps(20);
  EXPECT_EQ(rank.fakes.results_read, 0);
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello}}));
  for (const Kind kind : kinds) EXPECT_EQ(kind, Kind::Nccl);
  const trace::AgreementRecord* read = rank.find(trace::RoundEvent::Read, RoundKind::Hello);
  ASSERT_NE(read, nullptr);
  EXPECT_EQ(read->reason, static_cast<uint8_t>(Reason::AnchorInGroup));

  Rank0 other(Env{{"MAGI_CE_FORCE", "1"}});
  other.fakes.peer = [](int r, Contribution& c) {
    if (r == 2 && c.header.kind == static_cast<uint8_t>(RoundKind::Hello))
      c.header.flags |= kIssuedInGroup;
  };
  other.steps(20);
  EXPECT_EQ(other.issued(), (Issued{{0, RoundKind::Hello}}));
  const trace::AgreementRecord* seen = other.find(trace::RoundEvent::Read, RoundKind::Hello);
  ASSERT_NE(seen, nullptr);
  EXPECT_EQ(seen->reason, static_cast<uint8_t>(Reason::AnchorInGroup));
}

// In an ordinary open group the hello is launched alone (the group so far first) and read like
// any round: the plan still comes.
TEST(AgreementRounds, AHelloInAnOrdinaryGroupIsLaunchedAloneAndReadLater) {
  Rank0 rank(Env{{"MAGI_CE_FORCE", "1"}});
  rank.fakes.group = {1, false, 1};
  rank.call();
  rank.fakes.group = {};
  EXPECT_EQ(group_ended(ncclSuccess), ncclSuccess);
  EXPECT_EQ(rank.fakes.group_ends, 1);
  EXPECT_EQ(rank.fakes.group_starts, 1);
  ASSERT_EQ(rank.fakes.contributed.size(), 1u);
  EXPECT_FALSE(rank.fakes.contributed[0].header.flags & kIssuedInGroup);
  rank.run_to(16);
  EXPECT_EQ(rank.call(), Kind::Move);  // as without the group (AnAgreedPlanMoves...)
}

// MAGI_TRANSPORT=nccl: the hello still goes (the peers' rounds would meet this rank's calls
// otherwise), nothing else does, and it is never waited for.
TEST(AgreementRounds, TransportNcclSaysHelloAndNothingElse) {
  Rank0 rank(Env{{"MAGI_TRANSPORT", "nccl"}});
  const std::vector<Kind> kinds = rank.steps(20);
  EXPECT_EQ(rank.issued(), (Issued{{0, RoundKind::Hello}}));
  EXPECT_EQ(rank.fakes.rounds_launched, 1);
  for (const Kind kind : kinds) EXPECT_EQ(kind, Kind::Nccl);
  EXPECT_EQ(settings_in(rank.fakes.contributed.at(0)).transport,
            static_cast<uint8_t>(Options::Transport::Nccl));
  // Every rank said nccl: nothing to tell.
  EXPECT_EQ(rank.find(trace::RoundEvent::Read, RoundKind::Hello), nullptr);

  Rank0 alone(Env{{"MAGI_TRANSPORT", "nccl"}});
  alone.fakes.peer = [](int r, Contribution& c) {
    if (r != 1 || c.header.kind != static_cast<uint8_t>(RoundKind::Hello)) return;
    ScheduleSettings s = settings_in(c);
    s.transport = static_cast<uint8_t>(Options::Transport::CopyEngine);
    c.table = hello_payload(s);
  };
  alone.steps(3);
  const trace::AgreementRecord* read = alone.find(trace::RoundEvent::Read, RoundKind::Hello);
  ASSERT_NE(read, nullptr);  // read once complete, to say why
  EXPECT_EQ(read->reason, static_cast<uint8_t>(Reason::SettingsDiffer));
  EXPECT_EQ(alone.issued().size(), 1u);
}

}  // namespace
}  // namespace magi::rewrite
