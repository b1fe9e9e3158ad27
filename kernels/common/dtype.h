// Element types and their software conversions. The CPU backend converts bf16 and FP8 in software;
// these functions must agree bit for bit with the CUDA intrinsics (round to nearest even; FP8 saturates).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace flowmoe {

enum class DType : uint8_t { f32, f64, bf16, e4m3, e5m2, i32, i64, u8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
// The dtype dtype_name calls `name`; false when none is.
bool dtype_from_name(const std::string& name, DType* out);
bool is_floating(DType t);  // f32, f64, bf16, e4m3, e5m2
bool is_fp8(DType t);

// bf16 is stored as its raw 16 bits.
struct bf16 {
  uint16_t bits;
};
uint16_t f32_to_bf16_bits(float x);  // round to nearest even; NaN stays NaN
float bf16_bits_to_f32(uint16_t b);
inline bf16 to_bf16(float x) { return bf16{f32_to_bf16_bits(x)}; }
inline float to_f32(bf16 x) { return bf16_bits_to_f32(x.bits); }

// FP8 (OCP): e4m3fn has max 448 and no infinities; e5m2 has max 57344 and infinities.
// Both round to nearest even and saturate finite overflow to +-max (the "satfinite" mode);
// NaN maps to the positive NaN code 0x7F (e4m3 0.1111.111), as the H100/H200 cvt instruction does.
uint8_t f32_to_e4m3(float x);
float e4m3_to_f32(uint8_t b);
uint8_t f32_to_e5m2(float x);
float e5m2_to_f32(uint8_t b);

constexpr float kE4m3Max = 448.0f;
constexpr float kE5m2Max = 57344.0f;

}  // namespace flowmoe
