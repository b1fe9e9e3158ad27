// RMSNorm fused with the rowwise 1x128 FP8 quantize of its output, as an autograd op (DESIGN.md §7: fp8_full
// quantizes a norm's output in the norm's kernel, for the FP8 linears that read it). Math and layouts:
// kernels/rmsnorm_quant.h. Kernels: kernels/cpu/rmsnorm_quant.cpp, kernels/cuda/rmsnorm_quant.cu.
// Tests: tests/test_rmsnorm_quant.cpp.
#pragma once
#include <string>

#include "engine/autograd.h"

namespace flowmoe {

struct NormQuantized {
  Variable q;  // e4m3 [rows, H] with rowwise_1x128 scale_inv [rows, ceil(H/128)] (rows: x's leading dims)
  Variable y;  // rmsnorm(x) in x's shape and dtype, for a reader that is no FP8 linear; undefined unless kept
};

// x [..., H] and weight [H] in one dtype (f32 or bf16 on cuda; f32 or f64 on the CPU, where a double y is
// quantized from its f32 rounding). q is quantize_rowwise(rmsnorm(x, weight, eps)) bit for bit on either backend,
// and is counted as that quantize: one CastKind::quantize at `site`. keep_y: y is written by the same pass.
// Gradient: RMSNorm's (engine/ops/rmsnorm.h) of d_y + d_q, d_q straight through (an FP8 d_q dequantized, not
// counted).
NormQuantized rmsnorm_quantize(const Variable& x, const Variable& weight, double eps, const std::string& site,
                               bool keep_y);

}  // namespace flowmoe
