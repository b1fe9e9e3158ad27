// CPU reference for the fused SwiGLU + FP8 quantize (see kernels/swiglu_quant.h): row by row, the
// composition of the unfused references (swiglu_forward_cpu / swiglu_backward_cpu in f32), the prob
// product and the fp8.h rowwise quantize with dtype.h's f32_to_e4m3, so it equals the unfused CPU
// pipeline bit for bit. Tests: tests/test_swiglu_quant.cpp.
#include "kernels/swiglu_quant.h"

#include <cstring>
#include <vector>

#include "kernels/common/error.h"
#include "kernels/fp8.h"
#include "kernels/swiglu.h"

namespace flowmoe {

namespace {

void check_args(const char* what, DType dtype, int64_t M, int64_t F) {
  FLOWMOE_CHECK(M >= 0 && F >= 0, ShapeError, what, ": bad shape M ", M, ", F ", F);
  FLOWMOE_CHECK(dtype == DType::f32 || dtype == DType::bf16, DTypeError, what, " supports f32 and bf16, got ",
                dtype_name(dtype));
}

// Row r of an [M, n] f32/bf16 matrix, widened to f32 (exact).
void load_row(DType dtype, const void* x, int64_t r, int64_t n, float* out) {
  if (dtype == DType::f32) {
    if (n > 0) std::memcpy(out, static_cast<const float*>(x) + r * n, size_t(n) * sizeof(float));
  } else {
    const uint16_t* b = static_cast<const uint16_t*>(x) + r * n;
    for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_f32(b[i]);
  }
}

void store_row(DType dtype, void* x, int64_t r, int64_t n, const float* in) {
  if (dtype == DType::f32) {
    if (n > 0) std::memcpy(static_cast<float*>(x) + r * n, in, size_t(n) * sizeof(float));
  } else {
    uint16_t* b = static_cast<uint16_t*>(x) + r * n;
    for (int64_t i = 0; i < n; ++i) b[i] = f32_to_bf16_bits(in[i]);
  }
}

// Rowwise 1x128 quantize of one row of n values (kernels/fp8.h).
void quantize_row(const float* x, int64_t n, uint8_t* q, float* scale_inv) {
  for (int64_t b = 0; b < fp8_num_blocks(n); ++b) {
    const int64_t lo = b * kFp8BlockSize, hi = lo + kFp8BlockSize < n ? lo + kFp8BlockSize : n;
    float amax = 0.f;
    for (int64_t i = lo; i < hi; ++i) amax = fp8_amax_update(amax, x[i]);
    const float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
    scale_inv[b] = s_inv;
    for (int64_t i = lo; i < hi; ++i) q[i] = f32_to_e4m3(x[i] * scale);
  }
}

}  // namespace

void swiglu_quant_forward_cpu(DType dtype, const void* h, const float* prob, int64_t M, int64_t F, uint8_t* q,
                              float* scale_inv) {
  check_args("swiglu_quant_forward_cpu", dtype, M, F);
  const int64_t nb = fp8_num_blocks(F);
  std::vector<float> hrow(static_cast<size_t>(2 * F)), a(static_cast<size_t>(F));
  for (int64_t r = 0; r < M; ++r) {
    load_row(dtype, h, r, 2 * F, hrow.data());
    swiglu_forward_cpu<float>(a.data(), hrow.data(), 1, F);
    const float p = prob ? prob[r] : 1.f;
    for (float& v : a) v = v * p;
    quantize_row(a.data(), F, q + r * F, scale_inv + r * nb);
  }
}

void swiglu_quant_backward_cpu(DType dtype, const void* d_a, const void* h, const float* prob, int64_t M, int64_t F,
                               uint8_t* d_h_q, float* d_h_scale_inv, void* d_h, float* d_prob) {
  check_args("swiglu_quant_backward_cpu", dtype, M, F);
  FLOWMOE_CHECK(!d_h_q == !d_h_scale_inv, Error,
                "swiglu_quant_backward_cpu: d_h_q and d_h_scale_inv come together (one of them is null)");
  const int64_t nb = fp8_num_blocks(2 * F);
  const size_t n = static_cast<size_t>(F);
  std::vector<float> hrow(2 * n), da(n), dy(n), act(n), dh(2 * n);
  for (int64_t r = 0; r < M; ++r) {
    load_row(dtype, h, r, 2 * F, hrow.data());
    load_row(dtype, d_a, r, F, da.data());
    const float p = prob ? prob[r] : 1.f;
    if (d_prob) {  // d_prob = sum_j d_a * swiglu(h): the mul node's gradient w.r.t. the prob
      swiglu_forward_cpu<float>(act.data(), hrow.data(), 1, F);
      double sum = 0;
      for (int64_t j = 0; j < F; ++j) sum += double(da[size_t(j)]) * double(act[size_t(j)]);
      d_prob[r] = float(sum);
    }
    if (!d_h_q && !d_h) continue;
    for (int64_t j = 0; j < F; ++j) dy[size_t(j)] = da[size_t(j)] * p;
    swiglu_backward_cpu<float>(dh.data(), dy.data(), hrow.data(), 1, F);
    if (d_h_q) quantize_row(dh.data(), 2 * F, d_h_q + r * 2 * F, d_h_scale_inv + r * nb);
    if (d_h) store_row(dtype, d_h, r, 2 * F, dh.data());
  }
}

}  // namespace flowmoe
