#include "tools/magice-trace/members.h"

#include <algorithm>
#include <cctype>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <map>
#include <utility>

#include "tools/magice-trace/cli.h"

namespace magi::tool {

std::vector<Member> members_of(const trace::Trace& trace) {
  std::vector<Member> members;
  std::map<std::pair<uint64_t, int32_t>, size_t> index;  // (comm_id, rank) -> members
  for (const trace::CommRecord& comm : trace.comms) {
    const auto [it, inserted] = index.try_emplace({comm.comm_id, comm.rank}, members.size());
    if (!inserted) continue;  // joined twice under one rank: keep the first
    Member& m = members.emplace_back();
    m.comm_id = comm.comm_id;
    m.rank = comm.rank;
    m.nranks = comm.nranks;
    m.comm = &comm;
  }
  // Consecutive calls are mostly on one communicator: remember the last lookup.
  std::pair<uint64_t, int32_t> last_key{};
  size_t last_member = SIZE_MAX;
  for (const trace::CallRecord& call : trace.calls) {
    const std::pair<uint64_t, int32_t> key{call.comm_id, call.rank};
    if (last_member == SIZE_MAX || key != last_key) {
      auto it = index.find(key);
      if (it == index.end()) {
        // A call on a communicator whose Comm record is missing (dropped, say): its own member.
        it = index.try_emplace(key, members.size()).first;
        Member& m = members.emplace_back();
        m.comm_id = call.comm_id;
        m.rank = call.rank;
      }
      last_key = key;
      last_member = it->second;
    }
    members[last_member].calls.push_back(&call);
  }
  // CommEnd records carry no rank: several ranks of one communicator in a file (InitAll) end in
  // turn, so each end goes to the first of them still open.
  for (const trace::CommEndRecord& end : trace.comm_ends) {
    for (Member& m : members) {
      if (m.comm_id == end.comm_id && m.end == nullptr) {
        m.end = &end;
        break;
      }
    }
  }
  for (Member& m : members) {
    // Calls are written in completion order, which threads may interleave; seq is the truth.
    const auto by_seq = [](const trace::CallRecord* a, const trace::CallRecord* b) {
      return a->seq < b->seq;
    };
    if (!std::is_sorted(m.calls.begin(), m.calls.end(), by_seq)) {
      std::stable_sort(m.calls.begin(), m.calls.end(), by_seq);
    }
    m.collectives.reserve(m.calls.size());
    bool whole = true;  // every call before this one is in the file
    for (size_t i = 0; i < m.calls.size(); ++i) {
      const trace::CallRecord* call = m.calls[i];
      whole = whole && call->seq == i;
      if (!trace::is_collective(static_cast<trace::Op>(call->op))) continue;
      m.collectives.push_back(call);
      if (whole) m.numbered = m.collectives.size();
    }
  }
  return members;
}

std::unordered_map<const trace::CallRecord*, uint64_t> collective_numbers(
    const std::vector<Member>& members) {
  std::unordered_map<const trace::CallRecord*, uint64_t> numbers;
  for (const Member& m : members)
    for (size_t i = 0; i < m.numbered; ++i) numbers.emplace(m.collectives[i], i);
  return numbers;
}

std::vector<trace::Trace> load_traces(const std::vector<std::string>& paths) {
  std::vector<trace::Trace> traces;
  traces.reserve(paths.size());
  for (const std::string& path : paths) traces.push_back(trace::read_trace(path));
  return traces;
}

CommFilter::CommFilter(std::string_view id) {
  if (id.size() > 2 && id[0] == '0' && (id[1] == 'x' || id[1] == 'X')) id.remove_prefix(2);
  for (char c : id) {
    if (!std::isxdigit(static_cast<unsigned char>(c))) throw UsageError("--comm wants a hex id");
    digits_ += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  if (digits_.empty() || (digits_.size() > kShortIdDigits && digits_.size() != 16)) {
    throw UsageError("--comm wants up to 12 hex digits of the id as shown, or all 16");
  }
}

bool CommFilter::selects(uint64_t comm_id) const {
  if (digits_.size() == 16) return hex16(comm_id) == digits_;
  return short_id_text(comm_id).starts_with(digits_);
}

std::string hex16(uint64_t value) {
  char text[20];
  std::snprintf(text, sizeof(text), "%016" PRIx64, value);
  return text;
}

}  // namespace magi::tool
