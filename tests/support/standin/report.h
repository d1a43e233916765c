// What the stand-in tells the user: one line on stderr per event ("standin: ..."), the text
// ncclGetLastError returns, and the failure type that carries an ncclResult_t from deep inside
// to the API edge. The library never writes to stdout.
#pragma once

#include <nccl.h>

#include <exception>
#include <functional>
#include <string>

namespace standin {

// Writes "standin: <message>\n" to stderr in one write(), so lines of ranks and threads do not
// interleave mid-line.
void report(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// The calling thread's last error, as ncclGetLastError shows it.
void set_last_error(const std::string& message);
const char* last_error();

class Failure : public std::exception {
 public:
  Failure(ncclResult_t code, std::string message) : code_(code), message_(std::move(message)) {}
  ncclResult_t code() const noexcept { return code_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  ncclResult_t code_;
  std::string message_;
};

// The API edge: runs `body` (returning ncclResult_t); a Failure becomes its code and the last
// error; system failures also get a line on stderr, since nobody may ask for the last error.
ncclResult_t api_edge(const char* entry_point, const std::function<ncclResult_t()>& body) noexcept;

// Records a failure that did not throw (an operation that ended badly inside a group).
void note_failure(ncclResult_t code, const std::string& message);

}  // namespace standin
