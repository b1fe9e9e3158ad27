// The closeness checks and f64 references the attention tests share (tests/test_attention.cpp: the op;
// tests/test_flash_attention.cpp: the kernels called directly).
#pragma once
#include <algorithm>
#include <cmath>

#include "engine/ops/ops.h"
#include "tests/support/checks.h"

namespace flowmoe::test {

struct Result {
  Tensor out, d_q, d_k, d_v;
};

// Output and the gradients of sum(o * d_out), on the inputs' device.
inline Result attend_with_grads(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& d_out) {
  Variable qv(q, true), kv(k, true), vv(v, true);
  Variable o = causal_attention(qv, kv, vv);
  o.backward(d_out);
  return {o.data(), qv.grad(), kv.grad(), vv.grad()};
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

// The tensor-core kernels round P and dS to bf16 before their products (as flash attention does), on
// top of the bf16 outputs: elementwise 2e-2 relative + 1e-2 * max|ref|, normwise 1e-2 (expected: 2e-3 to 4e-3).
constexpr double kFlashRtol = 2e-2, kFlashAtolFrac = 1e-2, kFlashMaxRel = 1e-2;

}  // namespace flowmoe::test
