#include "tests/support/workload/reference.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <type_traits>

namespace workload {
namespace {

// Load/store of one element type through CUDA's host conversions or plain C++.
template <class S, class V>
struct Codec {
  using Storage = S;
  using Value = V;
};

struct HalfCodec : Codec<uint16_t, float> {
  static float load(uint16_t s) {
    __half_raw raw;
    raw.x = s;
    return __half2float(__half(raw));
  }
  static uint16_t store(float v) { return static_cast<__half_raw>(__float2half_rn(v)).x; }
};

struct Bfloat16Codec : Codec<uint16_t, float> {
  static float load(uint16_t s) {
    __nv_bfloat16_raw raw;
    raw.x = s;
    return __bfloat162float(__nv_bfloat16(raw));
  }
  static uint16_t store(float v) {
    return static_cast<__nv_bfloat16_raw>(__float2bfloat16_rn(v)).x;
  }
};

template <__nv_fp8_interpretation_t Kind>
struct Fp8Codec : Codec<uint8_t, float> {
  static float load(uint8_t s) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(s), Kind)));
  }
  static uint8_t store(float v) { return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, Kind); }
};

template <class T>
struct PlainCodec : Codec<T, T> {
  static T load(T s) { return s; }
  static T store(T v) { return v; }
};

template <class V>
V apply(ncclRedOp_t op, V a, V b) {
  if constexpr (std::is_integral_v<V>) {
    using U = std::make_unsigned_t<V>;  // wrapping arithmetic without signed overflow
    switch (op) {
      case ncclSum:
      case ncclAvg: return static_cast<V>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
      case ncclProd: return static_cast<V>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
      case ncclMax: return b > a ? b : a;
      case ncclMin: return b < a ? b : a;
      default: break;
    }
  } else {
    switch (op) {
      case ncclSum:
      case ncclAvg: return a + b;
      case ncclProd: return a * b;
      case ncclMax: return b > a ? b : a;
      case ncclMin: return b < a ? b : a;
      default: break;
    }
  }
  return a;
}

template <class C>
void fold(ncclRedOp_t op, const std::vector<Bytes>& inputs, size_t offset, size_t count,
          Bytes& out) {
  using S = typename C::Storage;
  using V = typename C::Value;
  out.resize(count * sizeof(S));
  for (size_t i = 0; i < count; ++i) {
    auto element = [&](size_t rank) {
      S s;
      std::memcpy(&s, inputs[rank].data() + (offset + i) * sizeof(S), sizeof(S));
      return s;
    };
    S acc = element(0);
    for (size_t r = 1; r < inputs.size(); ++r)
      acc = C::store(apply<V>(op, C::load(acc), C::load(element(r))));
    if (op == ncclAvg) {
      const size_t n = inputs.size();
      if constexpr (std::is_integral_v<V>) {
        acc = std::is_signed_v<V>
                  ? static_cast<S>(static_cast<int64_t>(acc) / static_cast<int64_t>(n))
                  : static_cast<S>(static_cast<uint64_t>(acc) / n);
      } else {
        acc = C::store(C::load(acc) / static_cast<V>(n));
      }
    }
    std::memcpy(out.data() + i * sizeof(S), &acc, sizeof(S));
  }
}

// The pattern: small non-zero integers -3..5 (no zero, so a product that overflows to infinity
// never meets a zero and turns NaN). Floats scale them by 2^-6..2^6, differently on each rank, so
// sums and products need more bits than the narrow types have: rounding, ties, subnormals,
// infinities and fp8 saturation all happen, as do int8 wrap-arounds.
int pattern(int rank, int case_id, size_t index) {
  const int t =
      static_cast<int>(
          (static_cast<size_t>(rank) * 7 + static_cast<size_t>(case_id) * 13 + index * 3) % 8) -
      3;
  return t == 0 ? 5 : t;
}

int float_exponent(int rank, size_t index) {
  return static_cast<int>((static_cast<size_t>(rank) * 3 + index) % 5) * 3 - 6;
}

template <class C>
void encode(typename C::Value v, unsigned char* dst) {
  typename C::Storage s = C::store(v);
  std::memcpy(dst, &s, sizeof s);
}

template <class C>
double decode(const unsigned char* src) {
  typename C::Storage s;
  std::memcpy(&s, src, sizeof s);
  return static_cast<double>(C::load(s));
}

}  // namespace

size_t element_bytes(ncclDataType_t dtype) {
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
    default: return 8;
  }
}

const char* dtype_text(ncclDataType_t dtype) {
  static const char* const names[] = {"int8",    "uint8",    "int32",   "uint32",
                                      "int64",   "uint64",   "float16", "float32",
                                      "float64", "bfloat16", "fp8e4m3", "fp8e5m2"};
  return dtype >= 0 && dtype < ncclNumTypes ? names[dtype] : "?";
}

const char* redop_text(ncclRedOp_t op) {
  static const char* const names[] = {"sum", "prod", "max", "min", "avg"};
  return op >= 0 && op < ncclNumOps ? names[op] : "?";
}

Bytes make_input(ncclDataType_t dtype, int rank, int case_id, size_t count, size_t first) {
  const size_t size = element_bytes(dtype);
  Bytes out(count * size);
  for (size_t i = 0; i < count; ++i) {
    const int t = pattern(rank, case_id, first + i);
    const float real = std::ldexp(static_cast<float>(t) * 0.75f, float_exponent(rank, first + i));
    unsigned char* dst = out.data() + i * size;
    switch (dtype) {
      case ncclInt8: encode<PlainCodec<int8_t>>(static_cast<int8_t>(t), dst); break;
      case ncclUint8: encode<PlainCodec<uint8_t>>(static_cast<uint8_t>(t), dst); break;
      case ncclInt32: encode<PlainCodec<int32_t>>(t, dst); break;
      case ncclUint32: encode<PlainCodec<uint32_t>>(static_cast<uint32_t>(t), dst); break;
      case ncclInt64: encode<PlainCodec<int64_t>>(t, dst); break;
      case ncclUint64: encode<PlainCodec<uint64_t>>(static_cast<uint64_t>(t), dst); break;
      case ncclFloat16: encode<HalfCodec>(real, dst); break;
      case ncclFloat32: encode<PlainCodec<float>>(real, dst); break;
      case ncclFloat64: encode<PlainCodec<double>>(real, dst); break;
      case ncclBfloat16: encode<Bfloat16Codec>(real, dst); break;
      case ncclFloat8e4m3: encode<Fp8Codec<__NV_E4M3>>(real, dst); break;
      case ncclFloat8e5m2: encode<Fp8Codec<__NV_E5M2>>(real, dst); break;
      default: break;
    }
  }
  return out;
}

Bytes reference_reduce(ncclDataType_t dtype, ncclRedOp_t op, const std::vector<Bytes>& inputs,
                       size_t offset, size_t count) {
  Bytes out;
  switch (dtype) {
    case ncclInt8: fold<PlainCodec<int8_t>>(op, inputs, offset, count, out); break;
    case ncclUint8: fold<PlainCodec<uint8_t>>(op, inputs, offset, count, out); break;
    case ncclInt32: fold<PlainCodec<int32_t>>(op, inputs, offset, count, out); break;
    case ncclUint32: fold<PlainCodec<uint32_t>>(op, inputs, offset, count, out); break;
    case ncclInt64: fold<PlainCodec<int64_t>>(op, inputs, offset, count, out); break;
    case ncclUint64: fold<PlainCodec<uint64_t>>(op, inputs, offset, count, out); break;
    case ncclFloat16: fold<HalfCodec>(op, inputs, offset, count, out); break;
    case ncclFloat32: fold<PlainCodec<float>>(op, inputs, offset, count, out); break;
    case ncclFloat64: fold<PlainCodec<double>>(op, inputs, offset, count, out); break;
    case ncclBfloat16: fold<Bfloat16Codec>(op, inputs, offset, count, out); break;
    case ncclFloat8e4m3: fold<Fp8Codec<__NV_E4M3>>(op, inputs, offset, count, out); break;
    case ncclFloat8e5m2: fold<Fp8Codec<__NV_E5M2>>(op, inputs, offset, count, out); break;
    default: break;
  }
  return out;
}

std::string element_text(ncclDataType_t dtype, const unsigned char* element) {
  const size_t size = element_bytes(dtype);
  uint64_t bits = 0;
  for (size_t i = 0; i < size; ++i) bits |= static_cast<uint64_t>(element[i]) << (8 * i);
  double value = 0;
  switch (dtype) {
    case ncclInt8: value = static_cast<int8_t>(bits); break;
    case ncclUint8:
    case ncclUint32:
    case ncclUint64: value = static_cast<double>(bits); break;
    case ncclInt32: value = static_cast<int32_t>(bits); break;
    case ncclInt64: value = static_cast<double>(static_cast<int64_t>(bits)); break;
    case ncclFloat16: value = decode<HalfCodec>(element); break;
    case ncclFloat32: value = decode<PlainCodec<float>>(element); break;
    case ncclFloat64: value = decode<PlainCodec<double>>(element); break;
    case ncclBfloat16: value = decode<Bfloat16Codec>(element); break;
    case ncclFloat8e4m3: value = decode<Fp8Codec<__NV_E4M3>>(element); break;
    case ncclFloat8e5m2: value = decode<Fp8Codec<__NV_E5M2>>(element); break;
    default: break;
  }
  char text[64];
  std::snprintf(text, sizeof text, "0x%0*llx (%g)", static_cast<int>(size * 2),
                static_cast<unsigned long long>(bits), value);
  return text;
}

}  // namespace workload
