// How an MoE layer's forward stages (MoeLayer::take_tokens ... add_shared, layers/moe.h) are issued: on which
// stream each runs and in what order. The math is the layer's; the three schedules run the same stages, so
// where their sums agree they agree bit for bit:
//   at once:      the stages in order. With parallel.shared_expert_overlap the shared experts run on the side
//                 lane (engine/stream_lane.h) beside steps 1-5, forward and backward, joined before 6.
//   token chunks: parallel.exchange_chunks, training forwards over the zero-sync exchange: steps 3-5 per chunk,
//                 each chunk's exchanges on the comm lane (engine/stream_lane.h) beside another chunk's experts.
//   dual micro-batches: parallel.dual_microbatch (Transformer::losses): the forward in three parts, moe_begin
//                 (0-3), moe_run_experts (4, the rows' return issued) and moe_finish (5's unpermute, 6), so that
//                 the caller interleaves two micro-batches, one's exchanges beside the other's work.
// Tests: tests/mpi/test_exchange_chunks.cpp, tests/mpi/test_dual_microbatch.cpp, tests/test_side_stream.cpp.
#pragma once
#include <cstdint>

#include "layers/moe.h"

namespace flowmoe {

// The at-once and token-chunk schedules, which MoeLayer::forward issues its stages through.
class MoeSchedule {
 public:
  explicit MoeSchedule(const MoeLayer& layer) : layer_(layer) {}
  // 0. The shared experts: on the side stream with shared_expert_overlap, issued before the routed path so that
  // a sync dispatch's host read does not hold them back. Undefined without shared experts.
  Variable shared_experts(const MoeTokens& t, DType compute) const;
  // 3-5 for every token, at once or in token chunks (MoeLayer::num_chunks, training forwards); then the compute
  // stream waits for the shared experts' stream, as step 6 reads both. -> y [T, H].
  Variable dispatch_experts_combine(const MoeTokens& t) const;

 private:
  Variable in_chunks(const MoeTokens& whole) const;
  const MoeLayer& layer_;
};

// A dual micro-batch's forward between its parts: without token chunks, moe_finish(moe_run_experts(moe_begin(x)))
// runs the ops of MoeLayer::forward in the same order.
struct MoeInFlight {
  MoeTokens t;
  Variable shared, returned;
  Dispatched d;
  uint64_t arrived = 0, back = 0;  // comm lane tickets: the dispatch, the return
};
// Steps 0-3; the dispatch on the comm lane where a LaneScope of it is open.
MoeInFlight moe_begin(const MoeLayer& layer, const Variable& x /*[..., H]*/, DType compute,
                      const Variable& xq = Variable());
// Step 4 (after waiting for the rows), and issues the rows' return.
void moe_run_experts(const MoeLayer& layer, MoeInFlight& p);
// Waits for the return, then 5's unpermute and 6. -> [..., H].
Variable moe_finish(const MoeLayer& layer, MoeInFlight& p);

}  // namespace flowmoe
