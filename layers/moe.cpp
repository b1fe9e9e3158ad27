#include "layers/moe.h"

#include <utility>

#include "engine/ops/fp8_grouped_linear.h"
#include "engine/ops/fp8_linear.h"
#include "engine/ops/grouped_linear.h"
#include "engine/ops/quantize.h"
#include "engine/ops/swiglu_quant.h"
#include "layers/moe_schedule.h"

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
      bias_update_rule_(cfg.bias_update_rule) {
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

// Forward, top-down (DESIGN.md §2): the math, stage by stage. The recipe is read once, into flow_ (moe_flow).
// How the stages are issued (the shared experts on the side stream, the exchanges on the comm lane, token chunks,
// two micro-batches interleaved) is layers/moe_schedule.cpp's, which calls the same stages.
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
// soon as they are ready, so they travel beside the other chunk's experts (layers/moe_schedule.cpp).
// (tests/test_moe_fp8.cpp checks this order against the ops the backward runs.)
// The backward reads nothing to the host: the GEMMs and exchanges reuse the forward's counts.
Variable MoeLayer::forward(const Variable& x, DType compute, const Variable& xq) const {
  const MoeSchedule schedule(*this);
  MoeTokens t = take_tokens(x, xq);
  Variable shared = schedule.shared_experts(t, compute);  // 0. shared experts
  route(t);                                               // 1. router
  quantize(t);                                            // 2. quantize once
  Variable y = schedule.dispatch_experts_combine(t);      // 3-5. dispatch → experts → combine
  return add_shared(t, y, shared);                        // 6. + shared experts
}

MoeTokens MoeLayer::take_tokens(const Variable& x, const Variable& x_quantized) const {
  MoeTokens t;
  t.in_shape = x.shape();
  t.x2 = reshape(x, {-1, t.in_shape.back()});  // [T, H]
  // fp8_full quantizes x (step 2) first: the shared experts' FP8 GEMMs read the same xq as the dispatch, one
  // cast for both. In a transformer block the norm before this layer has quantized it already (x_quantized).
  FLOWMOE_CHECK(!x_quantized.defined() || flow_.fp8_linears, Error, "moe: a quantized input is for fp8_full, not ",
                moe_recipe_name(options_.recipe));
  t.xq = x_quantized;
  if (flow_.fp8_linears && !t.xq.defined()) t.xq = quantize_rowwise(t.x2, input_site());
  return t;
}

// 0. The shared experts, a dense SwiGLU MLP on every token (summed in at 6). They wait for nothing the routed
//    path makes, so a schedule may run them beside steps 1-5.
Variable MoeLayer::shared_forward(const MoeTokens& t, DType compute) const {
  if (!shared_) return Variable();
  return shared_->forward(t.xq.defined() ? t.xq : t.x2, compute);
}

// 1. Router, in fp32 as DeepSeek-V3 does: the top-k choice is sensitive to rounding.
void MoeLayer::route(MoeTokens& t) const {
  RouterConfig rc = router_;
  if (t.in_shape.size() == 3) rc.seq_len = int(t.in_shape[1]);
  Variable x_router = t.x2.dtype() == DType::f32 ? t.x2 : cast(t.x2, DType::f32);
  RouterOutput r = flowmoe::route(x_router, gate_, expert_bias_.data(), rc);
  // Only training forwards steer the bias: an evaluation (no grad) must not, or a run resumed past
  // one would move its biases differently from the run that did not stop.
  if (grad_enabled()) add_tokens_per_expert(tokens_since_update_, r.tokens_per_expert);
  aux_loss_ = t.aux_loss = r.aux_loss;
  t.topk_idx = r.topk_idx;
  t.topk_prob = r.topk_prob;
  if (t.x2.device().is_cpu() && t.topk_prob.dtype() != t.x2.dtype()) t.topk_prob = cast(t.topk_prob, t.x2.dtype());
}

// 2. Quantize once (fp8_flow): x becomes e4m3 with 1x128 scales, and stays FP8 until fc1.
void MoeLayer::quantize(MoeTokens& t) const {
  if (t.xq.defined())
    t.tokens = t.xq;
  else
    t.tokens = flow_.quantize_once ? quantize_rowwise(t.x2, input_site()) : t.x2;
}

// 3. Dispatch: each routed copy goes to the rank that owns its expert, into that rank's expert-major
//    buffer padded to align_size (permute+pad; across ranks, an exchange straight into place).
//    fp8_flow moves the probs with the rows (SwiGLU applies them); the other recipes apply them at
//    combine, in fp32. On one GPU and with zero_sync the counts stay on the device and nothing reads
//    them: the expert GEMMs run in one launch each on the device counts, and in the FP8 recipes the
//    wgrad operands' colwise layouts (transpose or re-quantize) follow the same counts into worst-case
//    sized scales. A sync exchange reads them to the host once, sizing the transfers and the GEMMs.
//    The buffers are sized for tokens_per_rank tokens (a chunk's are the largest chunk's).
Dispatched MoeLayer::dispatch_tokens(const MoeTokens& t, int64_t tokens_per_rank) const {
  return dispatch(t.tokens, t.topk_idx, flow_.probs_in_experts ? t.topk_prob : Variable(),
                  dispatch_options(tokens_per_rank));
}

// 4. The experts: fc1 → SwiGLU (+ quantize) → fc2, on the counts dispatch left where they read them.
Variable MoeLayer::experts(const Dispatched& d) const { return experts(d.rows, d.probs, d.counts); }

// 5. Combine: the rows return to their tokens' rank, then each token sums its k expert rows (× prob unless
//    SwiGLU applied them): unpermute+unpad. fp8_flow quantizes the gradient once, at its start.
Variable MoeLayer::return_rows(const Variable& out_rows, const Dispatched& d) const {
  return combine_return(out_rows, d);
}

Variable MoeLayer::unpermute(const Variable& returned, const Dispatched& d, const MoeTokens& t) const {
  Variable y = combine_unpermute(returned, d, flow_.probs_in_experts ? Variable() : t.topk_prob);
  return flow_.quantize_once ? combine_grad_to_fp8(y) : y;
}

// 6. y [T, H] + the shared experts' output, back in x's shape.
Variable MoeLayer::add_shared(const MoeTokens& t, Variable y, const Variable& shared) const {
  if (shared.defined()) y = add(y, shared);
  return reshape(y, t.in_shape);
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
