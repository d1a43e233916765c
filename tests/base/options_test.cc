#include "base/options.h"

#include <gtest/gtest.h>

#include <fstream>
#include <map>
#include <set>
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
  EXPECT_EQ(p.options.trace_buffer_bytes,
            std::stoull(find_option("MAGI_TRACE_BUFFER_KIB")->default_text) * 1024);
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
  EXPECT_EQ(p.options.trace_buffer_bytes, 64u * 1024);
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
        bad = {"",
               "-1",
               "abc",
               "12abc",
               "1e3",
               "99999999999999999999",
               std::to_string(spec.min - 1),
               std::to_string(spec.max + 1)};
        break;
      case OptionKind::Enum: bad = {"", "LOUD", "-1", "42"}; break;
      case OptionKind::SubsystemList: bad = {"", "NETWORK", "INIT,BOGUS", "^", "-1"}; break;
      case OptionKind::Path: break;  // any text is a path; an unusable one is reported where used
      case OptionKind::FaultSpec:
        bad = {"",           "LOUD",   "-1",        "42",       "prepare",      "prepare:",
               "prepare:-1", "none:1", "explode:1", "gather:x", "slow:16777217"};
        break;
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

// --- Every option into its own field. The fields and the values below are written out by hand:
// derived from the table, they would agree with any mistake in it.

using Fields = std::map<std::string, std::string>;

std::string number(uint64_t value) { return std::to_string(value); }
std::string number(int64_t value) { return std::to_string(value); }

// Every field of Options, by its name in the struct.
Fields fields_of(const Options& o) {
  return {
      {"log_level", number(static_cast<uint64_t>(o.log_level))},
      {"log_subsystems", number(uint64_t{o.log_subsystems})},
      {"trace_dir", o.trace_dir},
      {"trace_buffer_bytes", number(o.trace_buffer_bytes)},
      {"callsites", o.callsites ? "true" : "false"},
      {"callsite_depth", number(o.callsite_depth)},
      {"py_callsites", number(o.py_callsites)},
      {"max_step_calls", number(o.max_step_calls)},
      {"nccl_library", o.nccl_library},
      {"transport", o.transport == Options::Transport::CopyEngine ? "CopyEngine"
                    : o.transport == Options::Transport::Nccl     ? "Nccl"
                                                                  : "?"},
      {"backend", o.backend == Options::Backend::Cuda   ? "Cuda"
                  : o.backend == Options::Backend::Host ? "Host"
                                                        : "?"},
      {"warmup_steps", number(o.warmup_steps)},
      {"reagree_steps", number(o.reagree_steps)},
      {"symm_min_shard_bytes", number(o.symm_min_shard_bytes)},
      {"window_max_bytes", number(o.window_max_bytes)},
      {"dry_run", o.dry_run ? "true" : "false"},
      {"static_weights", o.static_weights ? "true" : "false"},
      {"graph_slots", o.graph_slots == Options::GraphSlots::Auto     ? "auto"
                      : o.graph_slots == Options::GraphSlots::Always ? "always"
                      : o.graph_slots == Options::GraphSlots::Never  ? "never"
                                                                     : "?"},
      {"capture_wait_ms", std::to_string(o.capture_wait_ms)},
      {"inject_capture_from", std::to_string(o.inject_capture_from)},
      {"ce_force", o.ce_force ? "true" : "false"},
      {"inject_fault.where", number(static_cast<uint64_t>(o.inject_fault.where))},
      {"inject_fault.rank", number(int64_t{o.inject_fault.rank})},
      {"inject_host", o.inject_host},
      {"verify_every", number(o.verify_every)},
      {"bind_max_bytes", number(o.bind_max_bytes)},
      {"flight_recorder_calls", number(o.flight_recorder_calls)},
      {"flight_recorder_dir", o.flight_recorder_dir},
      {"flight_recorder_completion", o.flight_recorder_completion ? "true" : "false"},
      {"dump_signal", number(static_cast<uint64_t>(o.dump_signal))},
  };
}

// What README documents as each default, as the fields hold it (sizes in bytes).
const Fields kDocumentedDefaults = {
    {"log_level", "0"},  // Warn
    {"log_subsystems", "4294967295"},
    {"trace_dir", ""},
    {"trace_buffer_bytes", "1048576"},  // 1024 KiB
    {"callsites", "true"},
    {"callsite_depth", "16"},
    {"py_callsites", "0"},
    {"max_step_calls", "4096"},
    {"nccl_library", ""},
    {"transport", "CopyEngine"},
    {"backend", "Cuda"},
    {"warmup_steps", "3"},
    {"reagree_steps", "256"},
    {"symm_min_shard_bytes", "0"},
    {"window_max_bytes", "4294967296"},  // 4096 MiB
    {"dry_run", "false"},
    {"static_weights", "false"},
    {"graph_slots", "auto"},
    {"capture_wait_ms", "20000"},
    {"inject_capture_from", "0"},
    {"ce_force", "false"},
    {"inject_fault.where", "0"},  // None
    {"inject_fault.rank", "-1"},
    {"inject_host", ""},
    {"verify_every", "64"},
    {"bind_max_bytes", "17179869184"},  // 16384 MiB
    {"flight_recorder_calls", "0"},
    {"flight_recorder_dir", ""},
    {"flight_recorder_completion", "false"},
    {"dump_signal", "0"},  // None
};

struct Setting {
  const char* variable;
  const char* value;
  Fields fields;  // what it changes, and to what
};

// Every option set to a value that is not its default; the numbers differ from one another so
// that two options filling each other's fields cannot pass.
const std::vector<Setting> kEveryOptionChanged = {
    {"MAGI_LOG", "trace", {{"log_level", "2"}}},
    {"MAGI_LOG_SUBSYS", "SHIM,REWRITE", {{"log_subsystems", "18"}}},  // bits 1 and 4
    {"MAGI_TRACE_DIR", " /var/tmp/traces ", {{"trace_dir", "/var/tmp/traces"}}},
    {"MAGI_TRACE_BUFFER_KIB", "48", {{"trace_buffer_bytes", "49152"}}},
    {"MAGI_CALLSITES", "no", {{"callsites", "false"}}},
    {"MAGI_CALLSITE_DEPTH", "5", {{"callsite_depth", "5"}}},
    {"MAGI_PY_CALLSITES", "2", {{"py_callsites", "2"}}},
    {"MAGI_MAX_STEP_CALLS", "77", {{"max_step_calls", "77"}}},
    {"MAGI_NCCL_LIBRARY",
     "/opt/nccl/lib/libnccl.so.2",
     {{"nccl_library", "/opt/nccl/lib/libnccl.so.2"}}},
    {"MAGI_TRANSPORT", "NCCL", {{"transport", "Nccl"}}},
    {"MAGI_BACKEND", "host", {{"backend", "Host"}}},
    {"MAGI_WARMUP_STEPS", "9", {{"warmup_steps", "9"}}},
    {"MAGI_REAGREE_STEPS", "11", {{"reagree_steps", "11"}}},
    {"MAGI_SYMM_MIN_SHARD_MIB", "2", {{"symm_min_shard_bytes", "2097152"}}},
    {"MAGI_WINDOW_MAX_MIB", "6", {{"window_max_bytes", "6291456"}}},
    {"MAGI_DRY_RUN", "1", {{"dry_run", "true"}}},
    {"MAGI_STATIC_WEIGHTS", "on", {{"static_weights", "true"}}},
    {"MAGI_GRAPH_SLOTS", "never", {{"graph_slots", "never"}}},
    {"MAGI_CAPTURE_WAIT_MS", "17", {{"capture_wait_ms", "17"}}},
    {"MAGI_INJECT_CAPTURE", "31", {{"inject_capture_from", "31"}}},
    {"MAGI_VERIFY_EVERY", "13", {{"verify_every", "13"}}},
    {"MAGI_BIND_MAX_MIB", "3", {{"bind_max_bytes", "3145728"}}},
    {"MAGI_CE_FORCE", "yes", {{"ce_force", "true"}}},
    {"MAGI_INJECT_FAULT", "Attach:5", {{"inject_fault.where", "2"}, {"inject_fault.rank", "5"}}},
    {"MAGI_INJECT_HOST", "node-b", {{"inject_host", "node-b"}}},
    {"MAGI_FLIGHT_RECORDER", "1024", {{"flight_recorder_calls", "1024"}}},
    {"MAGI_FLIGHT_RECORDER_DIR", "/var/tmp/fr", {{"flight_recorder_dir", "/var/tmp/fr"}}},
    {"MAGI_FLIGHT_RECORDER_COMPLETION", "1", {{"flight_recorder_completion", "true"}}},
    {"MAGI_DUMP_SIGNAL", "usr2", {{"dump_signal", "2"}}},
};

TEST(Options, TheSettingsBelowChangeEveryOptionAndEveryField) {
  std::set<std::string> set_names, changed_fields;
  for (const Setting& s : kEveryOptionChanged) {
    EXPECT_TRUE(set_names.insert(s.variable).second) << s.variable << " is set twice";
    for (const auto& [field, value] : s.fields) {
      EXPECT_TRUE(changed_fields.insert(field).second) << field << " is changed twice";
      ASSERT_TRUE(kDocumentedDefaults.count(field)) << field;
      EXPECT_NE(kDocumentedDefaults.at(field), value) << s.variable << " sets its default";
    }
  }
  std::set<std::string> table_names, all_fields;
  for (const OptionSpec& spec : option_table()) table_names.insert(spec.name);
  for (const auto& [field, value] : fields_of(Options{})) all_fields.insert(field);
  EXPECT_EQ(set_names, table_names) << "a new option needs its line in kEveryOptionChanged";
  EXPECT_EQ(changed_fields, all_fields) << "a new field needs its line in fields_of()";
}

TEST(Options, EveryOptionSetAtOnceFillsEveryFieldWithItsValue) {
  std::map<std::string, std::string> env;
  Fields expected = kDocumentedDefaults;
  for (const Setting& s : kEveryOptionChanged) {
    env[s.variable] = s.value;
    for (const auto& [field, value] : s.fields) expected[field] = value;
  }
  const Parsed p = parse_env(env);
  EXPECT_TRUE(p.complaints.empty()) << p.complaints.front();
  EXPECT_EQ(fields_of(p.options), expected);
}

// Alone, each option changes its own field and nothing else: two options of one kind that fill
// each other's fields fail here even when set to the same value.
TEST(Options, EachOptionAloneFillsOnlyItsOwnField) {
  for (const Setting& s : kEveryOptionChanged) {
    const Parsed p = parse_env({{s.variable, s.value}});
    EXPECT_TRUE(p.complaints.empty()) << s.variable << ": " << p.complaints.front();
    Fields expected = kDocumentedDefaults;
    for (const auto& [field, value] : s.fields) expected[field] = value;
    EXPECT_EQ(fields_of(p.options), expected) << s.variable << "='" << s.value << "'";
  }
}

TEST(Options, EveryDefaultParsesToTheDocumentedValue) {
  const Parsed unset = parse_env({});
  EXPECT_TRUE(unset.complaints.empty()) << unset.complaints.front();
  EXPECT_EQ(fields_of(unset.options), kDocumentedDefaults);
  for (const OptionSpec& spec : option_table()) {
    const Parsed p = parse_env({{spec.name, spec.default_text}});
    EXPECT_TRUE(p.complaints.empty()) << spec.name << ": " << p.complaints.front();
    EXPECT_EQ(fields_of(p.options), kDocumentedDefaults) << spec.name;
  }
}

TEST(Options, EveryEnumValueNamedInTheAcceptedTextIsAccepted) {
  for (const OptionSpec& spec : option_table()) {
    if (spec.kind != OptionKind::Enum) continue;
    std::string names = spec.accepted;
    size_t start = 0;
    while (start <= names.size()) {
      const size_t bar = std::min(names.find('|', start), names.size());
      const std::string name = names.substr(start, bar - start);
      const Parsed p = parse_env({{spec.name, name}});
      EXPECT_TRUE(p.complaints.empty()) << spec.name << "=" << name;
      // Shown back as the same name: no two names select one value.
      EXPECT_EQ(p.options.value_text(spec.name), name) << spec.name;
      start = bar + 1;
    }
  }
}

// describe() is the configuration line of a bug report: each option once, as the user writes it.
TEST(Options, DescribeNamesEveryOptionOnceWithTheValueAsWritten) {
  std::map<std::string, std::string> env;
  for (const Setting& s : kEveryOptionChanged) env[s.variable] = s.value;
  const std::string line = parse_env(env).options.describe();
  std::map<std::string, int> times;
  std::istringstream words(line);
  std::string word;
  while (words >> word) ++times[word.substr(0, word.find('='))];
  EXPECT_EQ(times.size(), option_table().size()) << line;
  for (const OptionSpec& spec : option_table())
    EXPECT_EQ(times[spec.name], 1) << spec.name << " in: " << line;
  for (const char* shown :
       {"MAGI_LOG=TRACE", "MAGI_LOG_SUBSYS=0x12", "MAGI_TRACE_DIR=/var/tmp/traces",
        "MAGI_TRACE_BUFFER_KIB=48", "MAGI_SYMM_MIN_SHARD_MIB=2", "MAGI_WINDOW_MAX_MIB=6",
        "MAGI_BIND_MAX_MIB=3", "MAGI_VERIFY_EVERY=13", "MAGI_TRANSPORT=nccl", "MAGI_BACKEND=host",
        "MAGI_CALLSITES=0", "MAGI_INJECT_FAULT=attach:5"})
    EXPECT_NE((" " + line + " ").find(std::string(" ") + shown + " "), std::string::npos)
        << shown << " in: " << line;
  const std::string defaults = parse_env({}).options.describe();
  for (const char* shown : {"MAGI_TRACE_DIR=(off)", "MAGI_NCCL_LIBRARY=(search)",
                            "MAGI_WINDOW_MAX_MIB=4096", "MAGI_INJECT_FAULT=none"})
    EXPECT_NE((" " + defaults + " ").find(std::string(" ") + shown + " "), std::string::npos)
        << shown << " in: " << defaults;
}

TEST(Options, ValueTextShowsASizeInTheUnitOfItsName) {
  const Parsed p = parse_env({{"MAGI_BIND_MAX_MIB", "3"}});
  EXPECT_EQ(p.options.value_text("MAGI_BIND_MAX_MIB"), "3");
  EXPECT_EQ(p.options.value_text("MAGI_TRACE_BUFFER_KIB"), "1024");
  EXPECT_EQ(p.options.value_text("MAGI_NO_SUCH"), "");
}

// README lists every option of the table, with its default (and an Int's range in its unit),
// and nothing else.
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
    EXPECT_NE(line.find(*spec.default_text ? shown_default : std::string("(empty)")),
              std::string::npos)
        << "README's row for " << spec.name << " shows another default: " << line;
    if (spec.kind != OptionKind::Int) continue;
    std::string range = "| " + std::to_string(spec.min) + " – " + std::to_string(spec.max);
    if (spec.unit != OptionUnit::Count) range += std::string(" ") + unit_name(spec.unit);
    EXPECT_NE(line.find(range + " |"), std::string::npos)
        << "README's row for " << spec.name << " shows another range or unit: " << line;
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
