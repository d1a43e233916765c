// A trace seen per communicator member: one (communicator, rank) pair and its calls in seq
// order. Usually one member per communicator per file; ncclCommInitAll puts several ranks of
// one communicator in the same file, told apart by each call's rank.
//
// A call has two numbers, each from 0 per communicator and rank: its seq, shown as "call #N",
// counts every call (Send and Recv too); its collective index, shown as "collective #N", counts
// only collectives, as steps, rounds and the library's log lines do.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "base/ids.h"
#include "capture/trace_reader.h"

namespace magi::tool {

struct Member {
  uint64_t comm_id = 0;
  int32_t rank = -1;  // -1: the trace has no Comm record for it
  int32_t nranks = -1;
  const trace::CommRecord* comm = nullptr;
  const trace::CommEndRecord* end = nullptr;
  std::vector<const trace::CallRecord*> calls;        // every call, by seq
  std::vector<const trace::CallRecord*> collectives;  // Send/Recv left out, by seq
  // collectives[i] is collective #i for i below this. Past a gap in seq (records dropped, or a
  // file that starts after the communicator's first calls) how many collectives are missing is
  // unknown, and so are the numbers of the collectives after it.
  size_t numbered = 0;
};

// Members in the order their communicators were created (calls of unknown communicators last).
// Pointers point into `trace`, which must outlive the result.
std::vector<Member> members_of(const trace::Trace& trace);

// The collective index of each call of `members` whose index is known (Member::numbered).
std::unordered_map<const trace::CallRecord*, uint64_t> collective_numbers(
    const std::vector<Member>& members);

// Loads every file; the first unreadable or malformed one raises TraceFormatError.
std::vector<trace::Trace> load_traces(const std::vector<std::string>& paths);

// A communicator is shown as short_id_text(comm_id) (base/ids.h), as the library's logs show it.

// What `--comm ID` selects: up to 12 hex digits match the start of the id as shown; 16 digits,
// the whole 64-bit id. A leading "0x" and upper case are accepted; anything else is a UsageError.
class CommFilter {
 public:
  CommFilter() = default;  // selects every communicator
  explicit CommFilter(std::string_view id);
  bool selects(uint64_t comm_id) const;

 private:
  std::string digits_;  // lower-case hex, no "0x"
};

// Full 16-digit hex, for digests and call sites.
std::string hex16(uint64_t value);

}  // namespace magi::tool
