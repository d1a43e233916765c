#include "tests/support/standin/minifloat.h"

#include <cmath>
#include <cstring>

namespace standin {
namespace {

uint32_t bits_of(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

float float_of(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

// A small binary format: sign, `exponent_bits`, `mantissa_bits`, bias 2^(e-1)-1.
struct SmallFormat {
  int exponent_bits;
  int mantissa_bits;
  bool has_infinity;  // E5M2: all-ones exponent is Inf/NaN; E4M3: only S.1111.111 is NaN
  uint8_t nan;        // the quiet NaN this converter produces (sign added separately)
  float max_finite;
  int bias() const { return (1 << (exponent_bits - 1)) - 1; }
};

constexpr SmallFormat kE4M3{4, 3, false, 0x7f, 448.0f};
constexpr SmallFormat kE5M2{5, 2, true, 0x7e, 57344.0f};

float small_to_float(uint8_t bits, const SmallFormat& f) {
  const bool negative = bits & 0x80;
  const int exponent = (bits >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  const int mantissa = bits & ((1 << f.mantissa_bits) - 1);
  const int max_exponent = (1 << f.exponent_bits) - 1;
  float magnitude;
  if (f.has_infinity && exponent == max_exponent) {
    magnitude = mantissa == 0 ? INFINITY : NAN;
  } else if (!f.has_infinity && exponent == max_exponent &&
             mantissa == (1 << f.mantissa_bits) - 1) {
    magnitude = NAN;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), 1 - f.bias() - f.mantissa_bits);
  } else {
    magnitude = std::ldexp(static_cast<float>(mantissa + (1 << f.mantissa_bits)),
                           exponent - f.bias() - f.mantissa_bits);
  }
  return negative ? -magnitude : magnitude;
}

// Rounds |value| to a multiple of the format's spacing at its magnitude (exact: the spacing is a
// power of two), ties to even, then saturates and encodes the now exactly representable value.
uint8_t float_to_small(float value, const SmallFormat& f) {
  const uint8_t sign = std::signbit(value) ? 0x80 : 0x00;
  if (std::isnan(value)) return sign | f.nan;
  const float magnitude = std::fabs(value);
  if (magnitude == 0.0f) return sign;
  const int min_normal_exponent = 1 - f.bias();
  int exponent = std::ilogb(magnitude);
  if (exponent < min_normal_exponent) exponent = min_normal_exponent;
  const int spacing_exponent = exponent - f.mantissa_bits;
  float units = std::nearbyint(std::ldexp(magnitude, -spacing_exponent));  // ties to even
  float rounded = std::ldexp(units, spacing_exponent);
  if (!(rounded <= f.max_finite)) rounded = f.max_finite;  // saturate, infinity included
  if (rounded == 0.0f) return sign;
  int rounded_exponent = std::ilogb(rounded);
  if (rounded_exponent < min_normal_exponent) {
    const int mantissa =
        static_cast<int>(std::ldexp(rounded, f.mantissa_bits - min_normal_exponent));
    return sign | static_cast<uint8_t>(mantissa);
  }
  const int mantissa = static_cast<int>(std::ldexp(rounded, f.mantissa_bits - rounded_exponent)) -
                       (1 << f.mantissa_bits);
  return sign | static_cast<uint8_t>(((rounded_exponent + f.bias()) << f.mantissa_bits) | mantissa);
}

}  // namespace

float half_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  uint32_t mantissa = bits & 0x3ff;
  if (exponent == 0x1f) return float_of(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return float_of(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return float_of(sign);
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal: m × 2^-24
  return sign ? -magnitude : magnitude;
}

uint16_t float_to_half(float value) {
  const uint32_t f = bits_of(value);
  const uint16_t sign = static_cast<uint16_t>((f >> 16) & 0x8000);
  const int exponent = static_cast<int>((f >> 23) & 0xff);
  uint32_t mantissa = f & 0x7fffff;
  if (exponent == 0xff) {
    return sign | 0x7c00 | (mantissa != 0 ? 0x200 | (mantissa >> 13) : 0);
  }
  const int half_exponent = exponent - 127 + 15;
  if (half_exponent >= 31) return sign | 0x7c00;
  if (half_exponent <= 0) {
    if (half_exponent < -10) return sign;  // below half the smallest subnormal
    mantissa |= 0x800000;
    const int shift = 14 - half_exponent;
    uint32_t result = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (result & 1))) ++result;  // may carry into normal
    return sign | static_cast<uint16_t>(result);
  }
  uint32_t result = (static_cast<uint32_t>(half_exponent) << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest == 0x1000 && (result & 1))) ++result;  // a carry may reach infinity
  return sign | static_cast<uint16_t>(result);
}

float bfloat16_to_float(uint16_t bits) { return float_of(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_bfloat16(float value) {
  const uint32_t f = bits_of(value);
  if ((f & 0x7fffffff) > 0x7f800000) return static_cast<uint16_t>((f >> 16) | 0x40);  // quiet NaN
  const uint32_t bias = 0x7fff + ((f >> 16) & 1);  // ties to even
  return static_cast<uint16_t>((f + bias) >> 16);
}

float e4m3_to_float(uint8_t bits) { return small_to_float(bits, kE4M3); }
uint8_t float_to_e4m3(float value) { return float_to_small(value, kE4M3); }
float e5m2_to_float(uint8_t bits) { return small_to_float(bits, kE5M2); }
uint8_t float_to_e5m2(float value) { return float_to_small(value, kE5M2); }

}  // namespace standin
