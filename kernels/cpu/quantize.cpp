// CPU reference for blockwise FP8 quantize / dequantize (kernels/quantize.h), plain loops over the
// formats of kernels/fp8.h and the software conversions of kernels/common/dtype.h. Only exact operations
// (x * power of two, a max) happen in f32, so these equal the CUDA kernels bit for bit.
// Tests: tests/test_quantize.cpp.
#include "kernels/quantize.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "kernels/common/error.h"
#include "kernels/fp8.h"

namespace flowmoe {

namespace {

void check_float_dtype(DType dtype, const char* what, const char* tensor) {
  FLOWMOE_CHECK(dtype == DType::f32 || dtype == DType::bf16, DTypeError, what, ": ", tensor,
                " must be f32 or bf16, got ", dtype_name(dtype));
}

float load_f32(DType dtype, const void* p, int64_t i) {
  if (dtype == DType::f32) return static_cast<const float*>(p)[i];
  return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
}

void store_f32(DType dtype, void* p, int64_t i, float v) {
  if (dtype == DType::f32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<uint16_t*>(p)[i] = f32_to_bf16_bits(v);
}

// e4m3_to_f32(q) * scale_inv, with NaN as the GPU's canonical 0x7FFFFFFF (x86 would keep a payload).
float dequantize_value(uint8_t q, float scale_inv) {
  float v = e4m3_to_f32(q) * scale_inv;
  return v != v ? fp8_bits_f32(0x7FFFFFFFu) : v;
}

void check_sizes(const char* what, int64_t a, const char* a_name, int64_t b, const char* b_name) {
  FLOWMOE_CHECK(a >= 0 && b >= 0, ShapeError, what, ": negative size ", a_name, " = ", a, ", ", b_name, " = ", b);
}

}  // namespace

// ---- rowwise ----------------------------------------------------------------------------------

void quantize_rowwise_cpu(DType dtype, const void* x, int64_t M, int64_t K, uint8_t* q, float* scale_inv) {
  check_float_dtype(dtype, "quantize_rowwise_cpu", "x");
  check_sizes("quantize_rowwise_cpu", M, "M", K, "K");
  int64_t nbk = fp8_num_blocks(K);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nbk; ++b) {
      int64_t k0 = b * kFp8BlockSize, k1 = std::min(K, k0 + kFp8BlockSize);
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = fp8_amax_update(amax, load_f32(dtype, x, r * K + k));
      float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
      scale_inv[r * nbk + b] = s_inv;
      for (int64_t k = k0; k < k1; ++k) q[r * K + k] = f32_to_e4m3(load_f32(dtype, x, r * K + k) * scale);
    }
}

void dequantize_rowwise_cpu(DType out_dtype, const uint8_t* q, const float* scale_inv, int64_t M, int64_t K, void* y) {
  check_float_dtype(out_dtype, "dequantize_rowwise_cpu", "y");
  check_sizes("dequantize_rowwise_cpu", M, "M", K, "K");
  int64_t nbk = fp8_num_blocks(K);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < K; ++k)
      store_f32(out_dtype, y, r * K + k, dequantize_value(q[r * K + k], scale_inv[r * nbk + k / kFp8BlockSize]));
}

// ---- colwise over segments --------------------------------------------------------------------

int64_t colwise_total_rows(const int64_t* rows_per_segment, int64_t num_segments) {
  FLOWMOE_CHECK(num_segments >= 0, ShapeError, "colwise FP8: negative num_segments ", num_segments);
  int64_t total = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    FLOWMOE_CHECK(rows_per_segment[s] >= 0, ShapeError, "colwise FP8: rows_per_segment[", s,
                  "] = ", rows_per_segment[s], " is negative");
    total += rows_per_segment[s];
  }
  return total;
}

int64_t colwise_num_blocks(const int64_t* rows_per_segment, int64_t num_segments) {
  colwise_total_rows(rows_per_segment, num_segments);  // validates
  int64_t n = 0;
  for (int64_t s = 0; s < num_segments; ++s) n += fp8_num_blocks(rows_per_segment[s]);
  return n;
}

// Calls f(row0, num_rows, block_idx) for every 128-row block of the segments, in scale_inv order.
template <class F>
static void for_each_colwise_block(const char* what, int64_t M, const int64_t* rows_per_segment, int64_t num_segments,
                                   F&& f) {
  int64_t total = colwise_total_rows(rows_per_segment, num_segments);
  FLOWMOE_CHECK(total <= M, ShapeError, what, ": rows_per_segment sum to ", total, " rows but the tensor has M = ", M);
  int64_t row = 0, blk = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    int64_t end = row + rows_per_segment[s];
    for (int64_t r0 = row; r0 < end; r0 += kFp8BlockSize) f(r0, std::min<int64_t>(kFp8BlockSize, end - r0), blk++);
    row = end;
  }
}

void quantize_colwise_cpu(DType dtype, const void* x, int64_t M, int64_t K, const int64_t* rows_per_segment,
                          int64_t num_segments, uint8_t* q, float* scale_inv) {
  const char* what = "quantize_colwise_cpu";
  check_float_dtype(dtype, what, "x");
  check_sizes(what, M, "M", K, "K");
  std::vector<float> amax(static_cast<size_t>(K)), scale(static_cast<size_t>(K));
  int64_t total = 0;
  for_each_colwise_block(what, M, rows_per_segment, num_segments, [&](int64_t r0, int64_t n, int64_t blk) {
    std::fill(amax.begin(), amax.end(), 0.f);
    for (int64_t i = r0; i < r0 + n; ++i)  // row by row: x is read contiguously
      for (int64_t k = 0; k < K; ++k) amax[size_t(k)] = fp8_amax_update(amax[size_t(k)], load_f32(dtype, x, i * K + k));
    for (int64_t k = 0; k < K; ++k) {
      float s_inv = fp8_scale_inv(amax[size_t(k)]);
      scale_inv[blk * K + k] = s_inv;
      scale[size_t(k)] = fp8_scale_from_inv(s_inv);
    }
    for (int64_t i = r0; i < r0 + n; ++i)
      for (int64_t k = 0; k < K; ++k) q[k * M + i] = f32_to_e4m3(load_f32(dtype, x, i * K + k) * scale[size_t(k)]);
    total = r0 + n;
  });
  for (int64_t k = 0; k < K; ++k)  // columns past the segments (a worst-case sized buffer) are zero
    std::fill(q + k * M + total, q + (k + 1) * M, uint8_t(0));
}

void dequantize_colwise_cpu(DType out_dtype, const uint8_t* q, const float* scale_inv, int64_t M, int64_t K,
                            const int64_t* rows_per_segment, int64_t num_segments, void* y) {
  const char* what = "dequantize_colwise_cpu";
  check_float_dtype(out_dtype, what, "y");
  check_sizes(what, M, "M", K, "K");
  int64_t total = 0;
  for_each_colwise_block(what, M, rows_per_segment, num_segments, [&](int64_t r0, int64_t n, int64_t blk) {
    for (int64_t i = r0; i < r0 + n; ++i)
      for (int64_t k = 0; k < K; ++k)
        store_f32(out_dtype, y, i * K + k, dequantize_value(q[k * M + i], scale_inv[blk * K + k]));
    total = r0 + n;
  });
  for (int64_t i = total * K; i < M * K; ++i) store_f32(out_dtype, y, i, 0.f);
}

// ---- block 128x128 ----------------------------------------------------------------------------

// The checks both directions share; returns the block grid of each [N, K] matrix, {N blocks, K blocks}.
static std::pair<int64_t, int64_t> block_grid(const char* what, DType dtype, const char* arg, int64_t B, int64_t N,
                                              int64_t K) {
  check_float_dtype(dtype, what, arg);
  check_sizes(what, N, "N", K, "K");
  check_sizes(what, B, "B", 0, "-");
  return {fp8_num_blocks(N), fp8_num_blocks(K)};
}

void quantize_block_cpu(DType dtype, const void* w, int64_t B, int64_t N, int64_t K, uint8_t* q, float* scale_inv,
                        uint8_t* q_t, float* scale_inv_t) {
  const auto [nbn, nbk] = block_grid("quantize_block_cpu", dtype, "w", B, N, K);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t bn = 0; bn < nbn; ++bn)
      for (int64_t bk = 0; bk < nbk; ++bk) {
        int64_t n0 = bn * kFp8BlockSize, n1 = std::min(N, n0 + kFp8BlockSize);
        int64_t k0 = bk * kFp8BlockSize, k1 = std::min(K, k0 + kFp8BlockSize);
        const int64_t base = b * N * K;
        float amax = 0.f;
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t k = k0; k < k1; ++k) amax = fp8_amax_update(amax, load_f32(dtype, w, base + n * K + k));
        float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
        scale_inv[(b * nbn + bn) * nbk + bk] = s_inv;
        if (q_t) scale_inv_t[(b * nbk + bk) * nbn + bn] = s_inv;
        for (int64_t n = n0; n < n1; ++n)
          for (int64_t k = k0; k < k1; ++k) {
            uint8_t v = f32_to_e4m3(load_f32(dtype, w, base + n * K + k) * scale);
            q[base + n * K + k] = v;
            if (q_t) q_t[base + k * N + n] = v;
          }
      }
}

void dequantize_block_cpu(DType out_dtype, const uint8_t* q, const float* scale_inv, int64_t B, int64_t N, int64_t K,
                          void* y) {
  const auto [nbn, nbk] = block_grid("dequantize_block_cpu", out_dtype, "y", B, N, K);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) {
        int64_t i = (b * N + n) * K + k;
        float s_inv = scale_inv[(b * nbn + n / kFp8BlockSize) * nbk + k / kFp8BlockSize];
        store_f32(out_dtype, y, i, dequantize_value(q[i], s_inv));
      }
}

}  // namespace flowmoe
