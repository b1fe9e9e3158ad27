// Expert-parallel dispatch and combine as autograd ops: the seams where an MoE layer's tokens leave
// for the ranks that own their experts and come back (DESIGN.md §2).
//   dispatch: tokens [T,H] (FP8 with 1x128 scales in fp8_flow), topk_idx [T,k], topk_prob [T,k]
//             -> the rows, routes and probs this rank's experts work on
//   combine:  y [T,H] (the unpermuted expert outputs) -> y on the tokens' own rank
// Each op's backward is the other one: d_tokens = combine(d_rows), d_y = dispatch(dy). combine's
// backward sends dy as FP8 when asked (fp8_flow): it is quantized once, here, and the FP8 rows reach
// fc2's dgrad without another cast. At expert-parallel size 1 both pass their tensors through: no
// copy, no kernel; only fp8_flow's gradient quantize runs. Tests: tests/test_dispatch.cpp.
#pragma once
#include "engine/autograd.h"

namespace flowmoe {

// What dispatch hands to permute+pad: the rows this rank's experts receive and their routes.
struct Dispatched {
  Variable tokens;             // [T', H], the dtype sent (FP8 with rowwise 1x128 scales, or bf16/f32)
  Tensor topk_idx;             // [T', k] i32 global expert ids
  Variable topk_prob;          // [T', k] (undefined when none were given)
  int expert_offset = 0;       // the first expert this rank owns
  int num_local_experts = -1;  // -1: all of them
};

// tokens [T,H] any dtype; topk_idx [T,k] i32 in [0, num_experts); topk_prob [T,k] or undefined.
Dispatched dispatch(const Variable& tokens, const Tensor& topk_idx, const Variable& topk_prob, int num_experts);

// The format of combine's backward: the gradient as it comes, or quantized once to FP8 (rowwise
// 1x128, counted as one cast at "combine backward: dy").
enum class CombineGrad { as_is, fp8 };

// y [T',H] -> [T,H] on the rank of each token; `from` is the dispatch it answers.
Variable combine(const Variable& y, const Dispatched& from, CombineGrad grad);

}  // namespace flowmoe
