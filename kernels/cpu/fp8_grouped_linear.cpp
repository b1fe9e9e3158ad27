// CPU reference for the FP8 GroupedLinear GEMMs (see kernels/fp8_grouped_linear.h): per expert, the
// operands are dequantized to f32 (e4m3 value times its block's power-of-two scale_inv, exact) and
// multiplied with gemm_cpu (Eigen, fp32 accumulation); a bf16 output is rounded to nearest even once.
// This is also the CPU backend's FP8 path, so each expert's buffers are reused, not re-allocated.
#include "kernels/fp8_grouped_linear.h"

#include <algorithm>
#include <array>
#include <vector>

#include "kernels/common/error.h"
#include "kernels/fp8.h"
#include "kernels/grouped_linear.h"
#include "kernels/linear.h"

namespace flowmoe {

namespace {

// e4m3 -> f32 for all 256 codes, built once from dtype.h's conversion (NaN codes stay NaN).
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[size_t(i)] = e4m3_to_f32(uint8_t(i));
    return t;
  }();
  return table;
}

void check_sizes(int64_t num_experts, int64_t m_total, int64_t n, int64_t k, const char* what) {
  FLOWMOE_CHECK(num_experts >= 0 && m_total >= 0 && n >= 0 && k >= 0, ShapeError, what,
                ": negative size E=", num_experts, " M_total=", m_total, " N=", n, " K=", k);
}

}  // namespace

size_t fp8_grouped_gemm_workspace_bytes(int64_t m_total, int64_t k, int64_t num_experts, int64_t n) {
  const size_t kb = size_t(fp8_num_blocks(std::max<int64_t>(k, 0)));
  const size_t x_scales = size_t(std::max<int64_t>(m_total, 0)) * kb;
  const size_t w_scales =
      size_t(std::max<int64_t>(num_experts, 0)) * size_t(fp8_num_blocks(std::max<int64_t>(n, 0))) * ((kb + 3) / 4 * 4);
  return ((x_scales + 63) / 64 * 64 + w_scales) * sizeof(float);  // the weight part starts 256-byte aligned
}

void fp8_grouped_gemm_cpu(DType out_dtype, const uint8_t* x, const float* x_scale_inv, const uint8_t* w,
                          const float* w_scale_inv, void* y, const int64_t* padded_tokens_per_expert,
                          int64_t num_experts, int64_t m_total, int64_t n, int64_t k) {
  const char* what = "fp8_grouped_gemm_cpu";
  FLOWMOE_CHECK(out_dtype == DType::bf16 || out_dtype == DType::f32, DTypeError, what,
                ": the output must be bf16 or f32, got ", dtype_name(out_dtype));
  check_sizes(num_experts, m_total, n, k, what);
  const int64_t total = check_grouped_rows(padded_tokens_per_expert, num_experts, m_total, what);
  const auto& lut = e4m3_table();
  const int64_t kb = fp8_num_blocks(k), nb = fp8_num_blocks(n);
  std::vector<float> xf, wf, yf;
  int64_t off = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = padded_tokens_per_expert[e];
    if (rows == 0) continue;
    xf.resize(size_t(rows * k));
    for (int64_t i = 0; i < rows; ++i) {
      const uint8_t* q = x + (off + i) * k;
      const float* s = x_scale_inv + (off + i) * kb;
      for (int64_t j = 0; j < k; ++j) xf[size_t(i * k + j)] = lut[q[j]] * s[j / kFp8BlockSize];
    }
    wf.resize(size_t(n * k));
    const uint8_t* we = w + e * n * k;
    const float* se = w_scale_inv + e * nb * kb;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < k; ++j)
        wf[size_t(i * k + j)] = lut[we[i * k + j]] * se[(i / kFp8BlockSize) * kb + j / kFp8BlockSize];
    yf.resize(size_t(rows * n));
    gemm_cpu<float>(false, true, rows, n, k, xf.data(), wf.data(), yf.data(), false);
    if (out_dtype == DType::f32) {
      std::copy(yf.begin(), yf.end(), static_cast<float*>(y) + off * n);
    } else {
      uint16_t* out = static_cast<uint16_t*>(y) + off * n;
      for (size_t i = 0; i < yf.size(); ++i) out[i] = f32_to_bf16_bits(yf[i]);
    }
    off += rows;
  }
  // tail rows past the last segment: zeros (all-zero bits in f32 and bf16)
  const size_t es = dtype_size(out_dtype);
  std::fill(static_cast<char*>(y) + size_t(total * n) * es, static_cast<char*>(y) + size_t(m_total * n) * es, 0);
}

void fp8_grouped_wgrad_cpu(const uint8_t* dy_t, const float* dy_t_scale_inv, const uint8_t* x_t,
                           const float* x_t_scale_inv, float* dw, const int64_t* padded_tokens_per_expert,
                           int64_t num_experts, int64_t m_total, int64_t n, int64_t k, bool accumulate) {
  const char* what = "fp8_grouped_wgrad_cpu";
  check_sizes(num_experts, m_total, n, k, what);
  check_grouped_rows(padded_tokens_per_expert, num_experts, m_total, what);
  const auto& lut = e4m3_table();
  // A colwise operand [cols, m_total] of this segment as f32 [cols, rows]; the segment's scales are
  // the packed [ceil(rows/128), cols] slice starting at block row `blk`.
  auto dequant_segment = [&](std::vector<float>& out, const uint8_t* q, const float* s, int64_t cols, int64_t off,
                             int64_t blk, int64_t rows) {
    out.resize(size_t(cols * rows));
    for (int64_t c = 0; c < cols; ++c)
      for (int64_t i = 0; i < rows; ++i)
        out[size_t(c * rows + i)] = lut[q[c * m_total + off + i]] * s[(blk + i / kFp8BlockSize) * cols + c];
  };
  std::vector<float> dyf, xf;
  int64_t off = 0, blk = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = padded_tokens_per_expert[e];
    float* dw_e = dw + e * n * k;
    if (rows == 0) {
      if (!accumulate) std::fill(dw_e, dw_e + n * k, 0.f);  // no tokens: an empty sum
      continue;
    }
    dequant_segment(dyf, dy_t, dy_t_scale_inv, n, off, blk, rows);
    dequant_segment(xf, x_t, x_t_scale_inv, k, off, blk, rows);
    gemm_cpu<float>(false, true, n, k, rows, dyf.data(), xf.data(), dw_e, accumulate);  // [n,r]·[k,r]ᵀ
    off += rows;
    blk += fp8_num_blocks(rows);
  }
}

}  // namespace flowmoe
