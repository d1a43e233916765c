// One error family for the whole library: inside, code throws magi::Error (a kind, and a
// message that names what failed and why), never a chain of result codes; where a served call
// must answer with an ncclResult_t, Error::result() makes it from the kind. At the NCCL API edge,
// guarded() turns whatever was thrown into one WARN line, so nothing escapes into the host program.
#pragma once

#include <nccl.h>

#include <exception>
#include <string>

#include "base/log.h"

namespace magi {

enum class ErrorKind : uint8_t {
  Usage,     // the caller broke a rule (bad argument, bad configuration)
  System,    // the OS or a missing library refused
  Cuda,      // a CUDA call failed
  Internal,  // a bug of ours
};

class Error : public std::exception {
 public:
  Error(ErrorKind kind, std::string message) : kind_(kind), message_(std::move(message)) {}
  ErrorKind kind() const noexcept { return kind_; }
  const char* what() const noexcept override { return message_.c_str(); }
  ncclResult_t result() const noexcept {
    switch (kind_) {
      case ErrorKind::Usage: return ncclInvalidUsage;
      case ErrorKind::System: return ncclSystemError;
      case ErrorKind::Cuda: return ncclUnhandledCudaError;
      case ErrorKind::Internal: break;
    }
    return ncclInternalError;
  }

 private:
  ErrorKind kind_;
  std::string message_;
};

// The edge between the library's own work and the host program. `work` may throw; whatever it
// throws becomes one WARN line naming `where`, and false. Forwarding to the real NCCL always
// happens outside of it, so a failure of ours can never change what the program gets back.
template <class Work>
bool guarded(const char* where, Work&& work) noexcept {
  try {
    work();
    return true;
  } catch (const Error& e) {
    MAGI_WARN(Shim, "%s: %s; the call goes on unchanged", where, e.what());
  } catch (const std::exception& e) {
    MAGI_WARN(Shim, "%s: internal error: %s; the call goes on unchanged", where, e.what());
  } catch (...) {
    MAGI_WARN(Shim, "%s: internal error; the call goes on unchanged", where);
  }
  return false;
}

}  // namespace magi
