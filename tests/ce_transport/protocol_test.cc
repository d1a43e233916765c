// The window protocol's handle blob (ce_transport/protocol.h): what one rank writes, another
// accepts only when every field matches its own plan, and refuses with the field's name.
#include "ce_transport/protocol.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstddef>
#include <cstdio>
#include <cstring>
#include <functional>
#include <set>
#include <string>

namespace magi::ce::protocol {
namespace {

struct TestMedium {
  char name[24];
  uint32_t device;
};

WindowShape shape() {
  WindowShape s;
  s.backend = Backend::Host;
  s.comm_identity = 0x1234'5678'9abc'def0;
  s.nranks = 4;
  s.window_bytes = 8192;
  s.slot_bytes = 4000;
  s.bound = false;
  return s;
}

HandleBlob blob_of(const WindowShape& s, int rank) {
  TestMedium medium{};
  std::snprintf(medium.name, sizeof(medium.name), "window-%d", rank);
  medium.device = 7;
  HandleBlob blob;
  write_blob(s, rank, s.bound ? "/magice-ce-log-test" : "", medium, blob);
  return blob;
}

// The message of the Error(Usage) that `work` throws; "" (and a failure) if it throws none.
std::string refusal(const std::function<void()>& work) {
  try {
    work();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Usage) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "the blob was accepted";
  return "";
}

std::string refusal_of(const HandleBlob& blob, int rank, const WindowShape& s) {
  return refusal([&] { check_header(blob, rank, s); });
}

TEST(Protocol, ABlobIsAcceptedByAPeerOfTheSamePlanWithItsMediumIntact) {
  const HandleBlob blob = blob_of(shape(), 2);
  BlobHeader header{};
  const auto medium = read_blob<TestMedium>(blob, 2, shape(), header);
  EXPECT_STREQ(medium.name, "window-2");
  EXPECT_EQ(medium.device, 7u);
  EXPECT_EQ(header.magic, kBlobMagic);
  EXPECT_EQ(header.version, kBlobVersion);
  EXPECT_EQ(header.rank, 2);
  EXPECT_EQ(header.nranks, 4);
  EXPECT_EQ(header.comm_identity, shape().comm_identity);
  EXPECT_EQ(header.window_bytes, 8192u);
  EXPECT_EQ(header.slot_bytes, 4000u);
  EXPECT_EQ(header.bound, 0);
  EXPECT_EQ(header.pid, getpid());
}

TEST(Protocol, ABoundWindowsBlobIsAcceptedOnlyByABoundPeer) {
  WindowShape bound = shape();
  bound.bound = true;
  const HandleBlob blob = blob_of(bound, 1);
  EXPECT_NO_THROW(check_header(blob, 1, bound));
  EXPECT_NE(refusal_of(blob, 1, shape()).find("bound"), std::string::npos);
  EXPECT_NE(refusal_of(blob_of(shape(), 1), 1, bound).find("staging"), std::string::npos);
}

TEST(Protocol, ABlobThatIsNotAWindowsIsRefused) {
  HandleBlob blob = blob_of(shape(), 1);
  blob.bytes[0] ^= 0xff;
  EXPECT_NE(refusal_of(blob, 1, shape()).find("is not a window's"), std::string::npos);
  EXPECT_NE(refusal_of(HandleBlob{}, 1, shape()).find("is not a window's"), std::string::npos);
}

TEST(Protocol, ABlobOfAnotherProtocolVersionIsRefused) {
  HandleBlob blob = blob_of(shape(), 1);
  const uint32_t older = kBlobVersion - 1;
  std::memcpy(blob.bytes + offsetof(BlobHeader, version), &older, sizeof(older));
  EXPECT_NE(refusal_of(blob, 1, shape()).find("protocol version"), std::string::npos);
}

TEST(Protocol, ABlobOfTheOtherBackendIsRefused) {
  WindowShape cuda = shape();
  cuda.backend = Backend::Cuda;
  EXPECT_NE(refusal_of(blob_of(cuda, 1), 1, shape()).find("CUDA backend"), std::string::npos);
  EXPECT_NE(refusal_of(blob_of(shape(), 1), 1, cuda).find("host backend"), std::string::npos);
}

TEST(Protocol, ABlobOfAnotherRankOrRankCountIsRefused) {
  EXPECT_NE(refusal_of(blob_of(shape(), 1), 2, shape()).find("is rank 1 of 4, expected 2 of 4"),
            std::string::npos);
  WindowShape eight = shape();
  eight.nranks = 8;
  EXPECT_NE(refusal_of(blob_of(eight, 1), 1, shape()).find("is rank 1 of 8"), std::string::npos);
}

TEST(Protocol, ABlobOfAnotherCommunicatorIsRefused) {
  WindowShape other = shape();
  other.comm_identity += 1;
  EXPECT_NE(refusal_of(blob_of(other, 1), 1, shape()).find("another communicator"),
            std::string::npos);
}

TEST(Protocol, ABlobWithOtherSlotOrWindowBytesIsRefused) {
  WindowShape slots = shape();
  slots.slot_bytes = 4096;
  EXPECT_NE(refusal_of(blob_of(slots, 1), 1, shape()).find("slots of 4096 bytes, this rank 4000"),
            std::string::npos);
  WindowShape window = shape();
  window.window_bytes = 16384;
  EXPECT_NE(
      refusal_of(blob_of(window, 1), 1, shape()).find("window of 16384 bytes, this rank 8192"),
      std::string::npos);
}

TEST(Protocol, ABlobWithAMalformedBoundFlagOrNoPidIsRefused) {
  HandleBlob blob = blob_of(shape(), 1);
  blob.bytes[offsetof(BlobHeader, bound)] = 2;
  EXPECT_NE(refusal_of(blob, 1, shape()).find("bound"), std::string::npos);
  blob = blob_of(shape(), 1);
  const int64_t no_pid = 0;
  std::memcpy(blob.bytes + offsetof(BlobHeader, pid), &no_pid, sizeof(no_pid));
  EXPECT_NE(refusal_of(blob, 1, shape()).find("names no process"), std::string::npos);
}

TEST(Protocol, ReadingABlobChecksItFirst) {
  BlobHeader header{};
  EXPECT_NE(refusal([&] {
              read_blob<TestMedium>(blob_of(shape(), 1), 3, shape(), header);
            }).find("rank 3's handle blob"),
            std::string::npos);
}

// Every word of the handshake on a line of its own, inside the flags, none shared; the CUDA
// backend's prefix (all but the failed words) holds every ready and done word, the own word, the
// graph slots' latches and the left word.
TEST(Protocol, EveryFlagWordHasALineOfItsOwn) {
  for (const size_t line : {size_t{64}, size_t{256}}) {
    for (const int nranks : {1, 2, 3, 8}) {
      const FlagLayout layout{line, nranks};
      std::set<size_t> offsets;
      auto add = [&](size_t offset, size_t within) {
        EXPECT_EQ(offset % line, 0u);
        EXPECT_LT(offset, within);
        EXPECT_TRUE(offsets.insert(offset).second) << "offset " << offset << " used twice";
      };
      for (int r = 0; r < nranks; ++r) {
        add(layout.ready(r), layout.bytes_but_failed());
        add(layout.done(r), layout.bytes_but_failed());
        for (int slot = 0; slot < 2; ++slot) {
          add(layout.staged(slot, r), layout.bytes_but_failed());
          add(layout.read(slot, r), layout.bytes_but_failed());
        }
        add(layout.failed(r, 6), layout.bytes());
        add(layout.failed(r, 7), layout.bytes());
        EXPECT_EQ(layout.failed(r, 5), layout.failed(r, 7));  // by parity
      }
      add(layout.own(), layout.bytes_but_failed());
      add(layout.left(), layout.bytes_but_failed());
      EXPECT_EQ(offsets.size() * line, layout.bytes());  // nothing else in the flags
    }
  }
}

TEST(Protocol, FaultPointsStrikeOnlyTheirRankAndTheirPoint) {
  using Where = Options::Fault::Where;
  const Options::Fault prepare{Where::Prepare, 1};
  EXPECT_NO_THROW(FaultPoints(prepare, 0).at_prepare());
  EXPECT_NO_THROW(FaultPoints(prepare, 1).at_attach());
  EXPECT_FALSE(FaultPoints(prepare, 1).fails_bucket());
  try {
    FaultPoints(prepare, 1).at_prepare();
    ADD_FAILURE() << "prepare:1 did not strike rank 1's prepare";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::Cuda);
    EXPECT_NE(std::string(e.what()).find("injected by MAGI_INJECT_FAULT"), std::string::npos);
  }
  const Options::Fault attach{Where::Attach, 2};
  EXPECT_NO_THROW(FaultPoints(attach, 2).at_prepare());
  EXPECT_THROW(FaultPoints(attach, 2).at_attach(), Error);
  const Options::Fault gather{Where::Gather, 0};
  EXPECT_TRUE(FaultPoints(gather, 0).fails_bucket());
  EXPECT_FALSE(FaultPoints(gather, 1).fails_bucket());
  EXPECT_NO_THROW(FaultPoints(gather, 0).at_prepare());
  EXPECT_FALSE(FaultPoints(Options::Fault{}, 0).fails_bucket());
}

}  // namespace
}  // namespace magi::ce::protocol
