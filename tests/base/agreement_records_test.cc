// The agreement's words are bytes of the trace file: their values and the records' layouts are
// pinned here, so moving or editing them cannot change a file silently (that bumps kVersion).
#include "base/agreement_records.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <type_traits>

#include "capture/trace_format.h"
#include "rewrite/contribution.h"
#include "rewrite/exploration.h"

namespace magi::trace {
namespace {

TEST(TraceAgreementWords, KeepTheirValuesOnDisk) {
  EXPECT_EQ(kVersion, 1u);
  EXPECT_EQ(static_cast<int>(AgreementMode::Abort), 3);
  EXPECT_EQ(static_cast<int>(RoundKind::Hello), 5);
  EXPECT_EQ(static_cast<int>(RoundEvent::Abandoned), 5);
  EXPECT_EQ(static_cast<int>(Verdict::Stays), 3);
  EXPECT_EQ(static_cast<int>(Reason::NotStable), 1);
  EXPECT_EQ(static_cast<int>(Reason::TransportFailed), 18);
  EXPECT_EQ(static_cast<int>(Reason::NcclFaster), 24);
  EXPECT_EQ(static_cast<int>(Reason::SettingUp), 28);
  EXPECT_EQ(static_cast<int>(Reason::CaptureRule), 29);
  EXPECT_EQ(static_cast<int>(Reason::CaptureAbandoned), 30);
  EXPECT_EQ(static_cast<int>(Reason::NotInPlaceAtCapture), 31);
  EXPECT_EQ(static_cast<int>(Reason::MachinesUneven), 32);
  EXPECT_EQ(static_cast<int>(Reason::OneRankPerMachine), 33);
  EXPECT_EQ(static_cast<int>(Reason::MachinesOnDevice), 34);
  EXPECT_EQ(static_cast<int>(Reason::Count), 35);
}

TEST(TraceAgreementWords, RecordsKeepTheirLayout) {
  EXPECT_EQ(offsetof(AgreementRecord, round), 24u);
  EXPECT_EQ(offsetof(AgreementRecord, rank), 40u);
  EXPECT_EQ(offsetof(AgreementRecord, reason), 47u);
  EXPECT_EQ(offsetof(DecisionRecord, refused_by), 36u);
  EXPECT_EQ(offsetof(DecisionRecord, mode), 45u);
  EXPECT_EQ(offsetof(WindowRecord, round), 40u);
  EXPECT_EQ(offsetof(WindowRecord, mode), 64u);
  EXPECT_EQ(offsetof(WindowRefusalRecord, first), 16u);
  EXPECT_EQ(offsetof(WindowRefusalRecord, text_bytes), 36u);
}

// rewrite/ spells them through its own namespace (rewrite/contribution.h, exploration.h): the same
// types the trace format records.
static_assert(std::is_same_v<rewrite::AgreementMode, AgreementMode>);
static_assert(std::is_same_v<rewrite::RoundKind, RoundKind>);
static_assert(std::is_same_v<rewrite::Reason, Reason>);

TEST(TraceAgreementWords, AreTheTypesTheTraceFormatRecords) {
  AgreementRecord record{};
  record.reason = static_cast<uint8_t>(Reason::NcclFaster);
  EXPECT_EQ(reason_name(static_cast<Reason>(record.reason)),
            "NCCL was faster for its bucket (timed both ways)");
  EXPECT_EQ(static_cast<uint16_t>(RecordType::Agreement), 8u);
  EXPECT_EQ(static_cast<uint16_t>(RecordType::WindowRefusal), 14u);
}

}  // namespace
}  // namespace magi::trace
