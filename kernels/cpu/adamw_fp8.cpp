// CPU reference for AdamW with the FP8 block copy written in the same pass (kernels/adamw_fp8.h): block by block,
// as the CUDA kernel runs, so its tiling (tails, the transpose's indices) is what the tests check.
#include "kernels/adamw_fp8.h"

#include <algorithm>

#include "kernels/common/error.h"
#include "kernels/fp8.h"

namespace flowmoe {

void check_adamw_fp8(const AdamWFp8Tensor* tensors, int64_t num_tensors, const char* what) {
  FLOWMOE_CHECK(num_tensors >= 0 && (tensors || num_tensors == 0), Error, what, ": ", num_tensors, " tensors");
  for (int64_t i = 0; i < num_tensors; ++i) {
    const AdamWTensor& t = tensors[i].t;
    const Fp8BlockCopy& c = tensors[i].fp8;
    const int64_t first = t.rounding.first_index, row = kFp8BlockSize * c.K;
    FLOWMOE_CHECK(c.B >= 0 && c.N >= 0 && c.K >= 0 && t.n >= 0 && first >= 0 && first + t.n <= c.B * c.N * c.K,
                  ShapeError, what, ": tensor ", i, " has elements [", first, ", ", first + t.n, ") for an FP8 copy [",
                  c.B, ", ", c.N, ", ", c.K, "]");
    const bool whole = first == 0 && t.n == c.B * c.N * c.K;
    FLOWMOE_CHECK(whole || (c.N % kFp8BlockSize == 0 && first % row == 0 && t.n % row == 0), Error, what, ": tensor ",
                  i, " is the range [", first, ", ", first + t.n, ") of [", c.B, ", ", c.N, ", ", c.K,
                  "], not whole 128-row block rows");
    FLOWMOE_CHECK(t.n == 0 || (t.param && t.grad && t.exp_avg && t.exp_avg_sq && c.q && c.scale_inv &&
                               (c.q_t != nullptr) == (c.scale_inv_t != nullptr)),
                  Error, what, ": tensor ", i, " has a null buffer for ", t.n, " elements");
    FLOWMOE_CHECK(!t.copy.data || t.copy.dtype == DType::f32 || t.copy.dtype == DType::bf16, DTypeError, what,
                  ": tensor ", i, " has a weight copy in ", dtype_name(t.copy.dtype), " (f32 or bf16)");
    FLOWMOE_CHECK(t.moment_dtype == DType::f32 || t.moment_dtype == DType::bf16, DTypeError, what, ": tensor ", i,
                  " has moments in ", dtype_name(t.moment_dtype), " (f32 or bf16)");
  }
}

namespace {

// The updated weight at flat index i of the whole tensor as the forward reads it: the copy where one is written,
// else the master (t's buffers start at element first_index).
float weight_as_read(const AdamWTensor& t, int64_t whole_i) {
  const int64_t i = whole_i - t.rounding.first_index;
  if (!t.copy.data) return t.param[i];
  if (t.copy.dtype == DType::f32) return static_cast<const float*>(t.copy.data)[i];
  return bf16_bits_to_f32(static_cast<const uint16_t*>(t.copy.data)[i]);
}

// Block (b, bn, bk) of one tensor: its elements updated row by row, then quantized with their amax.
void update_block(const AdamWTensor& t, const AdamWStep& s, const Fp8BlockCopy& c, int64_t b, int64_t bn, int64_t bk) {
  const int64_t n0 = bn * kFp8BlockSize, n1 = std::min(c.N, n0 + kFp8BlockSize);
  const int64_t k0 = bk * kFp8BlockSize, k1 = std::min(c.K, k0 + kFp8BlockSize);
  const int64_t nbn = fp8_num_blocks(c.N), nbk = fp8_num_blocks(c.K), base = b * c.N * c.K;
  const int64_t moment_size = int64_t(dtype_size(t.moment_dtype));
  const int64_t copy_size = t.copy.data ? int64_t(dtype_size(t.copy.dtype)) : 0;
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t i0 = base + n * c.K + k0;          // an element's update depends on its index alone (kernels/adamw.h)
    const int64_t at = i0 - t.rounding.first_index;  // in t's buffers
    WeightCopy copy = t.copy;
    if (copy.data) copy.data = static_cast<char*>(copy.data) + at * copy_size;
    adamw_cpu(t.param + at, t.grad + at, static_cast<char*>(t.exp_avg) + at * moment_size,
              static_cast<char*>(t.exp_avg_sq) + at * moment_size, k1 - k0, s, copy, t.moment_dtype,
              {t.rounding.key, i0});
  }
  float amax = 0.f;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k = k0; k < k1; ++k) amax = fp8_amax_update(amax, weight_as_read(t, base + n * c.K + k));
  const float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
  c.scale_inv[(b * nbn + bn) * nbk + bk] = s_inv;
  if (c.scale_inv_t) c.scale_inv_t[(b * nbk + bk) * nbn + bn] = s_inv;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k = k0; k < k1; ++k) {
      const uint8_t v = f32_to_e4m3(weight_as_read(t, base + n * c.K + k) * scale);
      c.q[base + n * c.K + k] = v;
      if (c.q_t) c.q_t[base + k * c.N + n] = v;
    }
}

}  // namespace

void adamw_fp8_cpu(const AdamWFp8Tensor* tensors, int64_t num_tensors, const StepScalars* control) {
  check_adamw_fp8(tensors, num_tensors, "adamw_fp8_cpu");
  if (control && !control->apply) return;  // a skipped step: weights, moments and copies stay as they are
  for (int64_t i = 0; i < num_tensors; ++i) {
    const AdamWTensor& t = tensors[i].t;
    const Fp8BlockCopy& c = tensors[i].fp8;
    const AdamWStep s = control ? scheduled_adamw_step(t.step, *control, t.lr_multiplier) : t.step;
    // Block rows r = b * nbn + bn of the range (a whole tensor: all of them).
    const int64_t nbn = fp8_num_blocks(c.N), row = kFp8BlockSize * c.K;
    const int64_t r0 = t.rounding.first_index == 0 ? 0 : t.rounding.first_index / row;
    const int64_t r1 = t.n == c.B * c.N * c.K ? c.B * nbn : r0 + t.n / row;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t bk = 0; bk < fp8_num_blocks(c.K); ++bk) update_block(t, s, c, r / nbn, r % nbn, bk);
  }
}

void fp8_block_transpose_cpu(const Fp8BlockCopy& c) {
  const int64_t nbn = fp8_num_blocks(c.N), nbk = fp8_num_blocks(c.K);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t bn = 0; bn < nbn; ++bn)
      for (int64_t bk = 0; bk < nbk; ++bk)
        c.scale_inv_t[(b * nbk + bk) * nbn + bn] = c.scale_inv[(b * nbn + bn) * nbk + bk];
    const int64_t base = b * c.N * c.K;
    for (int64_t n = 0; n < c.N; ++n)
      for (int64_t k = 0; k < c.K; ++k) c.q_t[base + k * c.N + n] = c.q[base + n * c.K + k];
  }
}

}  // namespace flowmoe
