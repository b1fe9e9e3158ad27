// CPU reference of the scaling-aware FP8 transpose (math in kernels/fp8_transpose.h): per (128-row block
// of a segment, 128-column block) the coarsest scale S of the rows that hold information, then each byte
// re-encoded at S with dtype.h's software e4m3 conversions (bit-identical to kernels/cuda/fp8_transpose.cu).
// Tests: tests/test_fp8_transpose.cpp.
#include "kernels/fp8_transpose.h"

#include <algorithm>
#include <array>
#include <cstring>

#include "kernels/common/dtype.h"
#include "kernels/common/error.h"
#include "kernels/fp8.h"

namespace flowmoe {

namespace {

constexpr int kMaxShift = 64;               // 2^-k past ~20 rounds every e4m3 value to zero anyway
constexpr uint32_t kNanBits = 0x7FC00000u;  // the NaN written for a non-finite column block

int exponent_field(float x) { return int((fp8_f32_bits(x) >> 23) & 0xFF); }

// shifted[k][b] = e4m3_satfinite(e4m3_to_f32(b) * 2^-k): the whole conversion as a lookup, built from
// the same software conversions, so it is the formula itself.
using ShiftTable = std::array<std::array<uint8_t, 256>, kMaxShift + 1>;
const ShiftTable& shift_table() {
  static const ShiftTable table = [] {
    ShiftTable t{};
    for (int k = 0; k <= kMaxShift; ++k)
      for (int b = 0; b < 256; ++b) t[size_t(k)][size_t(b)] = f32_to_e4m3(e4m3_to_f32(uint8_t(b)) * fp8_pow2(-k));
    return t;
  }();
  return table;
}

}  // namespace

int64_t fp8_transpose_num_blocks(const int64_t* rows_per_segment, int64_t num_segments, int64_t M) {
  FLOWMOE_CHECK(M >= 0 && num_segments >= 0, ShapeError, "fp8_transpose: bad M ", M, " or num_segments ", num_segments);
  FLOWMOE_CHECK(num_segments == 0 || rows_per_segment != nullptr, ShapeError, "fp8_transpose: ", num_segments,
                " segments but no rows_per_segment");
  int64_t total = 0, blocks = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t rows = rows_per_segment[s];
    FLOWMOE_CHECK(rows >= 0, ShapeError, "fp8_transpose: rows_per_segment[", s, "] = ", rows, " is negative");
    FLOWMOE_CHECK(rows <= M - total, ShapeError, "fp8_transpose: rows_per_segment sum to more than M = ", M, " (",
                  total, " before segment ", s, " of ", rows, " rows)");
    total += rows;
    blocks += fp8_num_blocks(rows);
  }
  return blocks;
}

void fp8_transpose_cpu(const uint8_t* q, const float* scale_inv, int64_t M, int64_t K, const int64_t* rows_per_segment,
                       int64_t num_segments, uint8_t* q_t, float* scale_inv_t) {
  FLOWMOE_CHECK(K >= 0, ShapeError, "fp8_transpose_cpu: bad K ", K);
  fp8_transpose_num_blocks(rows_per_segment, num_segments, M);
  const ShiftTable& shifted = shift_table();
  const int64_t num_col_blocks = fp8_num_blocks(K);
  int64_t seg_start = 0, blk = 0;  // first row of the segment; global 128-row block index
  for (int64_t s = 0; s < num_segments; ++s) {
    for (int64_t r0 = 0; r0 < rows_per_segment[s]; r0 += kFp8BlockSize, ++blk) {
      const int64_t first = seg_start + r0, num_rows = std::min<int64_t>(kFp8BlockSize, rows_per_segment[s] - r0);
      for (int64_t b = 0; b < num_col_blocks; ++b) {
        const int64_t c0 = b * kFp8BlockSize, c1 = std::min<int64_t>(K, c0 + kFp8BlockSize);
        // S as the max of the scales' bits (positive floats order as ints; NaN above +inf); 0: nobody.
        int32_t s_bits = 0;
        for (int64_t i = first; i < first + num_rows; ++i) {
          const float si = scale_inv[i * num_col_blocks + b];
          bool nonzero = false;
          for (int64_t j = c0; j < c1; ++j) nonzero |= (q[i * K + j] & 0x7F) != 0;
          if (!nonzero && si == si) continue;  // an all-zero block says nothing about the scale
          s_bits = std::max(s_bits, si != si ? int32_t(kNanBits) : int32_t(fp8_f32_bits(si)));
        }
        const bool nan_scale = s_bits > int32_t(0x7F800000u);
        const float S = s_bits == 0 ? 1.f : fp8_bits_f32(uint32_t(nan_scale ? kNanBits : uint32_t(s_bits)));
        for (int64_t j = c0; j < c1; ++j) scale_inv_t[blk * K + j] = S;
        for (int64_t i = first; i < first + num_rows; ++i) {
          int k = nan_scale ? 0 : exponent_field(S) - exponent_field(scale_inv[i * num_col_blocks + b]);
          k = std::clamp(k, 0, kMaxShift);
          for (int64_t j = c0; j < c1; ++j) q_t[j * M + i] = shifted[size_t(k)][q[i * K + j]];
        }
      }
    }
    seg_start += rows_per_segment[s];
  }
  // Columns past the segments (a worst-case sized buffer) are zero.
  if (seg_start < M)
    for (int64_t j = 0; j < K; ++j) std::memset(q_t + j * M + seg_start, 0, size_t(M - seg_start));
}

}  // namespace flowmoe
