#include "capture/trace_format.h"

#include <array>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace magi::trace {
namespace {

// Traces come from other processes and may hold values this build does not know; those get a
// name that shows the number. Each such name is built once and kept, so every returned view
// stays valid for the life of the process, like the names of known values.
template <size_t N>
std::array<std::string, 256> names_with_fallback(const std::array<std::string_view, N>& known,
                                                 uint8_t first, std::string_view fallback) {
  std::array<std::string, 256> names;
  for (size_t value = 0; value < names.size(); ++value) {
    const size_t index = value - first;
    names[value] = value >= first && index < N ? std::string(known[index])
                                               : std::string(fallback) + std::to_string(value);
  }
  return names;
}

}  // namespace

std::string_view op_name(Op op) {
  static const auto names =
      names_with_fallback<10>({"AllGather", "AllReduce", "ReduceScatter", "Broadcast", "Reduce",
                               "AlltoAll", "Gather", "Scatter", "Send", "Recv"},
                              1, "op#");
  return names[static_cast<uint8_t>(op)];
}

// ncclDataType_t values 0..11, by the names NCCL documents (ncclChar, ncclInt, ncclHalf, ncclFloat
// and ncclDouble are aliases of int8, int32, float16, float32 and float64).
std::string_view dtype_name(uint8_t dtype) {
  static const auto names =
      names_with_fallback<12>({"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
                               "float32", "float64", "bfloat16", "f8e4m3", "f8e5m2"},
                              0, "dtype");
  return names[dtype];
}

std::string_view origin_name(CommOrigin origin) {
  static const auto names = names_with_fallback<7>(
      {"InitRank", "InitRankConfig", "InitAll", "InitRankScalable", "Split", "Shrink", "Unknown"},
      1, "origin#");
  return names[static_cast<uint8_t>(origin)];
}

std::string_view end_name(CommEndKind how) {
  static const auto names =
      names_with_fallback<5>({"Finalize", "Destroy", "Abort", "Revoke", "ProcessExit"}, 1, "end#");
  return names[static_cast<uint8_t>(how)];
}

// Built-in ncclRedOp_t values; anything else is a user-created op (ncclRedOpCreatePreMulSum) or
// a value this build does not know. Those names are interned: a trace holds few distinct ones.
std::string_view redop_name(int32_t redop) {
  static constexpr std::array<std::string_view, 5> kBuiltIn = {"sum", "prod", "max", "min", "avg"};
  if (redop >= 0 && redop < static_cast<int32_t>(kBuiltIn.size())) return kBuiltIn[redop];
  static std::mutex mutex;
  static std::unordered_map<int32_t, std::string> interned;  // nodes never move: views stay valid
  std::lock_guard<std::mutex> lock(mutex);
  auto [it, inserted] = interned.try_emplace(redop);
  if (inserted) it->second = "op" + std::to_string(redop);
  return it->second;
}

std::string_view mode_name(AgreementMode mode) {
  static const auto names =
      names_with_fallback<4>({"none", "identical", "slot", "abort"}, 0, "mode#");
  return names[static_cast<uint8_t>(mode)];
}

std::string_view round_kind_name(RoundKind kind) {
  static const auto names =
      names_with_fallback<5>({"propose", "publish", "confirm", "cost", "hello"}, 1, "round#");
  return names[static_cast<uint8_t>(kind)];
}

std::string_view round_event_name(RoundEvent event) {
  static const auto names = names_with_fallback<5>(
      {"issued", "read", "activated", "deactivated", "abandoned"}, 1, "event#");
  return names[static_cast<uint8_t>(event)];
}

std::string_view reason_name(Reason reason) {
  static const auto names = names_with_fallback<static_cast<size_t>(Reason::Count)>(
      {"none",
       "not stable for MAGI_WARMUP_STEPS steps (count, call site or group changed; static "
       "weights: or the send buffer)",
       "host memory",
       "device memory (the host backend serves host memory)",
       "managed memory",
       "memory of unknown kind",
       "a peer is on another host",
       "a peer's GPU is not accessible",
       "shard below MAGI_SYMM_MIN_SHARD_MIB",
       "issued while its stream captured a CUDA graph",
       "bucket larger than MAGI_WINDOW_MAX_MIB",
       "another rank refused it",
       "another gather of its bucket stays",
       "abort: the ranks' steps differ",
       "abort: the ranks group their calls differently",
       "abort: more gathers in the step than a round carries",
       "an agreement round was issued inside an open group",
       "ranks run different MAGI_BACKEND values",
       "the transport failed on some rank",
       "some rank did not confirm the commit",
       "the call deviated from the agreed step",
       "communicator not agreeable (ncclCommInitAll, non-blocking, or unknown)",
       "static bindings would pass MAGI_BIND_MAX_MIB",
       "static weights changed after binding",
       "NCCL was faster for its bucket (timed both ways)",
       "the ranks' schedule settings differ (MAGI_WARMUP_STEPS, ...), or a rank cannot take part",
       "the step was refined: every rank sees a step of several shape steps, each gather its "
       "own position",
       "a communicator of one rank: NCCL's one local copy cannot be beaten (MAGI_CE_FORCE=1 "
       "moves anyway)",
       "some rank is still mapping its peers' memory (off the program's calls); the next step "
       "asks again"},
      0, "reason#");
  return names[static_cast<uint8_t>(reason)];
}

std::string_view verdict_name(Verdict verdict) {
  static const auto names = names_with_fallback<3>({"moved", "would move", "stays"}, 1, "verdict#");
  return names[static_cast<uint8_t>(verdict)];
}

bool is_collective(Op op) { return op != Op::Send && op != Op::Recv; }

void encode_record(char* out, RecordType type, const void* payload, uint32_t payload_bytes,
                   const void* tail, uint32_t tail_bytes) {
  const uint32_t body = payload_bytes + tail_bytes;
  const uint32_t bytes = record_bytes(payload_bytes, tail_bytes);
  const RecordHeader header{static_cast<uint16_t>(type), 0, bytes};
  std::memcpy(out, &header, sizeof(header));
  std::memcpy(out + sizeof(header), payload, payload_bytes);
  if (tail_bytes != 0) std::memcpy(out + sizeof(header) + payload_bytes, tail, tail_bytes);
  std::memset(out + sizeof(header) + body, 0, bytes - sizeof(header) - body);
}

}  // namespace magi::trace
