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
// The same, with the routing of a permute_pad call. topk_prob may be undefined (fp8_flow applies the
// probs in SwiGLU+quantize); then the backward keeps only the routing, and takes dy in any dtype,
// FP8 with rowwise 1x128 scales included (fp8_flow: combine's backward quantized it once, and its
// rows and scales move with permute_rows_like, so d_rows reaches fc2 as FP8 with pad rows zero).
Variable unpermute_unpad(const Variable& rows, const PermuteResult& routing, const Variable& topk_prob);

}  // namespace flowmoe
