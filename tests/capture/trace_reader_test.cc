#include "capture/trace_reader.h"

#include <gtest/gtest.h>
#include <nccl.h>
#include <unistd.h>

#include <array>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tests/support/trace_builder.h"

namespace magi::trace {
namespace {

using testing::CallSpec;
using testing::make_agreement;
using testing::make_call;
using testing::make_comm;
using testing::make_decision;
using testing::make_file_header;
using testing::TraceBuilder;

constexpr uint64_t kComm = 0x3f2a0c1d9e7b5511ull;
constexpr uint16_t kUnknownType = 0x7777;

template <class T>
bool same_bytes(const T& a, const T& b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// A small file with one record of every type, fields set to distinct values.
struct EveryRecord {
  FileHeader header = make_file_header(31337, "gpu-node-7", "train.py", 123456789, 987654321);
  CommRecord comm = make_comm(kComm, 2, 4, CommOrigin::Split, 0xabcdef0123456789ull, 1111);
  CallRecord call =
      make_call(kComm, 2, 41, {Op::ReduceScatter, 9, 65536, -1, 4, 0xfeedull}, 2222, 333);
  CommEndRecord end{kComm, 4444, 42, static_cast<uint8_t>(CommEndKind::Destroy), {}};
  std::array<Frame, 3> frames{{{0x1111, 0x10}, {0x2222, 0x20}, {0, 0}}};
  std::string module_name = "/usr/lib/libtorch_cuda.so";  // 25 bytes: exercises padding
  StepRecord step{kComm, 100, 4, 0x5eed, 32, 3, static_cast<uint8_t>(StepEvent::Found), {}};
  AgreementRecord agreement =
      make_agreement(kComm, 2,
                     {7, RoundKind::Publish, RoundEvent::Read, 130, AgreementMode::Slot, 12, 5,
                      Reason::TransportFailed, 9, 0x5eed});
  DecisionRecord decision =
      make_decision(kComm, 2, 7, AgreementMode::Slot,
                    {11, Verdict::Stays, Reason::OtherRankRefused, 3, 4, 9, 65536, 0xfeed});

  TraceBuilder builder() const {
    TraceBuilder b(header);
    const uint64_t unknown_payload[3] = {1, 2, 3};
    b.comm(comm).callsite(0xfeed, frames).module(0x1111, module_name).call(call);
    b.record(kUnknownType, unknown_payload, sizeof(unknown_payload));
    b.step(step).agreement(agreement).decision(decision).dropped(17).dropped(3).comm_end(end);
    return b;
  }
};

std::string path_in_tmp(const char* stem) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir != nullptr ? dir : "/tmp") + "/" + stem + "." + std::to_string(getpid());
}

TraceFormatError parse_error(const std::string& bytes) {
  try {
    parse_trace("damaged.trace", bytes);
  } catch (const TraceFormatError& e) {
    return e;
  }
  ADD_FAILURE() << "a damaged trace parsed without error";
  return TraceFormatError("", 0, "");
}

uint32_t record_bytes_at(const std::string& bytes, size_t offset) {
  RecordHeader header;
  std::memcpy(&header, bytes.data() + offset, sizeof(header));
  return header.bytes;
}

void set_record_bytes(std::string& bytes, size_t offset, uint32_t value) {
  std::memcpy(bytes.data() + offset + offsetof(RecordHeader, bytes), &value, sizeof(value));
}

TEST(TraceReader, EveryRecordTypeRoundTrips) {
  const EveryRecord in;
  const Trace t = parse_trace("every.trace", in.builder().bytes());

  EXPECT_EQ(t.path, "every.trace");
  EXPECT_TRUE(same_bytes(t.header, in.header));
  ASSERT_EQ(t.comms.size(), 1u);
  EXPECT_TRUE(same_bytes(t.comms[0], in.comm));
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_TRUE(same_bytes(t.calls[0], in.call));
  ASSERT_EQ(t.comm_ends.size(), 1u);
  EXPECT_TRUE(same_bytes(t.comm_ends[0], in.end));
  ASSERT_EQ(t.steps.size(), 1u);
  EXPECT_TRUE(same_bytes(t.steps[0], in.step));
  ASSERT_EQ(t.agreements.size(), 1u);
  EXPECT_TRUE(same_bytes(t.agreements[0], in.agreement));
  ASSERT_EQ(t.decisions.size(), 1u);
  EXPECT_TRUE(same_bytes(t.decisions[0], in.decision));
  ASSERT_EQ(t.callsites.count(0xfeed), 1u);
  const std::vector<Frame>& frames = t.callsites.at(0xfeed).frames;
  ASSERT_EQ(frames.size(), in.frames.size());
  for (size_t i = 0; i < frames.size(); ++i) {
    EXPECT_EQ(frames[i].module, in.frames[i].module);
    EXPECT_EQ(frames[i].offset, in.frames[i].offset);
  }
  ASSERT_EQ(t.modules.count(0x1111), 1u);
  EXPECT_EQ(t.modules.at(0x1111), in.module_name);
  EXPECT_EQ(t.dropped, 20u);
  EXPECT_EQ(t.unknown_records, 1u);
}

// A gather queued in a group is written before its group ends; the GroupServed record written
// then sets how it was served on that call (rank and communicator must match), and only on it.
TEST(TraceReader, GroupServedRecordMarksTheQueuedCallItNames) {
  constexpr uint64_t kOther = kComm + 1;
  const CallSpec gather{Op::AllGather, 7, 1024, -1, -1, 0x5eedull};
  CallRecord queued = make_call(kComm, 1, 40, gather, 100, 0);
  queued.flags = kCallInGroup;
  CallRecord fell_back = make_call(kComm, 1, 41, gather, 101, 0);
  fell_back.flags = kCallInGroup | kCallMoved;  // as a writer that marked at queue time did
  const CallRecord elsewhere = make_call(kOther, 1, 40, gather, 102, 0);
  TraceBuilder b;
  b.call(queued).call(fell_back).call(elsewhere);
  b.group_served({kComm, 40, 1, kCallMoved, {}});
  b.group_served({kComm, 41, 1, kCallFellBack, {}});
  b.group_served({kComm, 40, 3, kCallFellBack, {}});  // another rank's call: not in this file
  const Trace t = parse_trace("group.trace", b.bytes());
  ASSERT_EQ(t.calls.size(), 3u);
  EXPECT_EQ(t.calls[0].flags, kCallInGroup | kCallMoved);
  EXPECT_EQ(t.calls[1].flags, kCallInGroup | kCallFellBack);
  EXPECT_EQ(t.calls[2].flags, 0);
  EXPECT_EQ(t.unknown_records, 0u);
}

TEST(TraceReader, ReadTraceReadsTheFileFromDisk) {
  const EveryRecord in;
  const std::string path = path_in_tmp("magice-reader-disk.trace");
  in.builder().write(path);
  const Trace t = read_trace(path);
  ::unlink(path.c_str());
  EXPECT_EQ(t.path, path);
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_TRUE(same_bytes(t.calls[0], in.call));
  EXPECT_EQ(t.modules.at(0x1111), in.module_name);
}

TEST(TraceReader, MissingFileNamesThePath) {
  const std::string path = path_in_tmp("magice-reader-absent.trace");
  try {
    read_trace(path);
    FAIL() << "reading a missing file succeeded";
  } catch (const TraceFormatError& e) {
    EXPECT_EQ(e.file(), path);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
}

TEST(TraceReader, HeaderOnlyFileHasNoRecords) {
  const Trace t = parse_trace("empty.trace", TraceBuilder().bytes());
  EXPECT_TRUE(t.comms.empty());
  EXPECT_TRUE(t.calls.empty());
  EXPECT_EQ(t.unknown_records, 0u);
}

TEST(TraceReader, BadMagicIsRefusedAtOffsetZero) {
  std::string bytes = EveryRecord().builder().bytes();
  bytes[3] = 'X';
  const TraceFormatError e = parse_error(bytes);
  EXPECT_EQ(e.file(), "damaged.trace");
  EXPECT_EQ(e.offset(), 0u);
  EXPECT_NE(std::string(e.what()).find("magic"), std::string::npos) << e.what();
}

TEST(TraceReader, NewerVersionIsRefusedWithBothVersionsNamed) {
  FileHeader header = make_file_header();
  header.version = kVersion + 1;
  const TraceFormatError e = parse_error(TraceBuilder(header).bytes());
  EXPECT_EQ(e.offset(), offsetof(FileHeader, version));
  const std::string what = e.what();
  EXPECT_NE(what.find("newer"), std::string::npos) << what;
  EXPECT_NE(what.find(std::to_string(kVersion + 1)), std::string::npos) << what;
}

TEST(TraceReader, HeaderBytesSmallerThanTheHeaderIsRefused) {
  FileHeader header = make_file_header();
  header.header_bytes = sizeof(FileHeader) - 8;
  const TraceFormatError e = parse_error(TraceBuilder(header).bytes());
  EXPECT_EQ(e.offset(), offsetof(FileHeader, header_bytes));
  EXPECT_NE(std::string(e.what()).find("header_bytes"), std::string::npos) << e.what();
}

TEST(TraceReader, FileShorterThanItsHeaderIsATruncatedHeader) {
  const std::string bytes = TraceBuilder().bytes().substr(0, sizeof(FileHeader) - 1);
  const TraceFormatError e = parse_error(bytes);
  EXPECT_EQ(e.offset(), 0u);
  EXPECT_NE(std::string(e.what()).find("truncated file header"), std::string::npos) << e.what();
}

// A later writer may append header fields; records then start after header_bytes.
TEST(TraceReader, LongerHeaderIsSkippedByHeaderBytes) {
  FileHeader header = make_file_header();
  header.header_bytes = sizeof(FileHeader) + 16;
  TraceBuilder b(header);
  b.raw(std::string(16, '\x5a'));
  b.call(make_call(kComm, 0, 7, CallSpec{}));
  const Trace t = parse_trace("longer.trace", b.bytes());
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_EQ(t.calls[0].seq, 7u);
}

TEST(TraceReader, RecordOfZeroBytesNamesItsOffset) {
  TraceBuilder b;
  b.call(make_call(kComm, 0, 0, CallSpec{}));
  const size_t second = b.bytes().size();
  b.call(make_call(kComm, 0, 1, CallSpec{}));
  std::string bytes = b.bytes();
  set_record_bytes(bytes, second, 0);
  const TraceFormatError e = parse_error(bytes);
  EXPECT_EQ(e.offset(), second);
  EXPECT_NE(std::string(e.what()).find("smaller than its 8-byte header"), std::string::npos)
      << e.what();
}

TEST(TraceReader, RecordSizeNotAMultipleOfEightNamesItsOffset) {
  TraceBuilder b;
  const size_t first = b.bytes().size();
  b.call(make_call(kComm, 0, 0, CallSpec{}));
  std::string bytes = b.bytes();
  set_record_bytes(bytes, first, record_bytes_at(bytes, first) - 4);
  const TraceFormatError e = parse_error(bytes);
  EXPECT_EQ(e.offset(), first);
  EXPECT_NE(std::string(e.what()).find("multiple of 8"), std::string::npos) << e.what();
}

TEST(TraceReader, RecordReachingPastTheEndIsATruncatedRecord) {
  TraceBuilder b;
  b.comm(make_comm(kComm, 0, 2));
  const size_t last = b.bytes().size();
  b.call(make_call(kComm, 0, 0, CallSpec{}));
  std::string bytes = b.bytes();
  set_record_bytes(bytes, last, record_bytes_at(bytes, last) + 8);
  const TraceFormatError e = parse_error(bytes);
  EXPECT_EQ(e.offset(), last);
  EXPECT_NE(std::string(e.what()).find("truncated record at offset " + std::to_string(last)),
            std::string::npos)
      << e.what();
}

TEST(TraceReader, FileEndingMidRecordIsATruncatedRecord) {
  TraceBuilder b;
  b.comm(make_comm(kComm, 0, 2));
  const size_t last = b.bytes().size();
  b.call(make_call(kComm, 0, 0, CallSpec{}));
  const std::string bytes = b.bytes().substr(0, b.bytes().size() - 8);
  const TraceFormatError e = parse_error(bytes);
  EXPECT_EQ(e.offset(), last);
  EXPECT_NE(std::string(e.what()).find("truncated record at offset " + std::to_string(last)),
            std::string::npos)
      << e.what();
}

// Each known type must hold at least its payload struct: a short one is refused, not read past.
TEST(TraceReader, RecordShorterThanItsTypeNeedsIsRefused) {
  const std::array<std::pair<RecordType, size_t>, 12> minimum = {{
      {RecordType::Comm, sizeof(CommRecord)},
      {RecordType::Call, sizeof(CallRecord)},
      {RecordType::CommEnd, sizeof(CommEndRecord)},
      {RecordType::Callsite, sizeof(CallsiteRecord)},
      {RecordType::Module, sizeof(ModuleRecord)},
      {RecordType::Step, sizeof(StepRecord)},
      {RecordType::Dropped, sizeof(DroppedRecord)},
      {RecordType::Agreement, sizeof(AgreementRecord)},
      {RecordType::Decision, sizeof(DecisionRecord)},
      {RecordType::PyCallsite, sizeof(PyCallsiteRecord)},
      {RecordType::PyCall, sizeof(PyCallRecord)},
      {RecordType::GroupServed, sizeof(GroupServedRecord)},
  }};
  for (const auto& [type, needed] : minimum) {
    SCOPED_TRACE(static_cast<int>(type));
    const std::string payload(needed - 8, '\0');  // one 8-byte word short
    TraceBuilder b;
    const size_t at = b.bytes().size();
    b.record(static_cast<uint16_t>(type), payload.data(), payload.size());
    const TraceFormatError e = parse_error(b.bytes());
    EXPECT_EQ(e.offset(), at);
    EXPECT_NE(std::string(e.what()).find("needs " + std::to_string(needed)), std::string::npos)
        << e.what();
  }
}

TEST(TraceReader, CallsiteClaimingMoreFramesThanItHoldsIsRefused) {
  TraceBuilder b;
  const size_t at = b.bytes().size();
  const Frame frames[2] = {{1, 2}, {3, 4}};
  const CallsiteRecord record{0xfeed, 3, 0};  // claims three, holds two
  b.record(static_cast<uint16_t>(RecordType::Callsite), &record, sizeof(record), frames,
           sizeof(frames));
  const TraceFormatError e = parse_error(b.bytes());
  EXPECT_EQ(e.offset(), at);
  EXPECT_NE(std::string(e.what()).find("frames"), std::string::npos) << e.what();
}

TEST(TraceReader, ModuleNameLongerThanItsRecordIsRefused) {
  TraceBuilder b;
  const size_t at = b.bytes().size();
  const ModuleRecord record{0x1111, 4096, 0};
  b.record(static_cast<uint16_t>(RecordType::Module), &record, sizeof(record), "libx.so", 7);
  const TraceFormatError e = parse_error(b.bytes());
  EXPECT_EQ(e.offset(), at);
  EXPECT_NE(std::string(e.what()).find("name"), std::string::npos) << e.what();
}

TEST(TraceReader, ModuleBuildIdLongerThanItsRecordIsRefused) {
  TraceBuilder b;
  const size_t at = b.bytes().size();
  const ModuleRecord record{0x1111, 7, 4096};
  b.record(static_cast<uint16_t>(RecordType::Module), &record, sizeof(record), "libx.so", 7);
  const TraceFormatError e = parse_error(b.bytes());
  EXPECT_EQ(e.offset(), at);
  EXPECT_NE(std::string(e.what()).find("build-id"), std::string::npos) << e.what();
}

TEST(TraceReader, ModulePathAndBuildIdAreRead) {
  TraceBuilder b;
  b.module(0x1111, "/opt/lib/libx.so", std::string("\x01\x02\xfe", 3));
  const Trace t = parse_trace("modules.trace", b.bytes());
  EXPECT_EQ(t.modules.at(0x1111), "/opt/lib/libx.so");
  EXPECT_EQ(t.module_build_ids.at(0x1111), std::string("\x01\x02\xfe", 3));
}

TEST(TraceReader, PythonFramesAreReadAndOverlongOnesRefused) {
  TraceBuilder good;
  good.py_callsite(0xbeef, {{"/a/model.py", "forward", 42}, {"/a/train.py", "<module>", 7}});
  good.py_call({kComm, 3, 0xbeef, 1, 0});
  const Trace t = parse_trace("py.trace", good.bytes());
  ASSERT_EQ(t.py_callsites.at(0xbeef).size(), 2u);
  EXPECT_EQ(t.py_callsites.at(0xbeef)[0].file, "/a/model.py");
  EXPECT_EQ(t.py_callsites.at(0xbeef)[0].function, "forward");
  EXPECT_EQ(t.py_callsites.at(0xbeef)[0].line, 42);
  EXPECT_EQ(t.py_callsites.at(0xbeef)[1].function, "<module>");
  EXPECT_EQ(t.py_calls.at({kComm, 3, 1}), 0xbeefu);

  // A frame whose texts run past the record's text.
  TraceBuilder bad;
  const size_t at = bad.bytes().size();
  const PyCallsiteRecord record{0xbeef, 1, 4};
  char tail[16] = {};
  const PyFrameEntry entry{1, 200, 3};
  std::memcpy(tail, &entry, sizeof(entry));
  bad.record(static_cast<uint16_t>(RecordType::PyCallsite), &record, sizeof(record), tail, 12);
  const TraceFormatError e = parse_error(bad.bytes());
  EXPECT_EQ(e.offset(), at);
  EXPECT_NE(std::string(e.what()).find("runs past"), std::string::npos) << e.what();
}

TEST(TraceReader, UnknownRecordTypesAreSkippedAndCounted) {
  TraceBuilder b;
  const uint64_t payload[5] = {};
  b.record(kUnknownType, payload, sizeof(payload)).record(0, payload, 0);
  b.call(make_call(kComm, 0, 5, CallSpec{}));
  const Trace t = parse_trace("future.trace", b.bytes());
  EXPECT_EQ(t.unknown_records, 2u);
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_EQ(t.calls[0].seq, 5u);
}

// A trace cut anywhere (a killed writer, a full disk) either parses or reports where the damage
// starts; it is never read past its end.
TEST(TraceReader, EveryPrefixParsesOrNamesAnOffsetWithinIt) {
  const std::string whole = EveryRecord().builder().bytes();
  size_t clean = 0;
  for (size_t length = 0; length <= whole.size(); ++length) {
    const std::string prefix = whole.substr(0, length);
    try {
      parse_trace("cut.trace", prefix);
      ++clean;
    } catch (const TraceFormatError& e) {
      EXPECT_EQ(e.file(), "cut.trace");
      EXPECT_LE(e.offset(), length);
      if (length != 0) {
        EXPECT_LT(e.offset(), length) << "length " << length;
      }
    }
  }
  // Clean cuts are exactly the record boundaries after the header.
  size_t boundaries = 0;
  for (size_t at = sizeof(FileHeader); at < whole.size(); at += record_bytes_at(whole, at)) {
    ++boundaries;
  }
  EXPECT_EQ(clean, boundaries + 1);
}

// Damage to any single byte is survived the same way.
TEST(TraceReader, EveryDamagedByteParsesOrNamesAnOffset) {
  const std::string whole = EveryRecord().builder().bytes();
  for (size_t at = 0; at < whole.size(); ++at) {
    for (const unsigned char value : {0x00, 0xff, 0x80}) {
      std::string bytes = whole;
      bytes[at] = static_cast<char>(static_cast<unsigned char>(bytes[at]) ^ value ^ 0x01);
      try {
        parse_trace("flipped.trace", bytes);
      } catch (const TraceFormatError& e) {
        EXPECT_LT(e.offset(), bytes.size()) << "byte " << at;
      }
    }
  }
}

// The rounds of an agreement interleave with calls and with other communicators' rounds; the
// reader keeps each kind in file order, every field as written.
TEST(TraceReader, AgreementAndDecisionRecordsAreReadInFileOrder) {
  constexpr uint64_t kOther = 0x7c00ffee12340002ull;
  TraceBuilder b;
  b.comm(make_comm(kComm, 1, 2)).comm(make_comm(kOther, 1, 2));
  std::vector<AgreementRecord> agreements;
  std::vector<DecisionRecord> decisions;
  for (uint32_t round = 1; round <= 3; ++round) {
    const uint64_t comm = round == 2 ? kOther : kComm;
    agreements.push_back(
        make_agreement(comm, 1, {round, RoundKind::Propose, RoundEvent::Issued, 10 * round}));
    b.agreement(agreements.back());
    b.call(make_call(comm, 1, round, CallSpec{}));
    agreements.push_back(make_agreement(
        comm, 1,
        {round, RoundKind::Propose, RoundEvent::Read, 10 * round + 3, AgreementMode::Identical, 2,
         round == 3 ? 0u : 2u, round == 3 ? Reason::StepsDiffer : Reason::None}));
    b.agreement(agreements.back());
    for (uint32_t position : {0u, 2u}) {
      decisions.push_back(
          make_decision(comm, 1, round, AgreementMode::Identical,
                        {position, round == 3 ? Verdict::Stays : Verdict::Moved,
                         round == 3 ? Reason::StepsDiffer : Reason::None, -1,
                         static_cast<uint16_t>(position), 9, 4096u << position, 0xa0 + position}));
      b.decision(decisions.back());
    }
  }
  const Trace t = parse_trace("rounds.trace", b.bytes());
  EXPECT_EQ(t.calls.size(), 3u);
  ASSERT_EQ(t.agreements.size(), agreements.size());
  for (size_t i = 0; i < agreements.size(); ++i) {
    EXPECT_TRUE(same_bytes(t.agreements[i], agreements[i])) << "agreement " << i;
  }
  ASSERT_EQ(t.decisions.size(), decisions.size());
  for (size_t i = 0; i < decisions.size(); ++i) {
    EXPECT_TRUE(same_bytes(t.decisions[i], decisions[i])) << "decision " << i;
  }
  EXPECT_EQ(t.unknown_records, 0u);
}

// A later writer may grow the two records at their end: the known prefix is read, the rest
// skipped, as for every other type.
TEST(TraceReader, LongerAgreementRecordsKeepTheirKnownFields) {
  const AgreementRecord agreement = make_agreement(
      kComm, 0, {2, RoundKind::Confirm, RoundEvent::Activated, 77, AgreementMode::Slot, 4, 3});
  const DecisionRecord decision =
      make_decision(kComm, 0, 2, AgreementMode::Slot, {5, Verdict::WouldMove});
  const uint64_t later_fields[2] = {0xaaaa, 0xbbbb};
  TraceBuilder b;
  b.record(static_cast<uint16_t>(RecordType::Agreement), &agreement, sizeof(agreement),
           later_fields, sizeof(later_fields));
  b.record(static_cast<uint16_t>(RecordType::Decision), &decision, sizeof(decision), later_fields,
           sizeof(later_fields));
  const Trace t = parse_trace("longer-records.trace", b.bytes());
  ASSERT_EQ(t.agreements.size(), 1u);
  EXPECT_TRUE(same_bytes(t.agreements[0], agreement));
  ASSERT_EQ(t.decisions.size(), 1u);
  EXPECT_TRUE(same_bytes(t.decisions[0], decision));
}

TEST(TraceReader, ManyCallsAreReadInFileOrder) {
  constexpr uint64_t kCalls = 200000;
  TraceBuilder b;
  b.comm(make_comm(kComm, 0, 8));
  for (uint64_t seq = 0; seq < kCalls; ++seq) b.call(make_call(kComm, 0, seq, CallSpec{}, seq));
  const Trace t = parse_trace("long.trace", b.bytes());
  ASSERT_EQ(t.calls.size(), kCalls);
  for (uint64_t seq = 0; seq < kCalls; ++seq) ASSERT_EQ(t.calls[seq].seq, seq);
}

TEST(TraceFormatNames, DatatypesUseNcclNames) {
  const char* expected[] = {"int8",    "uint8",   "int32",   "uint32",   "int64",  "uint64",
                            "float16", "float32", "float64", "bfloat16", "f8e4m3", "f8e5m2"};
  for (uint8_t dtype = 0; dtype < 12; ++dtype) EXPECT_EQ(dtype_name(dtype), expected[dtype]);
  EXPECT_EQ(dtype_name(ncclBfloat16), "bfloat16");
  EXPECT_NE(dtype_name(200).find("200"), std::string_view::npos);
}

TEST(TraceFormatNames, ReductionsUseShortNamesAndNumberTheRest) {
  EXPECT_EQ(redop_name(ncclSum), "sum");
  EXPECT_EQ(redop_name(ncclProd), "prod");
  EXPECT_EQ(redop_name(ncclMax), "max");
  EXPECT_EQ(redop_name(ncclMin), "min");
  EXPECT_EQ(redop_name(ncclAvg), "avg");
  const std::string_view user = redop_name(ncclNumOps + 2);
  EXPECT_EQ(user, "op7");
  EXPECT_EQ(redop_name(ncclNumOps + 2).data(), user.data()) << "names are kept, not rebuilt";
}

TEST(TraceFormatNames, AgreementValuesHaveNamesAndUnknownOnesShowTheirNumber) {
  EXPECT_EQ(mode_name(AgreementMode::Slot), "slot");
  EXPECT_EQ(round_kind_name(RoundKind::Confirm), "confirm");
  EXPECT_EQ(round_event_name(RoundEvent::Deactivated), "deactivated");
  EXPECT_EQ(verdict_name(Verdict::WouldMove), "would move");
  EXPECT_EQ(reason_name(Reason::OtherRankRefused), "another rank refused it");
  for (uint8_t reason = 1; reason < static_cast<uint8_t>(Reason::Count); ++reason) {
    const std::string_view name = reason_name(static_cast<Reason>(reason));
    EXPECT_FALSE(name.empty()) << int{reason};
    EXPECT_EQ(name.find("reason#"), std::string_view::npos) << int{reason} << " has no name";
  }
  EXPECT_EQ(reason_name(Reason::Count), "reason#" + std::to_string(int(Reason::Count)));
  EXPECT_EQ(verdict_name(static_cast<Verdict>(0)), "verdict#0");
  EXPECT_EQ(mode_name(static_cast<AgreementMode>(9)), "mode#9");
}

TEST(TraceFormatNames, OnlySendAndRecvAreNotCollectives) {
  for (uint8_t op = static_cast<uint8_t>(Op::AllGather); op <= static_cast<uint8_t>(Op::Recv);
       ++op) {
    const bool point_to_point =
        op == static_cast<uint8_t>(Op::Send) || op == static_cast<uint8_t>(Op::Recv);
    EXPECT_EQ(is_collective(static_cast<Op>(op)), !point_to_point) << op_name(static_cast<Op>(op));
  }
  EXPECT_EQ(op_name(Op::ReduceScatter), "ReduceScatter");
  EXPECT_EQ(origin_name(CommOrigin::Split), "Split");
  EXPECT_EQ(end_name(CommEndKind::Abort), "Abort");
  EXPECT_NE(op_name(static_cast<Op>(99)).find("99"), std::string_view::npos);
}

}  // namespace
}  // namespace magi::trace
