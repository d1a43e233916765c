#include "tools/magice-trace/cli.h"

#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "capture/trace_reader.h"

namespace magi::tool {

bool ArgCursor::flag(std::string_view name) {
  if (done() || options_ended_ || args_[next_] != name) return false;
  ++next_;
  return true;
}

std::optional<std::string> ArgCursor::value(std::string_view name) {
  if (done() || options_ended_) return std::nullopt;
  const std::string& arg = args_[next_];
  if (arg == name) {
    if (next_ + 1 >= args_.size()) throw UsageError(std::string(name) + " needs a value");
    next_ += 2;
    return args_[next_ - 1];
  }
  if (arg.size() > name.size() && arg.compare(0, name.size(), name) == 0 &&
      arg[name.size()] == '=') {
    ++next_;
    return arg.substr(name.size() + 1);
  }
  return std::nullopt;
}

void ArgCursor::operand(std::vector<std::string>& operands) {
  const std::string& arg = args_[next_++];
  if (!options_ended_ && arg == "--") {
    options_ended_ = true;
    return;
  }
  if (!options_ended_ && arg.size() > 1 && arg[0] == '-') throw UsageError("unknown option " + arg);
  operands.push_back(arg);
}

int64_t parse_integer(std::string_view option, const std::string& text, int64_t min, int64_t max) {
  errno = 0;
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || *end != '\0' || value < min || value > max) {
    throw UsageError(std::string(option) + " wants an integer from " + std::to_string(min) +
                     " to " + std::to_string(max) + ", not '" + text + "'");
  }
  return value;
}

int run_verb(std::string_view usage, std::span<const std::string> args,
             const std::function<int()>& body) {
  for (const std::string& arg : args) {
    if (arg == "--") break;
    if (arg == "--help" || arg == "-h") {
      std::fwrite(usage.data(), 1, usage.size(), stdout);
      return 0;
    }
  }
  try {
    return body();
  } catch (const UsageError& e) {
    std::fprintf(stderr, "magice-trace: %s\n", e.what());
    std::fwrite(usage.data(), 1, usage.size(), stderr);
  } catch (const trace::TraceFormatError& e) {
    std::fprintf(stderr, "magice-trace: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "magice-trace: %s\n", e.what());
  }
  return kExitUsage;
}

}  // namespace magi::tool
