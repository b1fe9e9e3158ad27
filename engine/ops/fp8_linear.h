// A dense linear in FP8, as DeepSeek-V3 §3.3 trains every linear (the fp8_full recipe, DESIGN.md §7):
//
//   fprop  y  = xq · Wqᵀ               xq 1x128 rowwise [M, K], Wq 128x128 blocks   -> y [M, N]
//   dgrad  dx = dyq · Wq               dyq: dy quantized rowwise here (a counted cast), Wq's exact block transpose
//   wgrad  dW = dyqᶜᵒˡ · xqᶜᵒˡᵀ          both from the scaling-aware transpose (no cast), fp32
//
// It is fp8_grouped_linear with one group of all M rows (weight [N, K] viewed as [1, N, K], counts {M}) and
// fp8_flow's wgrad (Fp8Wgrad::transpose), so its CPU path is the fp8_grouped_gemm_cpu reference and its CUDA path
// the per-expert cuBLASLt calls over host counts: nothing reads the device. x arrives quantized: the caller
// quantizes an activation once (quantize_rowwise, its cast to count) and feeds the same xq to every linear that
// reads it (q, k and v; an MLP's gate and up). y and dx are bf16 on cuda, f32 on the CPU.
// Tests: tests/test_fp8_linear.cpp.
#pragma once
#include <cstdint>
#include <string>

#include "engine/autograd.h"
#include "engine/ops/quantize.h"
#include "kernels/fp8.h"

namespace flowmoe {

// The one check of a width an FP8 GEMM takes (a linear's, an expert's, a config key's): "" where n is a multiple of
// the 128-wide FP8 blocks (kernels/fp8.h), else the message every caller gives after the width's name:
// "<n> is not a multiple of 128, which <user> needs: it runs <gemms> on FP8 blocks 128 wide".
std::string fp8_width_error(int64_t n, const std::string& user, const std::string& gemms);

// Throws ShapeError naming `what` unless out_features N and in_features K are multiples of the 128-wide FP8
// blocks (fp8_width_error): what every FP8 linear, and a layer building one, checks.
void check_fp8_linear_dims(int64_t out_features, int64_t in_features, const std::string& what);

// w [N, K] (f32 or bf16) as one group [1, N, K] in 128x128 blocks with its exact transpose (with_transpose), the
// form fp8_linear takes. Counts one CastKind::weight_quantize at `site`.
QuantizedWeight quantize_linear_weight(const Tensor& w, const std::string& site, bool with_transpose = true);

// y [M, N] = xq · weightᵀ. xq: e4m3 [M, K] with rowwise_1x128 scales, M a multiple of kFp8RowMultiple
// (0 allowed); weight: the f32 master [N, K] (it receives dW in f32); wq = quantize_linear_weight(weight) for
// this parameter version. A gradient arriving at y in bf16/f32 is quantized rowwise once, at
// "<site>.dgrad: dy rowwise"; an FP8 rowwise one is used as it is. `site` names the linear ("attention.q_proj").
Variable fp8_linear(const Variable& xq, const Variable& weight, const QuantizedWeight& wq, const std::string& site);

}  // namespace flowmoe
