// The closeness checks and f64 references the attention tests share (tests/test_attention.cpp: the op;
// tests/test_flash_attention.cpp: the kernels called directly; tests/test_attention_cudnn.cpp: cuDNN's backend).
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/ops/ops.h"
#include "tests/support/checks.h"

namespace flowmoe::test {

struct Result {
  Tensor out, d_q, d_k, d_v;
};

// Output and the gradients of sum(o * d_out), on the inputs' device (on a GPU, the kernels of `backend`).
inline Result attend_with_grads(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& d_out,
                                AttentionBackend backend = AttentionBackend::automatic) {
  Variable qv(q, true), kv(k, true), vv(v, true);
  Variable o = causal_attention(qv, kv, vv, backend);
  o.backward(d_out);
  return {o.data(), qv.grad(), kv.grad(), vv.grad()};
}

// Random bf16 inputs on the CPU, q and k [B, T, nh, hd] (shape) and v and d_out [B, T, nh, v_hd], with the f64
// reference's output and gradients on the same values.
struct AttentionCase {
  Tensor q, k, v, d_out;
  Result ref;
};
inline AttentionCase attention_case(Rng& rng, const Shape& shape, int64_t v_hd) {
  const Shape v_shape = {shape[0], shape[1], shape[2], v_hd};
  AttentionCase c;
  c.q = random_tensor(rng, shape, DType::bf16);
  c.k = random_tensor(rng, shape, DType::bf16);
  c.v = random_tensor(rng, v_shape, DType::bf16);
  c.d_out = random_tensor(rng, v_shape, DType::bf16);
  c.ref = attend_with_grads(c.q.to(DType::f64), c.k.to(DType::f64), c.v.to(DType::f64), c.d_out.to(DType::f64));
  return c;
}

inline double max_abs(const Tensor& t) {
  double m = 0;
  for (double x : t.to_doubles()) m = std::max(m, std::fabs(x));
  return m;
}

// Elementwise within rtol plus an absolute slack of atol_frac * max|ref|, and normwise within max_rel.
inline ::testing::AssertionResult close_to(const Tensor& got, const Tensor& ref, double rtol, double atol_frac,
                                           double max_rel) {
  // Inputs are O(1), so the absolute floor never drops below atol_frac: a gradient that is exactly
  // zero in exact math (T = 1: d_q = d_k = 0) still gets fp32 rounding residue on the GPU, and the f64
  // reference's own residue (about 1e-17) is no scale to measure a relative error against.
  const double ref_max = max_abs(ref);
  ::testing::AssertionResult r = all_close(got, ref, rtol, atol_frac * std::max(ref_max, 1.0));
  if (!r || ref_max <= atol_frac) return r;
  double e = rel_error(got, ref);
  if (e > max_rel) return ::testing::AssertionFailure() << "relative error " << e << " > " << max_rel;
  return ::testing::AssertionSuccess();
}

// lse[b, h, i] = log sum_{j<=i} exp(q_i·k_j / sqrt(hd)) in f64.
inline Tensor reference_lse(const Tensor& q, const Tensor& k) {
  const Shape& s = q.shape();
  const int64_t B = s[0], T = s[1], nh = s[2], hd = s[3];
  const std::vector<double> qs = q.to_doubles(), ks = k.to_doubles();
  std::vector<double> lse(static_cast<size_t>(B * nh * T)), scores(static_cast<size_t>(T));
  const double scale = 1.0 / std::sqrt(double(hd));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t i = 0; i < T; ++i) {
        double m = -INFINITY;
        for (int64_t j = 0; j <= i; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < hd; ++d)
            dot += qs[size_t(((b * T + i) * nh + h) * hd + d)] * ks[size_t(((b * T + j) * nh + h) * hd + d)];
          scores[size_t(j)] = dot * scale;
          m = std::max(m, scores[size_t(j)]);
        }
        double sum = 0;
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(scores[size_t(j)] - m);
        lse[size_t((b * nh + h) * T + i)] = m + std::log(sum);
      }
  return Tensor::from_doubles(lse, {B, nh, T});
}

// The tensor-core kernels round P and dS to bf16 before their products (as flash attention does), on
// top of the bf16 outputs: elementwise 2e-2 relative + 1e-2 * max|ref|, normwise 1e-2 (expected: 2e-3 to 4e-3).
constexpr double kFlashRtol = 2e-2, kFlashAtolFrac = 1e-2, kFlashMaxRel = 1e-2;

// got's output and gradients against want's within the tensor-core tolerances.
inline void expect_tensor_core_close(const Result& got, const Result& want, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_TRUE(close_to(got.out, want.out, kFlashRtol, kFlashAtolFrac, kFlashMaxRel)) << "out";
  EXPECT_TRUE(close_to(got.d_q, want.d_q, kFlashRtol, kFlashAtolFrac, kFlashMaxRel)) << "d_q";
  EXPECT_TRUE(close_to(got.d_k, want.d_k, kFlashRtol, kFlashAtolFrac, kFlashMaxRel)) << "d_k";
  EXPECT_TRUE(close_to(got.d_v, want.d_v, kFlashRtol, kFlashAtolFrac, kFlashMaxRel)) << "d_v";
}

}  // namespace flowmoe::test
