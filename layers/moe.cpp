#include "layers/moe.h"

#include <utility>

#include "engine/comm_lane.h"
#include "engine/ops/fp8_grouped_linear.h"
#include "engine/ops/fp8_linear.h"
#include "engine/ops/grouped_linear.h"
#include "engine/ops/quantize.h"
#include "engine/ops/swiglu_quant.h"
#include "engine/side_stream.h"

namespace flowmoe {

namespace {

// Input: [y]. Output: y. Its vjp quantizes dy once (rowwise 1x128): the fp8_flow cast "combine backward: dy".
class CombineGradToFp8 : public Primitive {
 public:
  const char* name() const override { return "combine"; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override { return in; }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return in; }
  bool saves_inputs() const override { return false; }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    if (!needs[0]) return {Tensor()};
    return {quantize_rowwise_tensor(d_out[0], "combine backward: dy")};
  }
};

}  // namespace

Variable combine_grad_to_fp8(const Variable& y) { return apply(std::make_shared<CombineGradToFp8>(), {y})[0]; }

MoeRecipe moe_recipe_from_name(const std::string& name) {
  return parse_enum(kMoeRecipeNames, name, "precision.recipe");
}

const char* moe_recipe_name(MoeRecipe r) { return enum_name(kMoeRecipeNames, r); }

MoeFlow moe_flow(MoeRecipe r) {
  MoeFlow f;
  const bool flow = r == MoeRecipe::fp8_flow || r == MoeRecipe::fp8_full;  // fp8_full's experts are fp8_flow's
  f.fp8_experts = r != MoeRecipe::bf16;
  f.quantize_once = f.probs_in_experts = flow;
  f.wgrad = flow ? Fp8Wgrad::transpose : Fp8Wgrad::requantize;
  f.fp8_linears = r == MoeRecipe::fp8_full;
  return f;
}

RouterConfig router_config(const ModelConfig& cfg) {
  RouterConfig r;
  r.num_experts = int(cfg.n_routed_experts);
  r.top_k = int(cfg.num_experts_per_tok);
  r.n_group = int(cfg.n_group);
  r.topk_group = int(cfg.topk_group);
  r.scoring_func = cfg.scoring_func;
  r.norm_topk_prob = cfg.norm_topk_prob;
  r.routed_scaling_factor = cfg.routed_scaling_factor;
  r.aux_loss_alpha = cfg.aux_loss_alpha;
  return r;
}

MoeLayer::MoeLayer(ParamFactory& f, const ModelConfig& cfg, const std::string& prefix, const MoeOptions& options,
                   Device device)
    : router_(router_config(cfg)),
      num_experts_(cfg.n_routed_experts),
      intermediate_(cfg.moe_intermediate_size),
      options_(options),
      flow_(moe_flow(options.recipe)),
      bias_update_rate_(cfg.bias_update_rate),
      bias_update_rule_(bias_update_rule_from_name(cfg.bias_update_rule)) {
  validate_router_config(router_);
  const int64_t H = cfg.hidden_size, F = cfg.moe_intermediate_size, E = cfg.n_routed_experts;
  if (options.recipe != MoeRecipe::bf16)
    for (const auto& [name, n] : {std::pair<const char*, int64_t>{"hidden_size", H}, {"moe_intermediate_size", F}}) {
      const std::string e = fp8_width_error(n, std::string("the ") + moe_recipe_name(options.recipe) + " recipe",
                                            "the routed experts' GEMMs");
      FLOWMOE_CHECK(e.empty(), ShapeError, prefix, ": ", name, " ", e);
    }
  const Communicator* ep = options.expert_parallel.get();
  const int64_t ep_size = ep ? ep->size() : 1;
  FLOWMOE_CHECK(E % ep_size == 0, ConfigError, prefix, ": n_routed_experts (", E,
                ") must be a multiple of the expert-parallel size (", ep_size, ")");
  num_local_experts_ = E / ep_size;
  expert_offset_ = ep ? ep->rank() * num_local_experts_ : 0;
  // Collective where auto asks the group whether its GPUs reach each other's memory: every rank builds
  // its layers in the same order.
  zero_sync_ = ep_size > 1 && resolve_ep_dispatch(options.ep_dispatch, options.expert_parallel.get());
  FLOWMOE_CHECK(options.exchange_chunks >= 1, ConfigError, "parallel.exchange_chunks: ", options.exchange_chunks,
                " must be at least 1");
  // Chunks overlap a zero-sync exchange; a sync one reads counts to the host per chunk, which would stall the
  // stream the overlap needs, and one rank exchanges nothing.
  num_chunks_ = zero_sync_ ? options.exchange_chunks : 1;
  const double out_std = output_init_std(cfg);
  gate_ = f.normal(prefix + ".gate.weight", {E, H}, cfg.initializer_range);
  fc1_ = f.expert_normal(prefix + ".experts.fc1.weight", {E, 2 * F, H}, cfg.initializer_range, expert_offset_,
                         num_local_experts_);
  fc2_ = f.expert_normal(prefix + ".experts.fc2.weight", {E, H, F}, out_std, expert_offset_, num_local_experts_);
  f.read_in_f32(gate_);     // the router runs in f32
  if (flow_.fp8_experts) {  // quantized from the f32 values
    f.read_in_fp8(fc1_, fc1_fp8_);
    f.read_in_fp8(fc2_, fc2_fp8_);
  }
  if (cfg.n_shared_experts > 0)
    shared_ = std::make_unique<Mlp>(f, prefix + ".shared_experts", H, F * cfg.n_shared_experts, cfg.initializer_range,
                                    out_std, flow_.fp8_linears);
  expert_bias_ = Variable(Tensor::zeros({E}, DType::f32, device), false, prefix + ".gate.e_score_correction_bias");
  tokens_since_update_ = Tensor::zeros({E}, DType::i32, device);
}

// Forward, top-down (DESIGN.md §2). The recipe is read once, into flow_ (moe_flow).
//
// Backward, in order (each step is the vjp of the op named, in the file named; the walk takes the forward's
// reverse, except that the shared experts and chunked exchanges go as soon as they are ready):
//   6. + shared experts  engine/ops/elementwise.cpp  Binary::vjp: dy to both branches
//   0. shared experts    layers/mlp.cpp (linear, swiglu vjps), on the side stream with shared_expert_overlap,
//                        issued first and running beside 5 to 1; their dx joins the router's at x
//   5. combine           layers/moe.cpp              CombineGradToFp8::vjp (fp8_flow): dy quantized once;
//                        engine/ops/unpermute.cpp    UnpermuteUnpad::vjp: d_rows = prob·dy and
//                                                    d_prob = rows·dy; fp8_flow: FP8 dy rows moved;
//                        parallel/exchange.cpp       Exchange::vjp (several ranks): d_rows to the experts
//   4. experts: fc2      engine/ops/fp8_grouped_linear.cpp (grouped_linear.cpp) ::vjp: dgrad, wgrad
//               (recompute: checkpoint re-runs fc1 → SwiGLU first, engine/autograd.cpp)
//               SwiGLU   engine/ops/swiglu_quant.cpp SwigluQuant::vjp (fp8_flow, also d_prob) or
//                        engine/ops/swiglu.cpp Swiglu::vjp
//               fc1      engine/ops/fp8_grouped_linear.cpp (grouped_linear.cpp) ::vjp
//   3. dispatch          parallel/exchange.cpp       Exchange::vjp (several ranks): d_rows, d_probs home
//                        engine/ops/permute.cpp      PermutePad::vjp: d_x[t] = Σ_j d_rows[row_map[t,j]]
//   2. quantize          engine/ops/quantize.cpp     QuantizeRowwise::vjp: straight through, into x
//   1. router            engine/ops/router.cpp       RouterTopk::vjp: through the normalized
//                                                    sigmoid scores into the gate weight and x (ready
//                                                    once dispatch has returned d_probs)
// With exchange_chunks, 5 to 3 run per chunk, the last chunk first; each chunk's exchanges are issued as
// soon as they are ready, so they travel beside the other chunk's experts (routed_in_chunks).
// (tests/test_moe_fp8.cpp checks this order against the ops the backward runs.)
// The backward reads nothing to the host: the GEMMs and exchanges reuse the forward's counts.
// The steps below run in begin (0-3, prepare holding 0-2), run_experts (4 and the rows' return) and finish (5-6).
Variable MoeLayer::forward(const Variable& x, DType compute, const Variable& xq) const {
  if (num_chunks_ > 1 && grad_enabled()) return forward_in_chunks(x, compute, xq);
  Pending p = begin(x, compute, xq);
  run_experts(p);
  return finish(p);
}

// Steps 0-2: what every token goes through before the routed experts.
MoeLayer::Pending MoeLayer::prepare(const Variable& x, DType compute, const Variable& x_quantized) const {
  Pending p;
  p.in_shape = x.shape();
  Variable x2 = reshape(x, {-1, p.in_shape.back()});  // [T, H]

  // fp8_full quantizes x (step 2) first: the shared experts' FP8 GEMMs read the same xq as the dispatch, one
  // cast for both. In a transformer block the norm before this layer has quantized it already (x_quantized).
  FLOWMOE_CHECK(!x_quantized.defined() || flow_.fp8_linears, Error, "moe: a quantized input is for fp8_full, not ",
                moe_recipe_name(options_.recipe));
  Variable xq = x_quantized;
  if (flow_.fp8_linears && !xq.defined()) xq = quantize_rowwise(x2, input_site());

  // 0. The shared experts, a dense SwiGLU MLP on every token (summed in at 6). They wait for nothing the
  //    routed path makes, so with shared_expert_overlap they run on a side stream beside steps 1-5, and
  //    so do their backward's ops (engine/side_stream.h); issued first, so that a sync dispatch's host
  //    read does not hold them back.
  if (shared_) {
    SideBranch side(x2.device(), options_.shared_expert_overlap);
    p.shared_y = shared_->forward(xq.defined() ? xq : x2, compute);
  }

  // 1. Router, in fp32 as DeepSeek-V3 does: the top-k choice is sensitive to rounding.
  RouterOutput r = route_tokens(x2, p.in_shape);
  p.aux_loss = r.aux_loss;
  p.topk_idx = r.topk_idx;
  p.topk_prob = r.topk_prob;
  if (x2.device().is_cpu() && p.topk_prob.dtype() != x2.dtype()) p.topk_prob = cast(p.topk_prob, x2.dtype());

  // 2. Quantize once (fp8_flow): x becomes e4m3 with 1x128 scales, and stays FP8 until fc1.
  if (xq.defined())
    p.tokens = xq;
  else
    p.tokens = flow_.quantize_once ? quantize_rowwise(x2, input_site()) : x2;
  return p;
}

MoeLayer::Pending MoeLayer::begin(const Variable& x, DType compute, const Variable& xq) const {
  Pending p = prepare(x, compute, xq);
  dispatch_routed(p, p.tokens.size(0));
  return p;
}

// Step 3 of p's tokens, whose buffers are sized for tokens_per_rank tokens.
void MoeLayer::dispatch_routed(Pending& p, int64_t tokens_per_rank) const {
  // 3. Dispatch: each routed copy goes to the rank that owns its expert, into that rank's expert-major
  //    buffer padded to align_size (permute+pad; across ranks, an exchange straight into place).
  //    fp8_flow moves the probs with the rows (SwiGLU applies them); the other recipes apply them at
  //    combine, in fp32. On one GPU and with zero_sync the counts stay on the device and nothing reads
  //    them: the expert GEMMs run in one launch each on the device counts, and in the FP8 recipes the
  //    wgrad operands' colwise layouts (transpose or re-quantize) follow the same counts into worst-case
  //    sized scales. A sync exchange reads them to the host once, sizing the transfers and the GEMMs.
  //    With exchange_chunks, steps 3-5 run per token chunk, their exchanges beside the compute (routed_in_chunks).
  p.d = dispatch(p.tokens, p.topk_idx, flow_.probs_in_experts ? p.topk_prob : Variable(),
                 dispatch_options(tokens_per_rank));
  p.arrived = comm_lane_last_ticket(p.tokens.device());
}

void MoeLayer::run_experts(Pending& p) const {
  // 4. The experts: fc1 → SwiGLU (+ quantize) → fc2, on the counts dispatch left where they read them.
  const Device device = p.d.rows.device();
  comm_lane_wait(device, p.arrived);
  Variable out_rows = experts(p.d.rows, p.d.probs, p.d.counts);

  // 5. Combine: the rows return to their tokens' rank (issued here, so that it travels beside what the
  //    caller runs next), then each token sums its k expert rows (× prob unless SwiGLU applied it):
  //    unpermute+unpad, in finish.
  p.returned = combine_return(out_rows, p.d);
  p.back = comm_lane_last_ticket(device);
}

Variable MoeLayer::finish(Pending& p) const { return add_shared(p, unpermute_routed(p)); }

// Step 5's unpermute+unpad of p's returned rows, once they are back: y [T, H].
Variable MoeLayer::unpermute_routed(Pending& p) const {
  comm_lane_wait(p.returned.device(), p.back);
  Variable y = combine_unpermute(p.returned, p.d, flow_.probs_in_experts ? Variable() : p.topk_prob);
  return flow_.quantize_once ? combine_grad_to_fp8(y) : y;
}

// 6. y [T, H] + the shared experts' output, once the side stream has finished it.
Variable MoeLayer::add_shared(const Pending& p, Variable y) const {
  if (shared_) {
    join_side_branch(y.device());
    y = add(y, p.shared_y);
  }
  return reshape(y, p.in_shape);
}

// forward with exchange_chunks: steps 0-2 and 6 as above, steps 3-5 per token chunk.
Variable MoeLayer::forward_in_chunks(const Variable& x, DType compute, const Variable& xq) const {
  Pending p = prepare(x, compute, xq);
  return add_shared(p, routed_in_chunks(p));
}

// Steps 3-5 over token chunks (parallel.exchange_chunks), issued so that each exchange, on the comm lane
// (engine/comm_lane.h), has another chunk's work beside it on the compute stream:
//   every chunk permuted and dispatched    (chunk c's rows travel while c+1 is permuted)
//   per chunk: its rows waited for, experts, rows returned (c's return travels beside c+1's experts)
//   every return waited for; each chunk unpermuted; the chunks stacked.
// The backward walk runs each exchange's vjp as soon as it is ready (backward_first) and waits for it only
// where its gradient is read, so the same overlap holds there. Every rank's chunks have ceil(T / C) tokens
// for its buffers (training batches have one shape on every rank).
Variable MoeLayer::routed_in_chunks(const Pending& whole) const {
  const std::vector<int64_t> bounds = even_row_bounds(whole.tokens.size(0), num_chunks_);
  CommLaneScope lane(true, options_.exchange_comm_stream);
  const std::vector<Variable> chunk_tokens = split_rows(whole.tokens, bounds);
  const std::vector<Variable> chunk_probs = split_rows(whole.topk_prob, bounds);
  std::vector<Pending> chunks(static_cast<size_t>(num_chunks_));
  for (size_t c = 0; c < chunks.size(); ++c) {
    chunks[c].tokens = chunk_tokens[c];
    chunks[c].topk_idx = whole.topk_idx.slice(0, bounds[c], bounds[c + 1]);
    chunks[c].topk_prob = chunk_probs[c];
    dispatch_routed(chunks[c], bounds[1]);
  }
  for (Pending& c : chunks) run_experts(c);
  comm_lane_join(whole.tokens.device());
  std::vector<Variable> y;
  for (Pending& c : chunks) y.push_back(unpermute_routed(c));
  return concat_rows(y);
}

RouterOutput MoeLayer::route_tokens(const Variable& x2, const Shape& in_shape) const {
  RouterConfig rc = router_;
  if (in_shape.size() == 3) rc.seq_len = int(in_shape[1]);
  Variable x_router = x2.dtype() == DType::f32 ? x2 : cast(x2, DType::f32);
  RouterOutput r = route(x_router, gate_, expert_bias_.data(), rc);
  // Only training forwards steer the bias: an evaluation (no grad) must not, or a run resumed past
  // one would move its biases differently from the run that did not stop.
  if (grad_enabled()) add_tokens_per_expert(tokens_since_update_, r.tokens_per_expert);
  aux_loss_ = r.aux_loss;
  return r;
}

// fc1 → SwiGLU → fc2 over the permuted rows. fc1 and SwiGLU (the part recompute re-runs) go through
// one function so the recomputed and the original forward are the same code.
Variable MoeLayer::experts(const Variable& rows, const Variable& probs, const ExpertCounts& dispatched) const {
  const MoeFlow flow = flow_;
  // Every reader of these rows takes the counts or the routing: the GEMMs, SwiGLU over the counts, the
  // exchange's tables or unpermute, and their backwards. So the GEMMs leave a worst-case buffer's tail
  // (most of a zero-sync one) unwritten instead of zeroing it.
  ExpertCounts counts = dispatched;
  counts.tail_unread = counts.on_device();
  const QuantizedWeight* w1q = flow.fp8_experts ? &fc1_fp8_.get(fc1_) : nullptr;
  auto fc1_swiglu = [this, flow, w1q, counts](const std::vector<Variable>& in) -> std::vector<Variable> {
    // With device counts SwiGLU computes only the rows they cover: a zero-sync buffer's tail is most of it.
    if (!flow.fp8_experts) return {swiglu(grouped_linear(in[0], fc1_, counts), counts.device)};
    // fp8_flow: the rows arrive FP8, and SwiGLU applies the probs and emits FP8 for fc2 in one kernel.
    // fp8_blockwise: each GEMM quantizes its own input.
    Variable xq = flow.quantize_once ? in[0] : quantize_rowwise(in[0], "fc1.fprop: x");
    Variable h = fp8_grouped_linear(xq, fc1_, *w1q, counts, flow.wgrad, "fc1");
    if (flow.quantize_once) return {swiglu_quant(h, in[1], /*quantize_grad=*/true, counts.device)};
    return {quantize_rowwise(swiglu(h, counts.device), "fc2.fprop: x")};
  };
  std::vector<Variable> in = {rows};
  if (flow.probs_in_experts) in.push_back(probs);
  Variable a = options_.recompute_expert ? checkpoint(fc1_swiglu, in)[0] : fc1_swiglu(in)[0];
  if (!flow.fp8_experts) return grouped_linear(a, fc2_, counts);
  return fp8_grouped_linear(a, fc2_, fc2_fp8_.get(fc2_), counts, flow.wgrad, "fc2");
}

// What a permuted buffer's rows round up to: the FP8 GEMMs' row multiple where the experts run in FP8.
static int moe_row_multiple(MoeRecipe recipe) { return moe_flow(recipe).fp8_experts ? kFp8RowMultiple : 1; }

int64_t moe_permuted_rows(int64_t num_tokens, int top_k, int num_experts, int align_size, MoeRecipe recipe) {
  const int64_t worst = permute_worst_case_rows(num_tokens, top_k, num_experts, align_size);
  const int64_t m = moe_row_multiple(recipe);
  return (worst + m - 1) / m * m;
}

DispatchOptions MoeLayer::dispatch_options(int64_t num_tokens) const {
  DispatchOptions o;
  o.num_experts = int(num_experts_);
  o.align_size = options_.align_size;
  o.num_rows = moe_permuted_rows(num_tokens, router_.top_k, int(num_experts_), options_.align_size, options_.recipe);
  o.row_multiple = moe_row_multiple(options_.recipe);  // as moe_permuted_rows rounds the one-rank buffer
  o.fp8_experts = flow_.fp8_experts;
  o.device_counts = options_.device_counts;
  if (options_.expert_parallel && options_.expert_parallel->size() > 1) {
    o.expert_parallel = options_.expert_parallel;
    // Training batches have the same shape on every rank, as the worst-case buffers need; an
    // evaluation may give a rank fewer (or no) tokens, so it takes the sync path (the same on all ranks).
    o.zero_sync = grad_enabled() && zero_sync_;
    o.tokens_per_rank = num_tokens;
    o.capacity_factor = options_.ep_capacity_factor;
    o.min_receive_rows = options_.exchange_min_rows;
    o.most_needed = options_.exchange_overflow;
  }
  return o;
}

Tensor MoeLayer::update_bias(const StepScalars* control) {
  Tensor bias = expert_bias_.data();  // shares storage: the kernel updates the buffer in place
  update_expert_bias(bias, tokens_since_update_, bias_update_rate_, bias_update_rule_, control);
  // A copy for the metrics to read a step later; the counts restart in place, so a captured step
  // (CUDA graph) that replays these kernels finds them at the same address.
  Tensor loads = tokens_since_update_.clone();
  tokens_since_update_.zero_();
  return loads;
}

}  // namespace flowmoe
