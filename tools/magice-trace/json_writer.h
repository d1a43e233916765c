// Just enough JSON output for Chrome trace events: escaped strings, buffered writes.
#pragma once

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

namespace magi::tool {

// `text` as a JSON string literal, quotes included. Bytes that are not valid UTF-8 (a host or
// program name is whatever the OS handed over) become \u00XX, so the output always parses.
std::string json_string(std::string_view text);

// Appends without printf: a large export formats millions of numbers.
template <class Integer>
void append_integer(std::string& out, Integer value) {
  char digits[24];
  const auto end = std::to_chars(digits, digits + sizeof(digits), value).ptr;
  out.append(digits, end);
}

// Nanoseconds as microseconds with three decimals ("12.345", "-0.500"): exact, no float.
void append_micros(std::string& out, int64_t ns);

// Writes to a file (or stdout for "-"); errors surface as exceptions naming the path.
class JsonOutput {
 public:
  explicit JsonOutput(const std::string& path);
  ~JsonOutput();
  JsonOutput(const JsonOutput&) = delete;
  JsonOutput& operator=(const JsonOutput&) = delete;

  void write(std::string_view text);
  void close();  // flushes and reports a failed write

 private:
  std::string path_;
  std::FILE* file_;
};

}  // namespace magi::tool
