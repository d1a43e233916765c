// The trace records and log lines of rounds, decisions and windows (rewrite/round_log.h), read
// back from a sink: every field where the readers (tools/magice-trace, the tests) look for it.
#include "rewrite/round_log.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "tests/support/info_logged.h"

namespace magi::rewrite {
namespace {

// Every record written to the trace, in order.
struct Written {
  trace::RecordType type;
  std::vector<uint8_t> payload;

  template <typename Record>
  Record as() const {
    Record r{};
    EXPECT_GE(payload.size(), sizeof r);
    std::memcpy(&r, payload.data(), std::min(payload.size(), sizeof r));
    return r;
  }
  std::string text_after(size_t header) const {
    return std::string(payload.begin() + static_cast<std::ptrdiff_t>(header), payload.end());
  }
};

TraceSink into(std::vector<Written>& records) {
  return [&records](trace::RecordType type, const void* payload, uint32_t bytes) {
    const auto* p = static_cast<const uint8_t*>(payload);
    records.push_back({type, std::vector<uint8_t>(p, p + bytes)});
  };
}

TEST(RoundLog, ARoundRecordCarriesTheStampAndTheEvent) {
  std::vector<Written> records;
  const RoundStamp stamp{0xc0ffee, 3, 0xd15e57, 12, 4, 9};
  record_round(into(records), stamp, RoundKind::Confirm, trace::RoundEvent::Read, 1234,
               AgreementMode::Slot, Reason::CommitRefused, 5);
  ASSERT_EQ(records.size(), 1u);
  ASSERT_EQ(records[0].type, trace::RecordType::Agreement);
  ASSERT_EQ(records[0].payload.size(), sizeof(trace::AgreementRecord));
  const auto r = records[0].as<trace::AgreementRecord>();
  EXPECT_EQ(r.comm_id, 0xc0ffeeu);
  EXPECT_EQ(r.rank, 3);
  EXPECT_EQ(r.step_digest, 0xd15e57u);
  EXPECT_EQ(r.round, 12u);
  EXPECT_EQ(r.period, 4u);
  EXPECT_EQ(r.gathers, 9u);
  EXPECT_EQ(r.seq, 1234u);
  EXPECT_EQ(r.moved, 5u);
  EXPECT_EQ(r.kind, static_cast<uint8_t>(RoundKind::Confirm));
  EXPECT_EQ(r.event, static_cast<uint8_t>(trace::RoundEvent::Read));
  EXPECT_EQ(r.mode, static_cast<uint8_t>(AgreementMode::Slot));
  EXPECT_EQ(r.reason, static_cast<uint8_t>(Reason::CommitRefused));
}

// A step of three all-gathers, as this rank saw them.
StepObservation three_gathers() {
  StepObservation seen;
  seen.reset(3);
  seen.begin_step();
  for (uint32_t p = 0; p < 3; ++p) {
    CallFacts f;
    f.op = trace::Op::AllGather;
    f.dtype = static_cast<uint8_t>(p == 1 ? ncclHalf : ncclFloat);
    f.count = 1000 * (p + 1);
    f.callsite = 0xca11 + p;
    f.sendbuf = 0x10000 * (p + 1);
    seen.observe(p, f, ce::Backend::Host);
  }
  return seen;
}

Decision slot_decision(bool dry_run) {
  Decision d;
  d.mode = AgreementMode::Slot;
  d.dry_run = dry_run;
  d.gathers = {{0, 0, true, Reason::None, -1},
               {1, 1, false, Reason::OtherRankRefused, 2},
               {2, 2, false, Reason::OtherRankRefused, 1}};
  d.moved = 1;
  return d;
}

TEST(RoundLog, EachGatherOfADecisionIsRecordedWithItsVerdictAndThisRanksFacts) {
  const StepObservation seen = three_gathers();
  const capture::CommInfo info{0xc0ffee, 0, 1, 4, -1, capture::CommOrigin::InitRank, false};
  for (const bool dry_run : {false, true}) {
    std::vector<Written> records;
    record_decision(into(records), info, seen, slot_decision(dry_run), 7);
    ASSERT_EQ(records.size(), 3u);
    std::vector<uint8_t> verdicts;
    for (uint32_t p = 0; p < 3; ++p) {
      ASSERT_EQ(records[p].type, trace::RecordType::Decision);
      const auto r = records[p].as<trace::DecisionRecord>();
      EXPECT_EQ(r.comm_id, 0xc0ffeeu);
      EXPECT_EQ(r.rank, 1);
      EXPECT_EQ(r.round, 7u);
      EXPECT_EQ(r.position, p);
      EXPECT_EQ(r.bucket, p);
      EXPECT_EQ(r.callsite, 0xca11u + p);
      EXPECT_EQ(r.count, 1000u * (p + 1));
      EXPECT_EQ(r.dtype, static_cast<uint8_t>(p == 1 ? ncclHalf : ncclFloat));
      EXPECT_EQ(r.mode, static_cast<uint8_t>(AgreementMode::Slot));
      EXPECT_EQ(r.reason, static_cast<uint8_t>(p == 0 ? Reason::None : Reason::OtherRankRefused));
      EXPECT_EQ(r.refused_by, p == 0 ? -1 : p == 1 ? 2 : 1);
      verdicts.push_back(r.verdict);
    }
    const trace::Verdict moved = dry_run ? trace::Verdict::WouldMove : trace::Verdict::Moved;
    EXPECT_EQ(verdicts, (std::vector<uint8_t>{static_cast<uint8_t>(moved),
                                              static_cast<uint8_t>(trace::Verdict::Stays),
                                              static_cast<uint8_t>(trace::Verdict::Stays)}))
        << "dry run: " << dry_run;
  }
}

TEST(RoundLog, TheDecisionLineCountsWhatMovesAndWhyTheOthersStay) {
  const test::InfoLogged info_logged;
  const StepObservation seen = three_gathers();
  const capture::CommInfo info{0xc0ffee, 0, 1, 4, -1, capture::CommOrigin::InitRank, false};
  Decision stays_for_two_reasons = slot_decision(false);
  stays_for_two_reasons.gathers[2].reason = Reason::ShardTooSmall;
  Decision all_move;
  all_move.mode = AgreementMode::Identical;
  all_move.gathers = {{0, 0, true, Reason::None, -1}, {1, 1, true, Reason::None, -1}};
  all_move.moved = 2;
  testing::internal::CaptureStderr();
  record_decision([](trace::RecordType, const void*, uint32_t) {}, info, seen, slot_decision(false),
                  7);
  record_decision([](trace::RecordType, const void*, uint32_t) {}, info, seen, slot_decision(true),
                  8);
  record_decision([](trace::RecordType, const void*, uint32_t) {}, info, seen,
                  stays_for_two_reasons, 9);
  record_decision([](trace::RecordType, const void*, uint32_t) {}, info, seen, all_move, 10);
  const std::string log = testing::internal::GetCapturedStderr();
  const std::string refused(trace::reason_name(Reason::OtherRankRefused));
  const std::string small(trace::reason_name(Reason::ShardTooSmall));
  EXPECT_NE(log.find("comm 000000c0ffee round 7: mode slot, 1 of 3 gathers move; stay: 2 " +
                     refused + "\n"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("comm 000000c0ffee round 8: mode slot, 1 of 3 gathers would move; stay: 2 " +
                     refused + "\n"),
            std::string::npos)
      << log;
  // Reasons in their order, each with its count.
  EXPECT_NE(log.find("round 9: mode slot, 1 of 3 gathers move; stay: 1 " + small + "; 1 " +
                     refused + "\n"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("round 10: mode identical, 2 of 2 gathers move\n"), std::string::npos) << log;
}

TEST(RoundLog, AWindowRecordCarriesItsMemoryAndEachRefusalFollowsWithItsReason) {
  ce::WindowMemory memory;
  memory.window_bytes = 1 << 20;
  memory.bound_shards = 3;
  memory.bound_bytes = 12000;
  memory.exported_shards = 5;
  memory.exported_bytes = 20000;
  memory.exported_allocations = 2;
  memory.peer_mappings = 6;
  memory.refusals = {{"not exportable: host memory", 2, 8000, 1},
                     {std::string(2000, 'x'), 1, 4000, 4}};
  std::vector<Written> records;
  const RoundStamp stamp{0xc0ffee, 2, 0xd15e57, 12, 4, 9};
  record_window(into(records), stamp, 4321, AgreementMode::Identical, memory);
  ASSERT_EQ(records.size(), 3u);
  ASSERT_EQ(records[0].type, trace::RecordType::Window);
  const auto w = records[0].as<trace::WindowRecord>();
  EXPECT_EQ(w.comm_id, 0xc0ffeeu);
  EXPECT_EQ(w.seq, 4321u);
  EXPECT_EQ(w.round, 12u);
  EXPECT_EQ(w.rank, 2);
  EXPECT_EQ(w.window_bytes, uint64_t{1} << 20);
  EXPECT_EQ(w.bound_shards, 3u);
  EXPECT_EQ(w.bound_bytes, 12000u);
  EXPECT_EQ(w.exported_shards, 5u);
  EXPECT_EQ(w.exported_bytes, 20000u);
  EXPECT_EQ(w.exported_allocations, 2u);
  EXPECT_EQ(w.peer_mappings, 6u);
  EXPECT_EQ(w.mode, static_cast<uint8_t>(AgreementMode::Identical));

  ASSERT_EQ(records[1].type, trace::RecordType::WindowRefusal);
  const auto first = records[1].as<trace::WindowRefusalRecord>();
  EXPECT_EQ(first.comm_id, 0xc0ffeeu);
  EXPECT_EQ(first.round, 12u);
  EXPECT_EQ(first.rank, 2);
  EXPECT_EQ(first.shards, 2u);
  EXPECT_EQ(first.bytes, 8000u);
  EXPECT_EQ(first.first, 1);
  EXPECT_EQ(first.text_bytes, 27u);
  EXPECT_EQ(records[1].text_after(sizeof first), "not exportable: host memory");
  // A long reason is cut at 1 KiB.
  ASSERT_EQ(records[2].type, trace::RecordType::WindowRefusal);
  const auto second = records[2].as<trace::WindowRefusalRecord>();
  EXPECT_EQ(second.shards, 1u);
  EXPECT_EQ(second.first, 4);
  EXPECT_EQ(second.text_bytes, 1024u);
  EXPECT_EQ(records[2].text_after(sizeof second), std::string(1024, 'x'));
}

}  // namespace
}  // namespace magi::rewrite
