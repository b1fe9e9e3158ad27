// FP8 blockwise formats shared by every FP8 kernel (DESIGN.md §3-4), host and device alike.
//   scale_inv(block) = 2^-floor(log2(448 / amax)),  amax = max |x| over the block (NaN propagates)
//   q = e4m3(x * scale)  (round to nearest even, saturating to +-448);  x ~ e4m3_to_f32(q) * scale_inv
// Layouts (one f32 scale_inv per 128 elements along the contiguous dim of the data):
//   rowwise 1x128  data [M,K] e4m3, scale_inv [M, ceil(K/128)] row-major (what a row move likes).
//   colwise 1x128  data [K,M] e4m3 (the transpose of the [M,K] it stands for), in 128-row blocks per segment
//                  (expert) of the M rows; scale_inv [num_blocks, K] row-major (above fp8_colwise_max_blocks).
//   block 128x128  data [N,K] (or [E,N,K]), scale_inv [ceil(N/128), ceil(K/128)] per matrix.
//                  Its transpose is exact: transpose the bytes and the scale grid.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FLOWMOE_HD __host__ __device__ __forceinline__
#else
#define FLOWMOE_HD inline
#endif

namespace flowmoe {

constexpr int kFp8BlockSize = 128;
// The FP8 GEMMs take row counts in multiples of this (the wgrad operands' leading dimension): an FP8 linear's rows,
// each expert's padded segment (permute_pad's smallest align_size) and a permuted buffer's rows round up to it.
constexpr int kFp8RowMultiple = 16;
constexpr float kFp8E4m3Max = 448.0f;

FLOWMOE_HD int64_t fp8_num_blocks(int64_t n) { return (n + kFp8BlockSize - 1) / kFp8BlockSize; }
// The colwise 1x128 layout: the M rows form segments (experts) of rows_per_segment[s] rows, and each segment is
// cut into 128-row blocks, the last one partial; blocks never straddle segments. scale_inv is [num_blocks, K]
// row-major, num_blocks = sum_s ceil(rows_s / 128), so one segment's scales are a packed [blocks_s, K] slice
// (cuBLASLt's VEC128 order). Columns of data past the segments' total (a worst-case sized buffer) are zero.
// With the segments as device counts (E experts, the host not knowing them), scale_inv is sized for the worst
// case, [fp8_colwise_max_blocks(M, E), K]: its first num_blocks rows are the layout above, the rows past them
// 1.0f (what zero data quantizes to).
// An upper bound of sum_e ceil(r_e / 128) over E segments with sum_e r_e <= M (each ceil adds under 1).
FLOWMOE_HD int64_t fp8_colwise_max_blocks(int64_t M, int64_t E) { return fp8_num_blocks(M) + E; }

FLOWMOE_HD uint32_t fp8_f32_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, 4);
  return b;
}
FLOWMOE_HD float fp8_bits_f32(uint32_t b) {
  float x;
  memcpy(&x, &b, 4);
  return x;
}

// |a| max that propagates NaN (fmaxf would drop it and hide a non-finite block).
FLOWMOE_HD float fp8_amax_update(float amax, float x) {
  float ax = x < 0.f ? -x : x;
  if (ax != ax || amax != amax) return fp8_bits_f32(0x7FC00000u);
  return ax > amax ? ax : amax;
}

// The power-of-two exponent e with scale = 2^e, scale_inv = 2^-e, clamped to [-126, 126] so both
// are normal floats. Only meaningful for a finite, non-zero amax. Scales are exact powers of two, so x * scale
// is exact.
FLOWMOE_HD int fp8_scale_exponent(float amax) {
  float v = kFp8E4m3Max / amax;                       // IEEE division (nvcc's default), identical on host and device
  int e = int((fp8_f32_bits(v) >> 23) & 0xFF) - 127;  // floor(log2 v): v is a positive normal or +inf
  return e < -126 ? -126 : (e > 126 ? 126 : e);
}

FLOWMOE_HD float fp8_pow2(int e) { return fp8_bits_f32(uint32_t(e + 127) << 23); }  // e in [-126, 127]

// scale_inv of a block with this amax (see the header): 1 for amax 0 (scale 1); NaN for a non-finite amax, so the
// block dequantizes to NaN and the trainer's non-finite check sees it.
FLOWMOE_HD float fp8_scale_inv(float amax) {
  if (amax != amax || amax > 3.402823466e38f) return fp8_bits_f32(0x7FC00000u);
  if (amax == 0.f) return 1.f;
  return fp8_pow2(-fp8_scale_exponent(amax));
}
// 1 / scale_inv, exact for the powers of two above; NaN stays NaN (every element then quantizes to NaN).
FLOWMOE_HD float fp8_scale_from_inv(float scale_inv) {
  if (scale_inv != scale_inv) return scale_inv;
  return 1.f / scale_inv;
}

}  // namespace flowmoe
