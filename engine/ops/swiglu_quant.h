// Fused SwiGLU (x prob) + rowwise 1x128 FP8 quantize as an autograd op (DESIGN.md §2: the fp8_flow's
// fc1 -> fc2 hand-off). Math and layouts: kernels/swiglu_quant.h. Kernels: kernels/cpu/swiglu_quant.cpp,
// kernels/cuda/swiglu_quant.cu. Tests: tests/test_swiglu_quant.cpp.
#pragma once
#include "engine/autograd.h"

namespace flowmoe {

// h [M,2F] = [gate | up] (bf16 on cuda; f32 on cpu; f32/bf16 accepted on both), prob [M] f32 or undefined.
// Returns a = silu(gate) * up * prob as FP8 e4m3 [M,F] with its rowwise_1x128 scale_inv [M, ceil(F/128)]
// attached. Its gradient d_a (bf16 or f32, whatever arrives) gives d_h [M,2F] as FP8 with rowwise scales
// attached when quantize_grad (the fp8_flow feeds it straight to fc1's dgrad), else d_h in h's dtype;
// and d_prob [M] f32. A fused producer of FP8, not a cast: it does not call note_cast.
// row_counts: as swiglu's (engine/ops/ops.h), the rows past the counts' sum are left unwritten.
Variable swiglu_quant(const Variable& h, const Variable& prob, bool quantize_grad, const Tensor& row_counts = Tensor());

}  // namespace flowmoe
