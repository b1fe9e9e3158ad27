// MoE unpermute + unpad with merging probs as an autograd op (math: kernels/unpermute.h).
//
//   y[t] = sum over routed j of topk_prob[t,j] * rows[row_map[t,j]]   (fp32 accumulation; pad rows never read)
// Gradients: d_rows[row_map[t,j]] = topk_prob[t,j] * dy[t] (pad and tail rows 0), d_topk_prob[t,j] =
// rows[row_map[t,j]] . dy[t]. The routing tensors come from permute_pad (engine/ops/permute.h); the
// counts and segment starts let the backward kernel write the pad rows without a memset.
// Kernels: kernels/cpu/unpermute.cpp, kernels/cuda/unpermute.cu. Tests: tests/test_unpermute.cpp.
#pragma once
#include "engine/autograd.h"
#include "engine/ops/permute.h"

namespace flowmoe {

// rows [num_rows, H]: f32/f64 on cpu (topk_prob of the same dtype), f32/bf16 on cuda (topk_prob f32).
// topk_prob [T,k] is the router's (unpermuted) probability of each slot. Returns y [T,H] in rows' dtype.
Variable unpermute_unpad(const Variable& rows, const Tensor& row_map /*[T,k] i32*/,
                         const Tensor& tokens_per_expert /*[L] i32*/, const Tensor& segment_starts /*[L+1] i32*/,
                         int align_size, const Variable& topk_prob);
// The same, with the routing of a permute_pad call.
Variable unpermute_unpad(const Variable& rows, const PermuteResult& routing, const Variable& topk_prob);

// The fp8_flow combine (DESIGN.md §2): y[t] = sum_j rows[row_map[t,j]] with no probs (fp8_flow applies
// them in SwiGLU+quantize). Its backward is a dispatch of the gradient in FP8: dy [T,H] is quantized
// once (rowwise 1x128, one counted cast) and its rows and scales move with dispatch_rows, so d_rows
// arrives at fc2 as FP8 with scales attached (pad rows zero).
Variable unpermute_unpad_fp8_grad(const Variable& rows, const PermuteResult& routing);

}  // namespace flowmoe
