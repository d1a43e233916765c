// The flight recorder's ring, written and read in memory: what a reader of a killed process's
// file keeps (complete records only) and what wraparound leaves (the last N).
#include "capture/flight_recorder.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <span>
#include <vector>

#include "capture/trace_format.h"
#include "capture/trace_reader.h"
#include "tests/capture/ring_file.h"

namespace magi::capture {
namespace {

constexpr uint64_t kComm = 0x1a2b3c4d5e6f7788ull;

// Rank 3 of 8, in process 42; completion not watched.
struct RingFile : TestRingFile {
  explicit RingFile(uint32_t capacity)
      : TestRingFile(capacity, kComm, 3, 8, 42, flight::kCompletionOff) {}
};

std::vector<uint64_t> seqs(const flight::RingView& ring) {
  std::vector<uint64_t> out;
  for (const auto& r : ring.records) out.push_back(r.seq);
  return out;
}

TEST(FlightRecorder, CapacityIsAPowerOfTwoWithinItsBounds) {
  EXPECT_EQ(flight::capacity_for(1), 16u);
  EXPECT_EQ(flight::capacity_for(16), 16u);
  EXPECT_EQ(flight::capacity_for(17), 32u);
  EXPECT_EQ(flight::capacity_for(1000), 1024u);
  EXPECT_EQ(flight::capacity_for(65536), 65536u);
  EXPECT_EQ(flight::segment_bytes(16) % flight::kPage, 0u);
}

TEST(FlightRecorder, TheRingHeaderNamesTheCommunicatorAndRank) {
  RingFile file(16);
  const flight::FileView view = file.read();
  ASSERT_EQ(view.rings.size(), 1u);
  EXPECT_EQ(view.header.pid, 42u);
  EXPECT_EQ(view.rings[0].header.comm_id, kComm);
  EXPECT_EQ(view.rings[0].header.rank, 3);
  EXPECT_EQ(view.rings[0].header.nranks, 8);
  EXPECT_TRUE(view.rings[0].records.empty());
  EXPECT_EQ(view.rings[0].torn, 0u);
}

TEST(FlightRecorder, WraparoundKeepsTheLastNCallsInOrder) {
  RingFile file(16);
  for (uint64_t seq = 0; seq < 100; ++seq) file.issue(seq, 1000 + seq);
  const flight::FileView view = file.read();
  ASSERT_EQ(view.rings.size(), 1u);
  std::vector<uint64_t> expected;
  for (uint64_t seq = 84; seq < 100; ++seq) expected.push_back(seq);
  EXPECT_EQ(seqs(view.rings[0]), expected);
  EXPECT_EQ(view.rings[0].records.back().count, 1099u);
  EXPECT_EQ(view.rings[0].records.back().collective, 100u);
}

TEST(FlightRecorder, ARecordTheProcessDiedWritingIsIgnored) {
  RingFile file(16);
  for (uint64_t seq = 0; seq < 20; ++seq) file.issue(seq, 1000 + seq);
  // As a kill between the stamp's zeroing and its publication leaves it: call 35's fields half
  // written over seq 19's slot, no stamp.
  flight::Record& torn = file.slot(19);
  std::atomic_ref<uint64_t>(torn.stamp).store(0);
  torn.seq = 35;
  torn.count = 777;
  const flight::FileView view = file.read();
  ASSERT_EQ(view.rings.size(), 1u);
  EXPECT_EQ(view.rings[0].torn, 1u);
  std::vector<uint64_t> expected;
  for (uint64_t seq = 4; seq < 19; ++seq) expected.push_back(seq);
  EXPECT_EQ(seqs(view.rings[0]), expected);
  for (const auto& r : view.rings[0].records) EXPECT_NE(r.count, 777u);

  // A stamp that names another seq than the slot holds is not a complete record either.
  std::atomic_ref<uint64_t>(file.slot(18).stamp).store(99);
  EXPECT_EQ(file.read().rings[0].records.size(), 14u);
}

TEST(FlightRecorder, AReturnMarksTheCallingThreadsLastRecord) {
  RingFile file(16);
  file.issue(0, 10);
  flight_return(kComm, 0, 0);
  file.issue(1, 11);
  flight_return(kComm + 1, 1, 0);  // another communicator's return: not this record
  flight_return(kComm, 7, 0);      // another call's: not this record
  const flight::FileView view = file.read();
  ASSERT_EQ(view.rings[0].records.size(), 2u);
  EXPECT_EQ(view.rings[0].records[0].returned, 1u);
  EXPECT_EQ(view.rings[0].records[1].returned, 0u);
  flight_return(kComm, 1, 5);
  const flight::FileView after = file.read();
  EXPECT_EQ(after.rings[0].records[1].returned, 2u);
  EXPECT_EQ(after.rings[0].records[1].result, 5);
}

TEST(FlightRecorder, AnEndedCommunicatorSaysHow) {
  RingFile file(16);
  flight_end(file.ring(), static_cast<uint8_t>(trace::CommEndKind::Destroy));
  EXPECT_EQ(file.read().rings[0].header.ended,
            static_cast<uint32_t>(trace::CommEndKind::Destroy) + 1);
}

// A recorder file's bytes holding one kSites segment, as flight_add_site lays it out.
class SitesFile {
 public:
  SitesFile() : bytes_(flight::kPage + flight::kSitesSegmentBytes, 0) {
    flight::FileHeader header{};
    std::memcpy(header.magic, flight::kMagic, sizeof(header.magic));
    header.version = flight::kVersion;
    header.header_bytes = flight::kPage;
    header.capacity = 16;
    header.record_bytes = sizeof(flight::Record);
    std::memcpy(bytes_.data(), &header, sizeof(header));
    sites_ = flight::init_sites(bytes_.data() + flight::kPage, flight::kSitesSegmentBytes);
  }
  flight::SitesHeader& sites() { return *sites_; }
  char* body() { return reinterpret_cast<char*>(sites_ + 1); }
  // What a reader of the file decodes of its call sites.
  trace::Trace read() const {
    const flight::FileView view =
        flight::parse_file("sites", std::span<const char>(bytes_.data(), bytes_.size()));
    trace::Trace t;
    for (const std::string& segment : view.sites) trace::parse_records("sites", segment, t);
    return t;
  }

 private:
  std::vector<char> bytes_;
  flight::SitesHeader* sites_;
};

constexpr trace::Frame kFrames[2] = {{0x11, 0x100}, {0x22, 0x200}};

bool append_callsite(flight::SitesHeader& sites, uint64_t callsite) {
  const trace::CallsiteRecord record{callsite, 2, 0};
  return flight::append_site(sites, trace::RecordType::Callsite, &record, sizeof(record), kFrames,
                             sizeof(kFrames));
}

TEST(FlightRecorder, SiteDescriptionsAreReadAsTraceRecords) {
  SitesFile file;
  const std::string path = "/opt/app/libmodel.so";
  const trace::ModuleRecord module{0x11, static_cast<uint32_t>(path.size()), 0};
  ASSERT_TRUE(flight::append_site(file.sites(), trace::RecordType::Module, &module, sizeof(module),
                                  path.data(), static_cast<uint32_t>(path.size())));
  ASSERT_TRUE(append_callsite(file.sites(), 0xa));
  const trace::Trace t = file.read();
  EXPECT_EQ(t.modules.at(0x11), path);
  ASSERT_EQ(t.callsites.count(0xa), 1u);
  ASSERT_EQ(t.callsites.at(0xa).frames.size(), 2u);
  EXPECT_EQ(t.callsites.at(0xa).frames[1].module, 0x22u);
  EXPECT_EQ(t.callsites.at(0xa).frames[1].offset, 0x200u);
}

TEST(FlightRecorder, AHalfAppendedSiteDescriptionIsNotRead) {
  SitesFile file;
  ASSERT_TRUE(append_callsite(file.sites(), 0xa));
  // The process dies appending the next description: half its bytes are there, `used` has not
  // moved past them.
  const trace::CallsiteRecord next{0xb, 2, 0};
  std::vector<char> encoded(trace::record_bytes(sizeof(next), sizeof(kFrames)));
  trace::encode_record(encoded.data(), trace::RecordType::Callsite, &next, sizeof(next), kFrames,
                       sizeof(kFrames));
  std::memcpy(file.body() + file.sites().used, encoded.data(), encoded.size() / 2);
  trace::Trace t = file.read();
  EXPECT_EQ(t.callsites.count(0xa), 1u);
  EXPECT_EQ(t.callsites.count(0xb), 0u);
  // Appended whole, it is read.
  ASSERT_TRUE(append_callsite(file.sites(), 0xb));
  t = file.read();
  EXPECT_EQ(t.callsites.count(0xa), 1u);
  EXPECT_EQ(t.callsites.count(0xb), 1u);
}

TEST(FlightRecorder, AFullSitesSegmentRefusesMore) {
  SitesFile file;
  int appended = 0;
  while (append_callsite(file.sites(), 0x100 + appended)) ++appended;
  const uint32_t each = trace::record_bytes(sizeof(trace::CallsiteRecord), sizeof(kFrames));
  EXPECT_EQ(appended,
            static_cast<int>((flight::kSitesSegmentBytes - sizeof(flight::SitesHeader)) / each));
  const trace::Trace t = file.read();
  EXPECT_EQ(t.callsites.size(), static_cast<size_t>(appended));
}

// A full segment is followed by a new one (flight_add_site): the reader takes every segment's
// descriptions, and none of a segment whose size was never written (the process died adding it).
TEST(FlightRecorder, SitesOfEverySegmentAreRead) {
  std::vector<char> bytes(flight::kPage + 3 * flight::kSitesSegmentBytes, 0);
  flight::FileHeader header{};
  std::memcpy(header.magic, flight::kMagic, sizeof(header.magic));
  header.version = flight::kVersion;
  header.header_bytes = flight::kPage;
  header.capacity = 16;
  header.record_bytes = sizeof(flight::Record);
  std::memcpy(bytes.data(), &header, sizeof(header));
  char* segment = bytes.data() + flight::kPage;
  ASSERT_TRUE(append_callsite(*flight::init_sites(segment, flight::kSitesSegmentBytes), 0xa));
  segment += flight::kSitesSegmentBytes;
  ASSERT_TRUE(append_callsite(*flight::init_sites(segment, flight::kSitesSegmentBytes), 0xb));
  segment += flight::kSitesSegmentBytes;
  // A third segment the process died adding: its records are there, its size is not.
  flight::SitesHeader* dangling = flight::init_sites(segment, flight::kSitesSegmentBytes);
  ASSERT_TRUE(append_callsite(*dangling, 0xc));
  dangling->segment.bytes = 0;

  const flight::FileView view =
      flight::parse_file("sites", std::span<const char>(bytes.data(), bytes.size()));
  ASSERT_EQ(view.sites.size(), 2u);
  trace::Trace t;
  for (const std::string& body : view.sites) trace::parse_records("sites", body, t);
  EXPECT_EQ(t.callsites.count(0xa), 1u);
  EXPECT_EQ(t.callsites.count(0xb), 1u);
  EXPECT_EQ(t.callsites.count(0xc), 0u);
}

TEST(FlightRecorder, OtherBytesAreRefused) {
  const std::string bytes = "MAGITRC\nnot a recorder file at all, but long enough to hold a header";
  EXPECT_THROW(flight::parse_file("x", std::span<const char>(bytes.data(), bytes.size())),
               std::runtime_error);
}

}  // namespace
}  // namespace magi::capture
