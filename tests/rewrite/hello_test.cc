// What every rank reads from a hello round: the same verdict from the same bytes, and one line
// that names each differing setting with every rank's value.
#include "rewrite/hello.h"

#include <gtest/gtest.h>

#include <vector>

#include "tests/support/options_env.h"

namespace magi::rewrite {
namespace {

std::vector<uint8_t> hellos(const std::vector<ScheduleSettings>& settings,
                            uint32_t flags_of_rank1 = 0) {
  std::vector<uint8_t> all(settings.size() * kContributionBytes);
  for (size_t r = 0; r < settings.size(); ++r) {
    Contribution c;
    c.header.magic = kContributionMagic;
    c.header.version = kContributionVersion;
    c.header.kind = static_cast<uint8_t>(RoundKind::Hello);
    c.header.rank = static_cast<int32_t>(r);
    c.header.nranks = static_cast<int32_t>(settings.size());
    if (r == 1) c.header.flags = flags_of_rank1;
    c.table = hello_payload(settings[r]);
    c.header.table_bytes = static_cast<uint32_t>(c.table.size());
    c.serialize(std::span<uint8_t>(all).subspan(r * kContributionBytes, kContributionBytes));
  }
  return all;
}

ScheduleSettings defaults() {
  return schedule_settings(test::options_from({{"MAGI_BACKEND", "host"}}), true);
}

TEST(Hello, AlikeSettingsAgree) {
  const HelloOutcome h = read_hello(hellos({defaults(), defaults(), defaults()}), 3);
  EXPECT_TRUE(h.agreed);
  EXPECT_EQ(h.reason, Reason::None);
  EXPECT_TRUE(h.why.empty());
}

TEST(Hello, ADifferenceNamesTheVariableAndEveryRanksValue) {
  std::vector<ScheduleSettings> s(4, defaults());
  s[1].warmup_steps = 5;
  const HelloOutcome h = read_hello(hellos(s), 4);
  EXPECT_FALSE(h.agreed);
  EXPECT_EQ(h.reason, Reason::SettingsDiffer);
  EXPECT_EQ(h.why,
            "MAGI_WARMUP_STEPS differs between ranks (rank 0: 3, rank 1: 5, rank 2: 3, rank 3: "
            "3): this communicator stays on NCCL on every rank; set it alike on every rank");
}

// MAGI_GRAPH_SLOTS and MAGI_STATIC_WEIGHTS decide only who comes to a round at a graph capture:
// a difference keeps every rank from those rounds, and nothing else.
TEST(Hello, CaptureSettingsThatDifferKeepOnlyTheRoundsAtACapture) {
  std::vector<ScheduleSettings> s(3, defaults());
  EXPECT_TRUE(read_hello(hellos(s), 3).capture_alike);
  s[2].graph_slots = static_cast<uint8_t>(Options::GraphSlots::Never);
  s[1].static_weights = 1;
  const HelloOutcome h = read_hello(hellos(s), 3);
  EXPECT_TRUE(h.agreed);
  EXPECT_TRUE(h.why.empty());
  EXPECT_FALSE(h.capture_alike);
  EXPECT_EQ(h.capture_why,
            "MAGI_GRAPH_SLOTS differs between ranks (rank 0: auto, rank 1: auto, rank 2: never); "
            "MAGI_STATIC_WEIGHTS differs between ranks (rank 0: 0, rank 1: 1, rank 2: 0)");
}

TEST(Hello, ManyRanksListEachValueWithItsRanks) {
  std::vector<ScheduleSettings> s(8, defaults());
  s[5].transport = static_cast<uint8_t>(Options::Transport::Nccl);
  s[6].transport = static_cast<uint8_t>(Options::Transport::Nccl);
  s[2].ce_force = 1;
  const HelloOutcome h = read_hello(hellos(s), 8);
  EXPECT_EQ(h.reason, Reason::SettingsDiffer);
  EXPECT_EQ(h.why,
            "MAGI_TRANSPORT differs between ranks (copy_engine on ranks 0-4, 7; nccl on ranks "
            "5-6); MAGI_CE_FORCE differs between ranks (0 on ranks 0-1, 3-7; 1 on rank 2): this "
            "communicator stays on NCCL on every rank; set it alike on every rank");
}

TEST(Hello, ARankThatCannotRunItsBackendKeepsEveryRankOff) {
  std::vector<ScheduleSettings> s(2, defaults());
  s[1].backend_available = 0;
  const HelloOutcome h = read_hello(hellos(s), 2);
  EXPECT_FALSE(h.agreed);
  EXPECT_EQ(h.reason, Reason::SettingsDiffer);
  EXPECT_NE(h.why.find("rank 1 cannot run"), std::string::npos) << h.why;
}

TEST(Hello, AHelloVotedNoInAGroupKeepsEveryRankOff) {
  const HelloOutcome h = read_hello(hellos({defaults(), defaults()}, kIssuedInGroup), 2);
  EXPECT_FALSE(h.agreed);
  EXPECT_EQ(h.reason, Reason::AnchorInGroup);
}

TEST(Hello, AnUnreadableHelloAgreesToNothing) {
  std::vector<uint8_t> all = hellos({defaults(), defaults()});
  all[kContributionBytes] ^= 0xff;  // rank 1's magic
  EXPECT_FALSE(read_hello(all, 2).agreed);
}

}  // namespace
}  // namespace magi::rewrite
