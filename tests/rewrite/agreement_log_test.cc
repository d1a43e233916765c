// What a communicator's agreement says (rewrite/agreement_log.h): the lines said once per
// communicator or once per plan are said once, and the counts and phases they carry are right.
#include "rewrite/agreement_log.h"

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "tests/support/has_line.h"
#include "tests/support/info_logged.h"

namespace magi::rewrite {
namespace {

// What `say` printed on stderr, logged at INFO (TRACE with `trace`).
std::string said(const std::function<void()>& say, bool trace = false) {
  test::InfoLogged logged;
  if (trace) log_detail::g_level.store(2);
  testing::internal::CaptureStderr();
  say();
  return testing::internal::GetCapturedStderr();
}

TEST(AgreementLog, AnEarlyCaptureIsSaidOncePerCommunicator) {
  AgreementLog log(0xc0ffee);
  const std::string err = said([&] {
    log.early_capture(12);
    log.early_capture(15);
  });
  EXPECT_EQ(test::count_lines(err, "captured into a CUDA graph at collective #12, before any plan"),
            1u)
      << err;
  EXPECT_FALSE(test::has_line(err, "#15")) << err;
}

TEST(AgreementLog, WhatCapturedGathersGetIsSaidOnceForEachAnswer) {
  AgreementLog log(0xc0ffee);
  const std::string err = said([&] {
    for (int i = 0; i < 3; ++i) {
      log.captured(true, true, false, false);
      log.captured(false, false, false, true);
    }
  });
  EXPECT_EQ(test::count_lines(err, "move with the plan \\(static weights\\)"), 1u) << err;
  EXPECT_EQ(test::count_lines(err, "stay on NCCL on every rank: MAGI_GRAPH_SLOTS=never"), 1u)
      << err;
}

TEST(AgreementLog, APlansWindowIsSaidOncePerPlan) {
  AgreementLog log(0xc0ffee);
  const std::string err = said([&] {
    log.new_plan();
    log.staging_window(1024, 512, 2);
    log.staging_window(1024, 512, 2);   // its publish issued again
    log.cannot_prepare_window("gone");  // said already: the window line was this plan's
    log.new_plan();
    log.cannot_prepare_window("no memory");
    log.cannot_prepare_window("no memory");
  });
  EXPECT_EQ(test::count_lines(err, "window of 1024 bytes \\(two staging slots of 512\\) for 2"), 1u)
      << err;
  EXPECT_FALSE(test::has_line(err, "gone")) << err;
  EXPECT_EQ(test::count_lines(err, "WARN.*cannot prepare a window: no memory"), 1u) << err;
}

TEST(AgreementLog, TheSetUpsEndIsSaidOncePerAttach) {
  AgreementLog log(0xc0ffee);
  ce::WindowMemory m;
  m.peer_mappings = 14;
  EXPECT_FALSE(log.set_up_unsaid());
  const std::string err = said([&] {
    log.attach_begins();
    EXPECT_TRUE(log.set_up_unsaid());
    log.set_up_done(m, 3.5, true);
    EXPECT_FALSE(log.set_up_unsaid());
    log.set_up_done(m, 3.5, true);
  });
  EXPECT_EQ(test::count_lines(err,
                              "mapped 14 allocations of the peers \\(set-up 3.5 ms, off the "
                              "program's calls\\)"),
            1u)
      << err;
}

TEST(AgreementLog, CallsReadingAnotherBindingAreSaidAtTheFirstAndCountedAtThePlansEnd) {
  AgreementLog log(0xc0ffee);
  const std::string err = said([&] {
    log.new_plan();
    for (int i = 0; i < 5; ++i) log.other_source(3);
    log.deactivated(40, Reason::Deviated);
    log.deactivated(41, Reason::None);  // nothing counted since
  });
  EXPECT_EQ(test::count_lines(err, "gather at position 3 sends a buffer bound for another"), 1u)
      << err;
  EXPECT_EQ(test::count_lines(err, "5 moved calls read another position's binding"), 1u) << err;
  EXPECT_EQ(test::count_lines(err, "moved calls read another"), 1u) << err;
  EXPECT_TRUE(test::has_line(err,
                             "gathers back on NCCL from collective #41 \\(a new plan "
                             "replaces this one\\)"))
      << err;
}

TEST(AgreementLog, APhaseChangeIsTracedAndNoChangeIsNot) {
  AgreementLog log(0xc0ffee);
  const std::string err = said(
      [&] {
        log.phase(Phase::Watching, Phase::Proposing, 6);
        log.phase(Phase::Active, Phase::Active, 7);
      },
      true);
  EXPECT_EQ(test::count_lines(err, "phase watching -> proposing at collective #6"), 1u) << err;
  EXPECT_EQ(test::count_lines(err, "phase "), 1u) << err;
  // Not at INFO: a reader asks for it (MAGI_LOG=TRACE).
  EXPECT_EQ(said([&] { log.phase(Phase::Watching, Phase::Proposing, 6); }), "");
}

}  // namespace
}  // namespace magi::rewrite
