// Command-line plumbing shared by the verbs: option parsing, usage errors and the one place
// that turns failures into an exit status (0 fine, 1 differences found, 2 bad usage or input).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace magi::tool {

inline constexpr int kExitUsage = 2;

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Walks a verb's arguments: options ("--name", "--name V", "--name=V") and operands.
class ArgCursor {
 public:
  explicit ArgCursor(std::span<const std::string> args) : args_(args) {}

  bool done() const { return next_ >= args_.size(); }
  // Consumes the current argument if it is the flag `name`.
  bool flag(std::string_view name);
  // Consumes "--name V" or "--name=V"; UsageError when the value is missing.
  std::optional<std::string> value(std::string_view name);
  // Consumes the current argument as an operand; UsageError if it looks like an unknown option.
  void operand(std::vector<std::string>& operands);

 private:
  std::span<const std::string> args_;
  size_t next_ = 0;
  bool options_ended_ = false;  // after "--" everything is an operand
};

// An integer option value within [min, max], or UsageError naming the option.
int64_t parse_integer(std::string_view option, const std::string& text, int64_t min, int64_t max);

// Runs one verb: "--help" anywhere prints `usage` to stdout; a UsageError prints the reason and
// `usage` to stderr; an unreadable or malformed trace prints "magice-trace: FILE: offset N: what".
// Both of those exit 2; nothing escapes as a crash.
int run_verb(std::string_view usage, std::span<const std::string> args,
             const std::function<int()>& body);

}  // namespace magi::tool
