// Software element conversions for the CPU backend (see dtype.h for the contract).
#include "kernels/common/dtype.h"

#include <cmath>
#include <cstring>

#include "kernels/common/error.h"

namespace flowmoe {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
      return 4;
    case DType::f64:
      return 8;
    case DType::bf16:
      return 2;
    case DType::e4m3:
      return 1;
    case DType::e5m2:
      return 1;
    case DType::i32:
      return 4;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  FLOWMOE_THROW(DTypeError, "unknown dtype id ", int(t));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::f64:
      return "f64";
    case DType::bf16:
      return "bf16";
    case DType::e4m3:
      return "e4m3";
    case DType::e5m2:
      return "e5m2";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "unknown";
}

bool dtype_from_name(const std::string& name, DType* out) {
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::e4m3, DType::e5m2, DType::i32, DType::i64, DType::u8})
    if (name == dtype_name(t)) return *out = t, true;
  return false;
}

bool is_floating(DType t) { return t == DType::f32 || t == DType::f64 || t == DType::bf16 || is_fp8(t); }
bool is_fp8(DType t) { return t == DType::e4m3 || t == DType::e5m2; }

static uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
static float bits_f32(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

uint16_t f32_to_bf16_bits(float x) {
  uint32_t u = f32_bits(x);
  if (std::isnan(x)) return 0x7FFF;  // CUDA's canonical bf16 NaN (sign dropped), so CPU and GPU agree
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;  // round to nearest even
  return uint16_t(u >> 16);
}

float bf16_bits_to_f32(uint16_t b) { return bits_f32(uint32_t(b) << 16); }

// Generic float -> small float with `man_bits` mantissa bits, exponent bias `bias`, largest finite
// value `max_val`, saturating. Works on the exact value, so rounding is nearest-even on the target grid
// including its subnormals (spacing 2^(1-bias-man_bits)).
static uint8_t f32_to_small(float x, int man_bits, int bias, float max_val, uint8_t nan_code) {
  if (std::isnan(x)) return nan_code;  // the GPU's cvt gives the positive NaN code for any NaN
  uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  float a = std::fabs(x);
  if (a > max_val) a = max_val;  // saturate (also +-inf for e4m3)
  if (a == 0.0f) return sign;
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5,1): unbiased exponent of a is e-1
  int exp_unb = e - 1;
  int min_exp = 1 - bias;                    // smallest normal exponent
  if (exp_unb < min_exp) exp_unb = min_exp;  // subnormal: fixed spacing
  // quantum of the target grid at this exponent
  double q = std::ldexp(1.0, exp_unb - man_bits);
  double n = std::nearbyint(double(a) / q);  // default FE_TONEAREST: ties to even
  double v = n * q;
  if (v > max_val) v = max_val;
  // encode v
  if (v == 0.0) return sign;
  int ev;
  std::frexp(v, &ev);
  int eu = ev - 1;
  uint32_t code;
  if (eu < min_exp) {  // subnormal
    code = uint32_t(std::ldexp(v, bias - 1 + man_bits));
  } else {
    uint32_t mant = uint32_t(std::ldexp(v, man_bits - eu)) - (1u << man_bits);
    code = (uint32_t(eu + bias) << man_bits) | mant;
  }
  return uint8_t(sign | code);
}

static float small_to_f32(uint8_t b, int man_bits, int bias) {
  int exp_bits = 7 - man_bits;
  uint32_t sign = b & 0x80;
  uint32_t e = (b >> man_bits) & ((1u << exp_bits) - 1);
  uint32_t m = b & ((1u << man_bits) - 1);
  float v;
  if (e == 0)
    v = std::ldexp(float(m), 1 - bias - man_bits);
  else
    v = std::ldexp(float((1u << man_bits) | m), int(e) - bias - man_bits);
  return sign ? -v : v;
}

uint8_t f32_to_e4m3(float x) { return f32_to_small(x, 3, 7, kE4m3Max, 0x7F); }

// The GPU converts FP8 NaN to the canonical float NaN 0x7FFFFFFF; the CPU returns the same bits.
static float canonical_nan() { return bits_f32(0x7FFFFFFFu); }

float e4m3_to_f32(uint8_t b) {
  if ((b & 0x7F) == 0x7F) return canonical_nan();
  return small_to_f32(b, 3, 7);
}

uint8_t f32_to_e5m2(float x) {
  if (std::isinf(x)) return std::signbit(x) ? 0xFB : 0x7B;  // satfinite: inf saturates to max
  return f32_to_small(x, 2, 15, kE5m2Max, 0x7F);
}

float e5m2_to_f32(uint8_t b) {
  uint32_t e = (b >> 2) & 0x1F, m = b & 3;
  if (e == 0x1F) return m ? canonical_nan() : ((b & 0x80) ? -INFINITY : INFINITY);
  return small_to_f32(b, 2, 15);
}

}  // namespace flowmoe
