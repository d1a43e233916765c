// The 16- and 8-bit floating formats of nccl.h, converted by hand: float16 (IEEE binary16),
// bfloat16, and the two fp8 formats (E4M3: no infinity, one NaN; E5M2: IEEE-like). Narrowing
// rounds to nearest, ties to even; fp8 saturates to the largest finite value, as NCCL's fp8
// reductions do. Arithmetic on these types happens in float, one rounding per step.
#pragma once

#include <cstdint>

namespace standin {

float half_to_float(uint16_t bits);
uint16_t float_to_half(float value);

float bfloat16_to_float(uint16_t bits);
uint16_t float_to_bfloat16(float value);

float e4m3_to_float(uint8_t bits);
uint8_t float_to_e4m3(float value);

float e5m2_to_float(uint8_t bits);
uint8_t float_to_e5m2(float value);

}  // namespace standin
