// Python call sites in a process with no interpreter (this test program): nothing is recorded,
// and after the first call, which looks for the interpreter once, a call costs next to nothing.
#include "capture/py_callsite.h"

#include <gtest/gtest.h>

#include <chrono>

#include "tests/support/launch.h"

namespace magi::capture {
namespace {

TEST(PythonCallsite, NoInterpreterRecordsNothingAndCostsNothingVisible) {
  EXPECT_EQ(python_callsite(nullptr, false), 0u);  // the first call looks for Py_IsInitialized
  constexpr int kCalls = 1000000;
  uint64_t any = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) any |= python_callsite(nullptr, false);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(any, 0u);
  const double ns = std::chrono::duration<double, std::nano>(elapsed).count() / kCalls;
  // One atomic load and a compare; the bound leaves room for a loaded machine, and is stretched
  // as the sanitizer suites stretch their limits (TSan measured 51 ns on a loaded machine).
  EXPECT_LT(ns, 50.0 * support::timeout_scale()) << ns << " ns per call";
}

}  // namespace
}  // namespace magi::capture
