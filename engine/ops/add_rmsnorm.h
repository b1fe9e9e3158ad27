// The residual add fused with the RMSNorm after it (and, optionally, the FP8 quantize of the norm's output), as an
// autograd op: a transformer block's h = x + attn(...) and the post-attention norm of h in one kernel. Math and
// layouts: kernels/add_rmsnorm.h. Kernels: kernels/cpu/add_rmsnorm.cpp, kernels/cuda/add_rmsnorm.cu.
// Tests: tests/test_add_rmsnorm.cpp.
#pragma once
#include <string>

#include "engine/autograd.h"
#include "engine/ops/rmsnorm_quant.h"

namespace flowmoe {

struct AddNormed {
  Variable h;       // x + a, the residual stream
  NormQuantized n;  // the norm of h: y and/or q
};

// x and a [..., H] and weight [H] in one dtype (f32 or bf16 on cuda; f32 or f64 on the CPU). h = add(x, a), and
// n.y = rmsnorm(h, weight, eps) bit for bit, on either backend. With a `site`, also n.q = quantize_rowwise(n.y) bit
// for bit ([rows, H], counted as that quantize: one CastKind::quantize at `site`), and n.y only when keep_y; with
// an empty site, n.y alone. Gradient: RMSNorm's of d_y + d_q (straight through) added to h's own, to x and a alike.
AddNormed add_rmsnorm(const Variable& x, const Variable& a, const Variable& weight, double eps,
                      const std::string& site = "", bool keep_y = true);

}  // namespace flowmoe
