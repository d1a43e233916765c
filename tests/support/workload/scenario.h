// What every workload scenario shares: its command-line options, the failure that ends it with
// a message, and the NCCL call check. Scenarios use only the NCCL API (and bootstrap.h), like a
// user's program, so the same run can go straight to NCCL or through the shim.
#pragma once

#include <nccl.h>

#include <map>
#include <stdexcept>
#include <string>
#include <utility>

namespace workload {

// "--name value" pairs after the scenario name.
class ScenarioOptions {
 public:
  ScenarioOptions(int argc, char** argv);  // argv[0] is the scenario name
  long number(const std::string& name, long fallback) const;
  std::string text(const std::string& name, const std::string& fallback) const;
  bool has(const std::string& name) const { return values_.count(name) != 0; }

 private:
  std::map<std::string, std::string> values_;
};

// Ends the scenario: the entry point prints "<scenario>: <message>" and returns 1.
class ScenarioFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Throws ScenarioFailure naming the call unless it succeeded.
void check(ncclResult_t result, const char* call);
#define WORKLOAD_CHECK(call) ::workload::check((call), #call)

// A communicator the scenario owns: destroyed however the scenario ends, so a failing rank
// leaks nothing (leak checkers look at every rank). destroy() is the checked, normal end.
class OwnedComm {
 public:
  OwnedComm() = default;
  explicit OwnedComm(ncclComm_t comm) : comm_(comm) {}
  OwnedComm(OwnedComm&& other) noexcept : comm_(std::exchange(other.comm_, nullptr)) {}
  OwnedComm& operator=(OwnedComm&&) = delete;
  ~OwnedComm() {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }
  ncclComm_t get() const { return comm_; }
  ncclComm_t* out() { return &comm_; }  // for the NCCL calls that make one
  void destroy() { check(ncclCommDestroy(std::exchange(comm_, nullptr)), "ncclCommDestroy"); }

 private:
  ncclComm_t comm_ = nullptr;
};

int run_ops(const ScenarioOptions& options);
int run_fsdp(const ScenarioOptions& options);
int run_split(const ScenarioOptions& options);
int run_initall(const ScenarioOptions& options);
int run_agree(const ScenarioOptions& options);

}  // namespace workload
