// Writes the trace reader's seed corpus (tests/fuzz/corpus/trace_reader) with the builder the
// reader's tests use: small valid traces, between them every record type, and a few damaged
// ones, so the fuzzer starts from inputs that reach past the header checks.
//   make fuzz-corpus     (or: make_corpus DIR)
#include <cstdio>
#include <string>
#include <vector>

#include "tests/support/trace_builder.h"

namespace {

using namespace magi::trace;
using namespace magi::trace::testing;

constexpr uint64_t kComm = 0x3f2a0c1d9e7b5511ull;

TraceBuilder one_rank_of_a_step(int32_t rank, int steps) {
  TraceBuilder b;
  b.comm(make_comm(kComm, rank, 4));
  uint64_t seq = 0;
  for (int s = 0; s < steps; ++s) {
    b.call(make_call(kComm, rank, seq++, {Op::AllGather, 7, 4096, -1, -1, 0xa1}));
    b.call(make_call(kComm, rank, seq++, {Op::AllGather, 7, 8192, -1, -1, 0xa2}));
    b.call(make_call(kComm, rank, seq++, {Op::AllReduce, 7, 16, -1, 0, 0xa3}));
  }
  CommEndRecord end{};
  end.comm_id = kComm;
  end.calls = seq;
  end.how = static_cast<uint8_t>(CommEndKind::Destroy);
  b.comm_end(end);
  return b;
}

TraceBuilder every_record_type() {
  TraceBuilder b;
  b.comm(make_comm(kComm, 0, 2));
  b.comm(make_comm(kComm + 1, 0, 1, CommOrigin::Split, kComm));
  const Frame frames[] = {{0x1111, 0x40}, {0x2222, 0x1234}, {0, 0}};
  b.module(0x1111, "libtorch_cuda.so");
  b.module(0x2222, "python3.11");
  b.callsite(0xa1, frames);
  b.call(make_call(kComm, 0, 0, {Op::Send, 2, 100, 1, -1, 0xa1}));
  b.call(make_call(kComm, 0, 1, {Op::Broadcast, 9, 64, 0, -1, 0xa1}));
  StepRecord step{};
  step.comm_id = kComm;
  step.seq = 7;
  step.digest = 0xd1;
  step.repeats = 2;
  step.period = 3;
  step.event = static_cast<uint8_t>(StepEvent::Found);
  b.step(step);
  b.agreement(make_agreement(
      kComm, 0, {1, RoundKind::Propose, RoundEvent::Read, 8, AgreementMode::Identical, 1, 1}));
  b.decision(make_decision(kComm, 0, 1, AgreementMode::Identical, {1, Verdict::Moved}));
  b.dropped(3);
  const uint64_t future[2] = {1, 2};
  b.record(99, future, sizeof(future));  // a type this reader does not know
  CommEndRecord end{};
  end.comm_id = kComm;
  end.calls = 2;
  end.how = static_cast<uint8_t>(CommEndKind::ProcessExit);
  b.comm_end(end);
  return b;
}

// Two agreement rounds of one rank between its calls: the first read, activated and then
// deactivated by a deviation, the second read with a gather another rank refused, and a call
// served off NCCL in between, and one queued in a group (moved, then fallen back).
TraceBuilder agreement_rounds() {
  TraceBuilder b;
  b.comm(make_comm(kComm, 1, 2));
  uint64_t seq = 0;
  const auto call = [&](uint8_t flags) {
    CallRecord r = make_call(kComm, 1, seq++, {Op::AllGather, 9, 1 << 16, -1, -1, 0xa1});
    r.flags = flags;
    b.call(r);
  };
  for (uint32_t round = 1; round <= 2; ++round) {
    const uint64_t at = 10 * round;
    const AgreementMode mode = round == 1 ? AgreementMode::Identical : AgreementMode::Slot;
    b.agreement(make_agreement(kComm, 1, {round, RoundKind::Propose, RoundEvent::Issued, at}));
    call(0);
    b.agreement(make_agreement(kComm, 1,
                               {round, RoundKind::Propose, RoundEvent::Read, at + 3, mode, 2, 1}));
    b.decision(make_decision(kComm, 1, round, mode,
                             {0, Verdict::Moved, Reason::None, -1, 0, 9, 1 << 16, 0xa1}));
    b.decision(make_decision(kComm, 1, round, mode,
                             {3, Verdict::Stays, Reason::OtherRankRefused, 0, 1, 7, 512, 0xa2}));
    b.agreement(make_agreement(
        kComm, 1, {round, RoundKind::Confirm, RoundEvent::Activated, at + 6, mode, 2, 1}));
    call(kCallMoved);
    call(kCallWouldMove | kCallInGroup);
    call(kCallInGroup);  // queued in a group: how it was served follows when the group ends
    b.group_served({kComm, seq - 1, 1, round == 1 ? kCallMoved : kCallFellBack, {}});
  }
  b.agreement(make_agreement(kComm, 1,
                             {2, RoundKind::Confirm, RoundEvent::Deactivated, 40,
                              AgreementMode::Slot, 2, 1, Reason::Deviated}));
  return b;
}

// A later writer's longer header: records start after header_bytes.
TraceBuilder longer_header() {
  FileHeader header = make_file_header();
  header.header_bytes = sizeof(FileHeader) + 16;
  TraceBuilder b(header);
  b.raw(std::string(16, '\0'));
  b.call(make_call(kComm, 0, 0, {}));
  return b;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::vector<std::pair<std::string, std::string>> seeds = {
      {"header_only", TraceBuilder().bytes()},
      {"rank0_three_steps", one_rank_of_a_step(0, 3).bytes()},
      {"rank3_one_step", one_rank_of_a_step(3, 1).bytes()},
      {"every_record_type", every_record_type().bytes()},
      {"longer_header", longer_header().bytes()},
      {"agreement_rounds", agreement_rounds().bytes()},
  };
  std::string truncated = one_rank_of_a_step(1, 1).bytes();
  truncated.resize(truncated.size() - 20);
  seeds.emplace_back("truncated_record", truncated);
  std::string bad_size = every_record_type().bytes();
  bad_size[sizeof(FileHeader) + 4] = 13;  // the first record's size, no longer a multiple of 8
  seeds.emplace_back("record_size_not_multiple_of_8", bad_size);
  for (const auto& [name, bytes] : seeds) {
    const std::string path = dir + "/" + name + ".trace";
    FILE* f = std::fopen(path.c_str(), "wb");
    const bool ok = f != nullptr && std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
    if (f == nullptr || std::fclose(f) != 0 || !ok) {
      std::fprintf(stderr, "cannot write %s\n", path.c_str());
      return 1;
    }
  }
  return 0;
}
