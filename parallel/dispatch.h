// Dispatch and combine: the seams where an MoE layer's routed token copies leave for the experts'
// ranks, in the experts' expert-major padded layout, and come back (DESIGN.md §2).
//   dispatch: tokens [T,H] (FP8 with 1x128 scales in fp8_flow), topk_idx [T,k], probs [T,k] (optional)
//             -> rows [R,H], probs [R]: this rank's L experts' copies, expert-major, padded to align_size
//   combine:  the experts' output rows [R,H] -> y [T,H] = Σ_j prob[t,j]·row(t,j) on the token's rank
// One rank (no expert-parallel group): dispatch is permute+pad and combine is unpermute+unpad.
// Several ranks: dispatch permutes by global expert, exchanges the counts and moves each (peer,
// expert) segment straight to its place in the owner's padded buffer (parallel/exchange.h); combine
// moves the rows back and unpermutes them where the tokens live.
// Backward: each op's backward is the other's forward. combine's backward can quantize dy once to
// FP8 (fp8_flow): its rows and scales then travel as FP8 all the way to fc2's dgrad.
// Host syncs: one per dispatch, to size the GEMMs (and, across ranks, the transfers); none in backward.
// Tests: tests/test_dispatch.cpp (one process), tests/mpi/test_exchange.cpp (under mpiexec).
#pragma once
#include <memory>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops/permute.h"
#include "parallel/exchange.h"

namespace flowmoe {

struct DispatchOptions {
  int num_experts = 0;    // E, over all ranks
  int align_size = 16;    // each expert's segment is a multiple of it (16, 32, 64 or 128)
  int64_t num_rows = -1;  // one rank: the buffer's rows (-1: the worst case, permute_worst_case_rows)
  int row_multiple = 1;   // several ranks: the received buffer's rows round up to it (FP8 GEMMs: 16)
  // One rank: read the counts to the host (one sync), or leave them on the device for GEMMs that read
  // them there (ExpertCounts, engine/ops/grouped_linear.h). Several ranks always read them.
  bool read_counts = true;
  // The expert-parallel group: rank r holds experts [r·L, (r+1)·L), L = E / size. Null: every expert
  // is here and nothing moves between ranks. (A group of one rank still exchanges, with itself.)
  std::shared_ptr<Communicator> expert_parallel;
};

struct Dispatched {
  Variable rows;   // [R, H] this rank's experts' copies in the tokens' dtype (FP8 keeps its scales attached)
  Variable probs;  // [R] the probs moved with the rows (0 on pad rows); undefined when none were given
  // [L] on the host: each expert GEMM's M. Empty when not read; on one rank the device copy is
  // routing.padded_tokens_per_expert.
  std::vector<int64_t> padded_tokens_per_expert;
  // [L] i32, the real copies: on the rows' device with one rank; on the host across ranks, where the
  // plan holds them (an upload would wait for the stream, a second host sync).
  Tensor tokens_per_expert;
  PermuteResult routing;                     // the permute+pad on the tokens' rank (combine undoes it)
  std::shared_ptr<const ExchangePlan> plan;  // several ranks: the segments; null on one rank
};

// tokens [T,H] any dtype; topk_idx [T,k] i32 in [0, E); probs [T,k] or undefined.
Dispatched dispatch(const Variable& tokens, const Tensor& topk_idx, const Variable& probs,
                    const DispatchOptions& options);

// The format of combine's backward: the gradient as it comes, or quantized once to FP8 (rowwise
// 1x128, counted as one cast at "combine backward: dy").
enum class CombineGrad { as_is, fp8 };

// rows [R,H] (the experts' outputs, in dispatch's layout) -> y [T,H]. topk_prob [T,k]: the merge
// weights, or undefined when the experts applied them (fp8_flow).
Variable combine(const Variable& rows, const Dispatched& from, const Variable& topk_prob, CombineGrad grad);

}  // namespace flowmoe
