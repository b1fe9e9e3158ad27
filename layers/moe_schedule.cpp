// The MoE layer's schedules (see layers/moe_schedule.h): the stream and comm lane bookkeeping around the
// layer's stages.
#include "layers/moe_schedule.h"

#include <vector>

#include "engine/ops/ops.h"
#include "engine/stream_lane.h"

namespace flowmoe {

namespace {

// 3 for p's tokens, whose buffers are sized for tokens_per_rank tokens; the lane's ticket kept for the wait.
void dispatch_routed(const MoeLayer& layer, MoeInFlight& p, int64_t tokens_per_rank) {
  p.d = layer.dispatch_tokens(p.t, tokens_per_rank);
  p.arrived = comm_lane_last_ticket(p.t.tokens.device());
}

// 5's unpermute+unpad of p's returned rows, once they are back: y [T, H].
Variable unpermute_routed(const MoeLayer& layer, MoeInFlight& p) {
  comm_lane_wait(p.returned.device(), p.back);
  return layer.unpermute(p.returned, p.d, p.t);
}

// Before 6: the compute stream waits for the side stream that ran the shared experts.
void join_shared_experts(const MoeLayer& layer, Device device) {
  if (layer.shared_experts()) join_side_branch(device);
}

}  // namespace

Variable MoeSchedule::shared_experts(const MoeTokens& t, DType compute) const {
  if (!layer_.shared_experts()) return Variable();
  LaneScope side(Lane::side, t.x2.device(), layer_.options().shared_expert_overlap);
  return layer_.shared_forward(t, compute);
}

Variable MoeSchedule::dispatch_experts_combine(const MoeTokens& t) const {
  Variable y;
  if (layer_.num_chunks() > 1 && grad_enabled()) {
    y = in_chunks(t);
  } else {
    MoeInFlight p;
    p.t = t;
    dispatch_routed(layer_, p, t.tokens.size(0));
    moe_run_experts(layer_, p);
    y = unpermute_routed(layer_, p);
  }
  join_shared_experts(layer_, y.device());
  return y;
}

// Steps 3-5 over token chunks (parallel.exchange_chunks), issued so that each exchange, on the comm lane
// (engine/stream_lane.h), has another chunk's work beside it on the compute stream:
//   every chunk permuted and dispatched    (chunk c's rows travel while c+1 is permuted)
//   per chunk: its rows waited for, experts, rows returned (c's return travels beside c+1's experts)
//   every return waited for; each chunk unpermuted; the chunks stacked.
// The backward walk runs each exchange's vjp as soon as it is ready (backward_first) and waits for it only
// where its gradient is read, so the same overlap holds there. Every rank's chunks have ceil(T / C) tokens
// for its buffers (training batches have one shape on every rank).
Variable MoeSchedule::in_chunks(const MoeTokens& whole) const {
  const std::vector<int64_t> bounds = even_row_bounds(whole.tokens.size(0), layer_.num_chunks());
  LaneScope lane(Lane::comm, whole.tokens.device(), layer_.options().exchange_comm_stream);
  const std::vector<Variable> chunk_tokens = split_rows(whole.tokens, bounds);
  const std::vector<Variable> chunk_probs = split_rows(whole.topk_prob, bounds);
  std::vector<MoeInFlight> chunks(static_cast<size_t>(layer_.num_chunks()));
  for (size_t c = 0; c < chunks.size(); ++c) {
    chunks[c].t.tokens = chunk_tokens[c];
    chunks[c].t.topk_idx = whole.topk_idx.slice(0, bounds[c], bounds[c + 1]);
    chunks[c].t.topk_prob = chunk_probs[c];
    dispatch_routed(layer_, chunks[c], bounds[1]);
  }
  for (MoeInFlight& c : chunks) moe_run_experts(layer_, c);
  comm_lane_join(whole.tokens.device());
  std::vector<Variable> y;
  for (MoeInFlight& c : chunks) y.push_back(unpermute_routed(layer_, c));
  return concat_rows(y);
}

MoeInFlight moe_begin(const MoeLayer& layer, const Variable& x, DType compute, const Variable& xq) {
  const MoeSchedule schedule(layer);
  MoeInFlight p;
  p.t = layer.take_tokens(x, xq);
  p.shared = schedule.shared_experts(p.t, compute);
  layer.route(p.t);
  layer.quantize(p.t);
  dispatch_routed(layer, p, p.t.tokens.size(0));
  return p;
}

void moe_run_experts(const MoeLayer& layer, MoeInFlight& p) {
  const Device device = p.d.rows.device();
  comm_lane_wait(device, p.arrived);
  Variable out_rows = layer.experts(p.d);
  // Issued here, so that the return travels beside what the caller runs next.
  p.returned = layer.return_rows(out_rows, p.d);
  p.back = comm_lane_last_ticket(device);
}

Variable moe_finish(const MoeLayer& layer, MoeInFlight& p) {
  Variable y = unpermute_routed(layer, p);
  join_shared_experts(layer, y.device());
  return layer.add_shared(p.t, y, p.shared);
}

}  // namespace flowmoe
