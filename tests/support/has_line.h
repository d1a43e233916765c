// Whether some line of a text matches a POSIX extended regular expression: the tests' way to
// look for a log or report line. (POSIX's rather than <regex>, which GCC 12 cannot compile
// warning-free under the sanitizers.)
#pragma once

#include <gtest/gtest.h>
#include <regex.h>

#include <cstdint>
#include <sstream>
#include <string>

namespace magi::test {

// How many lines of a text match (stops counting at `most`).
inline size_t count_lines(const std::string& text, const std::string& pattern,
                          size_t most = SIZE_MAX) {
  regex_t re;
  if (regcomp(&re, pattern.c_str(), REG_EXTENDED | REG_NOSUB) != 0) {
    ADD_FAILURE() << "not a regular expression: " << pattern;
    return 0;
  }
  size_t found = 0;
  std::istringstream lines(text);
  for (std::string line; found < most && std::getline(lines, line);)
    found += regexec(&re, line.c_str(), 0, nullptr, 0) == 0 ? 1 : 0;
  regfree(&re);
  return found;
}

inline bool has_line(const std::string& text, const std::string& pattern) {
  return count_lines(text, pattern, 1) != 0;
}

}  // namespace magi::test
