#include "base/options.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace magi {
namespace {

struct Parsed {
  Options options;
  std::vector<std::string> complaints;
};

Parsed parse_env(const std::map<std::string, std::string>& env) {
  std::vector<std::string> names;
  for (const auto& [name, value] : env) names.push_back(name);
  Parsed p;
  p.options = Options::parse(
      [&](const char* name) -> std::optional<std::string> {
        auto it = env.find(name);
        return it == env.end() ? std::nullopt : std::optional<std::string>(it->second);
      },
      names, p.complaints);
  return p;
}

TEST(Options, DefaultsComeFromTheTable) {
  const Parsed p = parse_env({});
  EXPECT_TRUE(p.complaints.empty());
  EXPECT_EQ(p.options.log_level, Options::LogLevel::Warn);
  EXPECT_TRUE(p.options.trace_dir.empty());
  EXPECT_TRUE(p.options.callsites);
  EXPECT_EQ(p.options.callsite_depth, std::stoll(find_option("MAGI_CALLSITE_DEPTH")->default_text));
  EXPECT_EQ(p.options.max_step_calls, std::stoll(find_option("MAGI_MAX_STEP_CALLS")->default_text));
  EXPECT_EQ(p.options.trace_buffer_kib, std::stoll(find_option("MAGI_TRACE_BUFFER_KIB")->default_text));
}

TEST(Options, AcceptedValuesAreParsed) {
  const Parsed p = parse_env({{"MAGI_LOG", "info"},
                              {"MAGI_LOG_SUBSYS", "INIT,CAPTURE"},
                              {"MAGI_TRACE_DIR", "/tmp/t"},
                              {"MAGI_CALLSITES", "off"},
                              {"MAGI_CALLSITE_DEPTH", "8"},
                              {"MAGI_MAX_STEP_CALLS", "100"},
                              {"MAGI_TRACE_BUFFER_KIB", "64"},
                              {"MAGI_NCCL_LIBRARY", "/opt/nccl/libnccl.so.2"}});
  EXPECT_TRUE(p.complaints.empty()) << p.complaints.front();
  EXPECT_EQ(p.options.log_level, Options::LogLevel::Info);
  EXPECT_EQ(p.options.log_subsystems, 0b101u);  // INIT and CAPTURE
  EXPECT_EQ(p.options.trace_dir, "/tmp/t");
  EXPECT_FALSE(p.options.callsites);
  EXPECT_EQ(p.options.callsite_depth, 8);
  EXPECT_EQ(p.options.max_step_calls, 100);
  EXPECT_EQ(p.options.trace_buffer_kib, 64);
  EXPECT_EQ(p.options.nccl_library, "/opt/nccl/libnccl.so.2");
}

TEST(Options, NegatedSubsystemListExcludesThem) {
  const Parsed p = parse_env({{"MAGI_LOG_SUBSYS", "^TRACE"}});
  EXPECT_TRUE(p.complaints.empty());
  EXPECT_EQ(p.options.log_subsystems & 0b1000u, 0u);
  EXPECT_NE(p.options.log_subsystems & 0b0111u, 0u);
}

// Every bad value of every option: one complaint naming the variable and what is accepted, and
// the default stays in force.
TEST(Options, EveryBadValueGivesOneLineAndTheDefault) {
  const Options defaults = parse_env({}).options;
  for (const OptionSpec& spec : option_table()) {
    std::vector<std::string> bad;
    switch (spec.kind) {
      case OptionKind::Bool: bad = {"", "2", "-1", "maybe", "99999999999999999999"}; break;
      case OptionKind::Int:
        bad = {"", "-1", "abc", "12abc", "1e3", "99999999999999999999",
               std::to_string(spec.min - 1), std::to_string(spec.max + 1)};
        break;
      case OptionKind::Enum: bad = {"", "LOUD", "-1", "42"}; break;
      case OptionKind::SubsystemList: bad = {"", "NETWORK", "INIT,BOGUS", "^", "-1"}; break;
      case OptionKind::Path: break;  // any text is a path; an unusable one is reported where used
    }
    for (const std::string& value : bad) {
      const Parsed p = parse_env({{spec.name, value}});
      ASSERT_EQ(p.complaints.size(), 1u) << spec.name << "='" << value << "'";
      EXPECT_NE(p.complaints[0].find(spec.name), std::string::npos) << p.complaints[0];
      EXPECT_NE(p.complaints[0].find(spec.accepted), std::string::npos) << p.complaints[0];
      EXPECT_EQ(p.options.describe(), defaults.describe()) << spec.name << "='" << value << "'";
    }
  }
}

TEST(Options, UnknownNameIsWarnedWithTheClosestKnownOne) {
  const Parsed p = parse_env({{"MAGI_CALLSITE_DEPT", "4"}, {"MAGI_ZZZZZZZZZZZZZZ", "1"}});
  ASSERT_EQ(p.complaints.size(), 2u);
  EXPECT_NE(p.complaints[0].find("did you mean MAGI_CALLSITE_DEPTH?"), std::string::npos)
      << p.complaints[0];
  EXPECT_EQ(p.complaints[1].find("did you mean"), std::string::npos) << p.complaints[1];
}

// README lists every option of the table, with its default, and nothing else.
TEST(Options, ReadmeListsExactlyTheTable) {
  std::ifstream readme("README.md");
  ASSERT_TRUE(readme) << "run from the repository root";
  std::stringstream text;
  text << readme.rdbuf();
  const std::string s = text.str();
  for (const OptionSpec& spec : option_table()) {
    const std::string row = std::string("| `") + spec.name + "` |";
    const size_t at = s.find(row);
    ASSERT_NE(at, std::string::npos) << spec.name << " is missing from README's option table";
    const std::string line = s.substr(at, s.find('\n', at) - at);
    const std::string shown_default = std::string("`") + spec.default_text + "`";
    EXPECT_NE(line.find(*spec.default_text ? shown_default : std::string("(empty)")), std::string::npos)
        << "README's row for " << spec.name << " shows another default: " << line;
  }
  size_t pos = 0;
  while ((pos = s.find("| `MAGI_", pos)) != std::string::npos) {
    const size_t end = s.find('`', pos + 3);
    const std::string name = s.substr(pos + 3, end - pos - 3);
    EXPECT_NE(find_option(name), nullptr) << "README lists " << name << ", which the table lacks";
    pos = end;
  }
}

}  // namespace
}  // namespace magi
