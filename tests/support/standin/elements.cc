#include "tests/support/standin/elements.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "tests/support/standin/minifloat.h"

namespace standin {
namespace {

// How one element type is stored and computed on: Storage in memory, Value in arithmetic.
template <class T>
struct Plain {
  using Storage = T;
  using Value = T;
  static Value load(Storage s) { return s; }
  static Storage store(Value v) { return v; }
};

template <class Bits, float (*ToFloat)(Bits), Bits (*FromFloat)(float)>
struct Narrow {
  using Storage = Bits;
  using Value = float;
  static Value load(Storage s) { return ToFloat(s); }
  static Storage store(Value v) { return FromFloat(v); }
};

using Half = Narrow<uint16_t, half_to_float, float_to_half>;
using Bfloat16 = Narrow<uint16_t, bfloat16_to_float, float_to_bfloat16>;
using E4M3 = Narrow<uint8_t, e4m3_to_float, float_to_e4m3>;
using E5M2 = Narrow<uint8_t, e5m2_to_float, float_to_e5m2>;

template <class V>
V combine(ncclRedOp_t op, V a, V b) {
  if constexpr (std::is_integral_v<V>) {
    // Through uint64_t: wrapping, never signed overflow; the narrowing is modular (C++20).
    switch (op) {
      case ncclSum:
      case ncclAvg: return static_cast<V>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
      case ncclProd: return static_cast<V>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
      case ncclMax: return b > a ? b : a;
      case ncclMin: return b < a ? b : a;
      default: return a;
    }
  } else {
    switch (op) {
      case ncclSum:
      case ncclAvg: return a + b;
      case ncclProd: return a * b;
      case ncclMax: return b > a ? b : a;
      case ncclMin: return b < a ? b : a;
      default: return a;
    }
  }
}

template <class Type>
void reduce_typed(ncclRedOp_t op, void* out, const void* const* inputs, int ninputs, size_t count) {
  using S = typename Type::Storage;
  using V = typename Type::Value;
  auto* dst = static_cast<unsigned char*>(out);
  for (size_t i = 0; i < count; ++i) {
    const size_t offset = i * sizeof(S);
    S stored;
    std::memcpy(&stored, static_cast<const unsigned char*>(inputs[0]) + offset, sizeof(S));
    for (int r = 1; r < ninputs; ++r) {
      S next;
      std::memcpy(&next, static_cast<const unsigned char*>(inputs[r]) + offset, sizeof(S));
      stored = Type::store(combine<V>(op, Type::load(stored), Type::load(next)));
    }
    if (op == ncclAvg) {
      if constexpr (std::is_integral_v<V>) {
        using Wide = std::conditional_t<std::is_signed_v<V>, int64_t, uint64_t>;
        stored = static_cast<S>(static_cast<Wide>(stored) / static_cast<Wide>(ninputs));
      } else {
        stored = Type::store(Type::load(stored) / static_cast<V>(ninputs));
      }
    }
    std::memcpy(dst + offset, &stored, sizeof(S));
  }
}

}  // namespace

bool valid_datatype(int dtype) { return dtype >= 0 && dtype < ncclNumTypes; }
bool valid_redop(int redop) { return redop >= 0 && redop < ncclNumOps; }

size_t datatype_bytes(ncclDataType_t dtype) {
  switch (dtype) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}

const char* datatype_name(int dtype) {
  static const char* const names[] = {"int8",    "uint8",    "int32",   "uint32",
                                      "int64",   "uint64",   "float16", "float32",
                                      "float64", "bfloat16", "fp8e4m3", "fp8e5m2"};
  return valid_datatype(dtype) ? names[dtype] : "invalid-datatype";
}

const char* redop_name(int redop) {
  static const char* const names[] = {"sum", "prod", "max", "min", "avg"};
  return valid_redop(redop) ? names[redop] : "invalid-redop";
}

void reduce_elements(ncclDataType_t dtype, ncclRedOp_t op, void* out, const void* const* inputs,
                     int ninputs, size_t count) {
  switch (dtype) {
    case ncclInt8: return reduce_typed<Plain<int8_t>>(op, out, inputs, ninputs, count);
    case ncclUint8: return reduce_typed<Plain<uint8_t>>(op, out, inputs, ninputs, count);
    case ncclInt32: return reduce_typed<Plain<int32_t>>(op, out, inputs, ninputs, count);
    case ncclUint32: return reduce_typed<Plain<uint32_t>>(op, out, inputs, ninputs, count);
    case ncclInt64: return reduce_typed<Plain<int64_t>>(op, out, inputs, ninputs, count);
    case ncclUint64: return reduce_typed<Plain<uint64_t>>(op, out, inputs, ninputs, count);
    case ncclFloat16: return reduce_typed<Half>(op, out, inputs, ninputs, count);
    case ncclFloat32: return reduce_typed<Plain<float>>(op, out, inputs, ninputs, count);
    case ncclFloat64: return reduce_typed<Plain<double>>(op, out, inputs, ninputs, count);
    case ncclBfloat16: return reduce_typed<Bfloat16>(op, out, inputs, ninputs, count);
    case ncclFloat8e4m3: return reduce_typed<E4M3>(op, out, inputs, ninputs, count);
    case ncclFloat8e5m2: return reduce_typed<E5M2>(op, out, inputs, ninputs, count);
    default: return;
  }
}

}  // namespace standin
