#include "tests/support/standin/report.h"

#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <new>

namespace standin {
namespace {
thread_local std::string t_last_error;
}  // namespace

void report(const char* fmt, ...) {
  char line[1024] = "standin: ";
  const size_t prefix = sizeof("standin: ") - 1;
  va_list args;
  va_start(args, fmt);
  int n = std::vsnprintf(line + prefix, sizeof(line) - prefix - 1, fmt, args);
  va_end(args);
  size_t length = prefix + (n < 0 ? 0 : std::min<size_t>(n, sizeof(line) - prefix - 2));
  line[length++] = '\n';
  ssize_t ignored = ::write(STDERR_FILENO, line, length);
  (void)ignored;
}

std::string format(const char* fmt, ...) {
  char text[1024];
  va_list args;
  va_start(args, fmt);
  int n = std::vsnprintf(text, sizeof text, fmt, args);
  va_end(args);
  return std::string(text, n < 0 ? 0 : std::min<size_t>(n, sizeof text - 1));
}

void set_last_error(const std::string& message) { t_last_error = message; }

const char* last_error() { return t_last_error.c_str(); }

void note_failure(ncclResult_t code, const std::string& message) {
  set_last_error(message);
  if (code != ncclInvalidArgument && code != ncclInvalidUsage) report("%s", message.c_str());
}

ncclResult_t api_edge(const char* entry_point, const std::function<ncclResult_t()>& body) noexcept {
  try {
    return body();
  } catch (const Failure& f) {
    note_failure(f.code(), std::string(entry_point) + ": " + f.what());
    return f.code();
  } catch (const std::bad_alloc&) {
    note_failure(ncclSystemError, std::string(entry_point) + ": out of memory");
    return ncclSystemError;
  } catch (const std::exception& e) {
    note_failure(ncclInternalError, std::string(entry_point) + ": internal error: " + e.what());
    return ncclInternalError;
  } catch (...) {
    note_failure(ncclInternalError, std::string(entry_point) + ": internal error");
    return ncclInternalError;
  }
}

}  // namespace standin
