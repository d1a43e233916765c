// The test program's main: GoogleTest, plus one closing line "tests: N passed, M failed" that
// CI reads, whatever else the run printed.
#include <gtest/gtest.h>

#include <cstdio>

namespace {

class ClosingLine : public testing::EmptyTestEventListener {
  void OnTestProgramEnd(const testing::UnitTest& unit) override {
    std::printf("tests: %d passed, %d failed, %d skipped\n", unit.successful_test_count(),
                unit.failed_test_count(), unit.skipped_test_count());
    std::fflush(stdout);
  }
};

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  testing::UnitTest::GetInstance()->listeners().Append(new ClosingLine);
  return RUN_ALL_TESTS();
}
