#include "capture/trace_format.h"

#include <array>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

#include "base/enum_names.h"

namespace magi::trace {

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
