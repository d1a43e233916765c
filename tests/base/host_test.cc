#include "base/host.h"

#include <limits.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace magi {
namespace {

TEST(HostName, IsTheMachinesNameAndItsShortFormStopsAtTheFirstDot) {
  char expected[HOST_NAME_MAX + 1] = {};
  ASSERT_EQ(gethostname(expected, sizeof(expected) - 1), 0);
  EXPECT_STREQ(host_name(), expected);
  const std::string full = expected;
  const std::string short_form = full.substr(0, std::min<size_t>(full.find('.'), 63));
  EXPECT_EQ(std::string(short_host_name()), short_form);
  EXPECT_EQ(std::strchr(short_host_name(), '.'), nullptr);
}

// Read once: every thread, at any time, gets the same storage.
TEST(HostName, IsReadOnceForEveryThread) {
  std::vector<const char*> seen(8);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < seen.size(); ++i)
    threads.emplace_back([&seen, i] { seen[i] = short_host_name(); });
  for (std::thread& t : threads) t.join();
  for (const char* name : seen) EXPECT_EQ(name, short_host_name());
  EXPECT_EQ(host_name(), host_name());
}

}  // namespace
}  // namespace magi
