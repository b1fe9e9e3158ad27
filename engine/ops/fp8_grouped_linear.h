// FP8 GroupedLinear as an autograd op: one block-scaled FP8 GEMM per local expert (DESIGN.md §4).
//
//   fprop  y[rows of e]  = xq[rows of e] · Wq[e]ᵀ        xq 1x128 rowwise, Wq 128x128
//   dgrad  dx[rows of e] = dyq[rows of e] · Wq[e]        dyq 1x128 rowwise, Wqᵀ the exact block transpose
//   wgrad  dW[e]         = dyᶜᵒˡ[e] · xᶜᵒˡ[e]ᵀ            both 1x128 along the tokens of expert e, fp32 out
// The wgrad operands come from the FP8 tensors already held, by the scaling-aware transpose
// (Fp8Wgrad::transpose, the fp8_flow recipe), or by dequantizing and re-quantizing them column-wise
// (Fp8Wgrad::requantize, the classic fp8_blockwise recipe; each is a counted cast, engine/cast_stats.h).
// x must already be FP8 (quantize it with quantize_rowwise first: that cast is the caller's to count).
// Kernels: kernels/fp8_grouped_linear.h, kernels/grouped_gemm_device.h. Tests: tests/test_fp8_grouped_linear.cpp,
// tests/test_moe_layer.cpp, tests/test_fp8_device_counts.cpp.
#pragma once
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops/grouped_linear.h"
#include "engine/ops/quantize.h"

namespace flowmoe {

enum class Fp8Wgrad { transpose, requantize };

// x [M_total, K] e4m3 with rowwise scales; weight [E, N, K] the f32 master (it receives dW in f32);
// wq = quantize_weight(weight) for this optimizer step. padded_tokens_per_expert: host counts (padded, as for
// grouped_linear), each a multiple of 16. y [M_total, N] is bf16 on cuda, f32 on cpu; tail rows zero.
// The gradient arriving at y may be FP8 rowwise (fp8_flow: used as is) or bf16/f32 (then quantized
// here, a counted cast). `site` names the layer in the cast counts ("fc1", "fc2").
Variable fp8_grouped_linear(const Variable& x, const Variable& weight, const QuantizedWeight& wq,
                            const std::vector<int64_t>& padded_tokens_per_expert, Fp8Wgrad wgrad,
                            const std::string& site);
// The same with either kind of counts (ExpertCounts). Device counts (i32 [E] on x's device, E <= 256):
// on a GPU the fprop, dgrad and wgrad GEMMs run in one launch each (kernels/grouped_gemm_device.h)
// instead of one cuBLASLt call per expert, and with no host counts beside them the wgrad operands'
// colwise layouts follow the device counts too (fp8_transpose / quantize_colwise_tensor over
// ExpertCounts): nothing in forward or backward reads the counts on the host. On the CPU a CPU i32
// tensor takes their place and the references read it. With both kinds, the colwise layouts follow
// the host counts (the same bytes, host-known shapes).
Variable fp8_grouped_linear(const Variable& x, const Variable& weight, const QuantizedWeight& wq,
                            const ExpertCounts& counts, Fp8Wgrad wgrad, const std::string& site);

}  // namespace flowmoe
