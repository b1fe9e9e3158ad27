// MoE permute + pad as an autograd op (layout: kernels/permute.h, DESIGN.md §4).
//
// permute_pad moves the rows of x [T,H] into an expert-major buffer [num_rows, H]: local expert e
// gets rows [segment_starts[e], segment_starts[e+1]), its tokens in ascending token order, then zero
// pad rows up to a multiple of align_size. Every count stays on x's device: nothing here reads them
// back to the host. num_rows = -1 sizes the buffer for the worst case (permute_worst_case_rows);
// a caller that already holds the counts may pass the exact padded total instead.
// Gradients: d_x[t] = sum_j d_rows[row_map[t,j]]; d_topk_prob[t,j] = d_probs[row_map[t,j]].
// Kernels: kernels/cpu/permute.cpp, kernels/cuda/permute.cu. Tests: tests/test_permute.cpp.
#pragma once
#include "engine/autograd.h"
#include "kernels/permute.h"

namespace flowmoe {

struct PermuteResult {
  Variable rows;             // [num_rows, H], x's dtype; pad and tail rows zero
  Variable probs;            // [num_rows], topk_prob moved with the rows, 0 on pad rows (undefined without topk_prob)
  Tensor row_map;            // [T,k] i32: destination row of each (token, slot); -1: not this rank's expert
  Tensor tokens_per_expert;  // [L] i32
  Tensor padded_tokens_per_expert;  // [L] i32
  Tensor segment_starts;            // [L+1] i32: exclusive scan of the padded counts
  Tensor side_rows;                 // [num_rows, S] f32 when a side payload was given (pad rows side_pad_value)
  int align_size = 16;
  RoutingDims dims;  // the routing it was built with (permute_rows_like reuses it)
};

// x [T,H]: any dtype (rows move as bytes; gradients need f32/f64 on cpu, f32/bf16 on cuda).
// topk_idx [T,k] i32 holds global expert ids in [0, num_experts); this rank owns
// [expert_offset, expert_offset + num_local_experts) (-1: all of them). topk_prob [T,k]: f32 or f64
// on cpu, f32 on cuda; may be undefined. side [T,S] f32: an optional per-row payload moved with the
// rows (FP8 scale_inv); its pad rows hold side_pad_value. It gets no gradient.
// An FP8 x with rowwise 1x128 scales attached moves its scales with the rows (as the side payload, pad
// rows scale_inv 1 over zero data), and `rows` comes back with the permuted scales attached: the FP8
// data is never dequantized (DESIGN.md §2). Its gradient d_x is in d_rows' dtype.
PermuteResult permute_pad(const Variable& x, const Tensor& topk_idx, const Variable& topk_prob, int num_experts,
                          int align_size, int expert_offset = 0, int num_local_experts = -1, int64_t num_rows = -1,
                          const Tensor& side = Tensor(), double side_pad_value = 0.0);

// Moves the rows of another [T, H'] tensor with the routing of an earlier permute_pad (no gradient):
// out[row_map[t,j]] = x[t], pad and tail rows zero. An FP8 x with rowwise scales moves its scales too
// (pad rows scale_inv 1). The fp8_flow backward uses it to dispatch the once-quantized output gradient.
Tensor permute_rows_like(const Tensor& x, const PermuteResult& routing);

}  // namespace flowmoe
