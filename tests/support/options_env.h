// Options as a test writes them: a map of MAGI_* variables, parsed by the library's own table
// (base/options.h). A value the table refuses fails the test that wrote it.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/options.h"

namespace magi::test {

inline Options options_from(const std::map<std::string, std::string>& env) {
  std::vector<std::string> names;
  for (const auto& [name, value] : env) names.push_back(name);
  std::vector<std::string> complaints;
  Options options = Options::parse(
      [&](const char* name) -> std::optional<std::string> {
        auto it = env.find(name);
        return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
      },
      names, complaints);
  EXPECT_TRUE(complaints.empty()) << complaints.front();
  return options;
}

}  // namespace magi::test
