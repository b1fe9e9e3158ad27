// FP8 test operands shared by the grouped-GEMM tests (tests/test_fp8_grouped_linear.cpp,
// tests/test_grouped_gemm_device.cpp): values u·2^(a_i + b_j) whose neighbouring blocks get different
// power-of-two scales, quantized with the scalar code of kernels/fp8.h (rowwise 1x128, 128x128 weight
// blocks, colwise 1x128 over expert segments), so a wrong scale layout in a kernel shows.
#pragma once
#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "kernels/fp8.h"

namespace flowmoe::test {

// [rows, cols] values u·2^(a_i + b_j), u uniform in [-1, 1), a_i, b_j in [-3, 3]; rows past `live_rows`
// are zero (a worst-case sized buffer's tail).
inline std::vector<float> make_values(std::mt19937_64& gen, int64_t rows, int64_t cols, int64_t live_rows) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::uniform_int_distribution<int> ex(-3, 3);
  std::vector<int> a(static_cast<size_t>(rows)), b(static_cast<size_t>(cols));
  for (auto& v : a) v = ex(gen);
  for (auto& v : b) v = ex(gen);
  std::vector<float> v(size_t(rows * cols), 0.f);
  for (int64_t i = 0; i < live_rows; ++i)
    for (int64_t j = 0; j < cols; ++j) v[size_t(i * cols + j)] = u(gen) * fp8_pow2(a[size_t(i)] + b[size_t(j)]);
  return v;
}

struct Quantized {
  std::vector<uint8_t> q;
  std::vector<float> s;
};

// One block's amax -> scale_inv; every element of the block quantized with it.
inline float block_scale_inv(const std::vector<float>& v, const std::vector<size_t>& idx) {
  float amax = 0.f;
  for (size_t i : idx) amax = fp8_amax_update(amax, v[i]);
  return fp8_scale_inv(amax);
}
inline uint8_t quantize_value(float v, float scale_inv) { return f32_to_e4m3(v * fp8_scale_from_inv(scale_inv)); }

inline Quantized quantize_rowwise(const std::vector<float>& v, int64_t rows, int64_t cols) {
  const int64_t cb = fp8_num_blocks(cols);
  Quantized out{std::vector<uint8_t>(v.size()), std::vector<float>(size_t(rows * cb))};
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t b = 0; b < cb; ++b) {
      std::vector<size_t> idx;
      for (int64_t j = b * 128; j < std::min(cols, (b + 1) * 128); ++j) idx.push_back(size_t(i * cols + j));
      float s = out.s[size_t(i * cb + b)] = block_scale_inv(v, idx);
      for (size_t t : idx) out.q[t] = quantize_value(v[t], s);
    }
  return out;
}

// num_mats matrices [n, k], 128x128 blocks, scale_inv [num_mats, ceil(n/128), ceil(k/128)].
inline Quantized quantize_blocks(const std::vector<float>& v, int64_t num_mats, int64_t n, int64_t k) {
  const int64_t nb = fp8_num_blocks(n), kb = fp8_num_blocks(k);
  Quantized out{std::vector<uint8_t>(v.size()), std::vector<float>(size_t(num_mats * nb * kb))};
  for (int64_t e = 0; e < num_mats; ++e)
    for (int64_t bi = 0; bi < nb; ++bi)
      for (int64_t bj = 0; bj < kb; ++bj) {
        std::vector<size_t> idx;
        for (int64_t i = bi * 128; i < std::min(n, (bi + 1) * 128); ++i)
          for (int64_t j = bj * 128; j < std::min(k, (bj + 1) * 128); ++j) idx.push_back(size_t((e * n + i) * k + j));
        float s = out.s[size_t((e * nb + bi) * kb + bj)] = block_scale_inv(v, idx);
        for (size_t t : idx) out.q[t] = quantize_value(v[t], s);
      }
  return out;
}

// v [m_total, cols] -> colwise over the segments `rows`: q_t [cols, m_total] (tail columns 0),
// s [num_blocks, cols] with num_blocks = Σ ceil(rows_e / 128).
inline Quantized quantize_colwise(const std::vector<float>& v, const std::vector<int64_t>& rows, int64_t m_total,
                                  int64_t cols) {
  int64_t num_blocks = 0;
  for (int64_t r : rows) num_blocks += fp8_num_blocks(r);
  Quantized out{std::vector<uint8_t>(size_t(cols * m_total), 0), std::vector<float>(size_t(num_blocks * cols))};
  int64_t off = 0, blk = 0;
  for (int64_t r : rows) {
    for (int64_t b = 0; b < fp8_num_blocks(r); ++b, ++blk)
      for (int64_t c = 0; c < cols; ++c) {
        std::vector<size_t> idx;
        for (int64_t i = off + b * 128; i < off + std::min(r, (b + 1) * 128); ++i) idx.push_back(size_t(i * cols + c));
        float s = out.s[size_t(blk * cols + c)] = block_scale_inv(v, idx);
        for (size_t t : idx) out.q[size_t(c * m_total) + t / size_t(cols)] = quantize_value(v[t], s);
      }
    off += r;
  }
  return out;
}

}  // namespace flowmoe::test
