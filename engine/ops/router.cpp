// The MoE router as autograd primitives: RouterTopk (selection + probabilities + counts; vjp to the
// logits with the selection fixed) and RouterBalanceLoss (sequence-wise L_Bal), each with a backward
// primitive so the gradient kernels also run through eval() on the right device. Plus the bias update
// and load statistics. References: kernels/cpu/router.cpp. Tests: tests/test_router.cpp.
#include "engine/ops/router.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"
#include "kernels/router.h"

namespace flowmoe {

namespace {

RouterParams params_of(const RouterConfig& cfg) {
  RouterParams p;
  p.num_experts = cfg.num_experts;
  p.top_k = cfg.top_k;
  p.n_group = cfg.n_group;
  p.topk_group = cfg.topk_group;
  p.scoring = cfg.scoring_func;
  p.norm_topk_prob = cfg.norm_topk_prob;
  p.routed_scaling_factor = cfg.routed_scaling_factor;
  return p;
}

void check_logits(const Tensor& logits, const RouterParams& p, const char* what) {
  FLOWMOE_CHECK(logits.dim() == 2 && logits.size(1) == p.num_experts, ShapeError, what, ": logits must be [T, ",
                p.num_experts, "], got ", logits.describe());
  if (logits.device().is_cuda()) check_dtype(logits, {DType::f32}, what);
}

void check_topk_idx(const Tensor& topk_idx, const Tensor& logits, const RouterParams& p, const char* what) {
  check_dtype(topk_idx, {DType::i32}, what);
  check_same_device(topk_idx, logits, what);
  FLOWMOE_CHECK(topk_idx.dim() == 2 && topk_idx.size(0) == logits.size(0) && topk_idx.size(1) == p.top_k, ShapeError,
                what, ": topk_idx must be [", logits.size(0), ", ", p.top_k, "], got ", topk_idx.describe());
}

// Gradient of RouterTopk: inputs {logits, topk_idx, d_topk_prob} -> {d_logits}.
class RouterTopkBackward : public BackwardPrimitive {
 public:
  explicit RouterTopkBackward(RouterParams p) : p_(p) {}
  const char* name() const override { return "router_topk_backward"; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[0].contiguous(), idx = in[1].contiguous(), d_prob = in[2].to(in[0].dtype()).contiguous();
    Tensor d_logits = Tensor::empty(logits.shape(), logits.dtype(), logits.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        logits.dtype(), name(),
        router_topk_backward_cpu<scalar_t>(p_, logits.data<scalar_t>(), idx.data<int32_t>(), d_prob.data<scalar_t>(),
                                           logits.size(0), d_logits.data<scalar_t>()));
    return {d_logits};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[0].contiguous(), idx = in[1].contiguous(), d_prob = in[2].to(DType::f32).contiguous();
    check_logits(logits, p_, name());
    Tensor d_logits = Tensor::empty(logits.shape(), DType::f32, logits.device());
    router_topk_backward_cuda(p_, logits.data<float>(), idx.data<int32_t>(), d_prob.data<float>(), logits.size(0),
                              d_logits.data<float>(), current_stream(logits.device().index));
    return {d_logits};
  }

 private:
  RouterParams p_;
};

// inputs {logits [T,E], expert_bias [E] f32} -> {topk_idx [T,k] i32, topk_prob [T,k], tokens_per_expert [E] i32}.
class RouterTopk : public Primitive {
 public:
  explicit RouterTopk(RouterParams p) : p_(p) {}
  const char* name() const override { return "router_topk"; }
  bool saves_outputs() const override { return true; }  // the vjp needs topk_idx

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[0].contiguous(), bias = in[1].contiguous();
    check_args(logits, bias);
    auto [idx, prob, counts] = make_outputs(logits);
    FLOWMOE_DISPATCH_CPU_FLOAT(
        logits.dtype(), name(),
        router_topk_cpu<scalar_t>(p_, logits.data<scalar_t>(), bias.data<float>(), logits.size(0), idx.data<int32_t>(),
                                  prob.data<scalar_t>(), counts.data<int32_t>()));
    return {idx, prob, counts};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[0].contiguous(), bias = in[1].contiguous();
    check_args(logits, bias);
    auto [idx, prob, counts] = make_outputs(logits);
    router_topk_cuda(p_, logits.data<float>(), bias.data<float>(), logits.size(0), idx.data<int32_t>(),
                     prob.data<float>(), counts.data<int32_t>(), current_stream(logits.device().index));
    return {idx, prob, counts};
  }
  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>& out,
                          const std::vector<Tensor>& d_out, const std::vector<bool>& needs) override {
    if (!needs[0]) return {Tensor(), Tensor()};
    RouterTopkBackward back(p_);
    return {eval(back, {in[0], out[0], d_out[1]})[0], Tensor()};
  }

 private:
  RouterParams p_;

  void check_args(const Tensor& logits, const Tensor& bias) const {
    check_logits(logits, p_, name());
    check_dtype(bias, {DType::f32}, "router expert_bias");
    FLOWMOE_CHECK(bias.dim() == 1 && bias.size(0) == p_.num_experts, ShapeError, "router expert_bias must be [",
                  p_.num_experts, "], got ", bias.describe());
  }
  std::tuple<Tensor, Tensor, Tensor> make_outputs(const Tensor& logits) const {
    const int64_t T = logits.size(0);
    return {Tensor::empty({T, p_.top_k}, DType::i32, logits.device()),
            Tensor::empty({T, p_.top_k}, logits.dtype(), logits.device()),
            Tensor::empty({p_.num_experts}, DType::i32, logits.device())};
  }
};

// Gradient of RouterBalanceLoss: inputs {logits, topk_idx, d_loss {}} -> {d_logits}.
class RouterBalanceLossBackward : public BackwardPrimitive {
 public:
  RouterBalanceLossBackward(RouterParams p, int64_t seq_len, double alpha) : p_(p), seq_len_(seq_len), alpha_(alpha) {}
  const char* name() const override { return "router_balance_loss_backward"; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[0].contiguous(), idx = in[1].contiguous(), d_loss = in[2].to(in[0].dtype()).contiguous();
    Tensor d_logits = Tensor::zeros(logits.shape(), logits.dtype(), logits.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(logits.dtype(), name(),
                               router_balance_loss_backward_cpu<scalar_t>(
                                   p_, logits.data<scalar_t>(), idx.data<int32_t>(), logits.size(0), seq_len_, alpha_,
                                   d_loss.data<scalar_t>(), d_logits.data<scalar_t>()));
    return {d_logits};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[0].contiguous(), idx = in[1].contiguous(), d_loss = in[2].to(DType::f32).contiguous();
    check_logits(logits, p_, name());
    const int64_t T = logits.size(0), S = seq_len_ > 0 ? seq_len_ : T;
    Tensor d_logits = Tensor::empty(logits.shape(), DType::f32, logits.device());
    Tensor seq_counts = Tensor::empty({S > 0 ? T / S : 0, p_.num_experts}, DType::i32, logits.device());
    router_balance_loss_backward_cuda(p_, logits.data<float>(), idx.data<int32_t>(), T, seq_len_, alpha_,
                                      d_loss.data<float>(), seq_counts.data<int32_t>(), d_logits.data<float>(),
                                      current_stream(logits.device().index));
    return {d_logits};
  }

 private:
  RouterParams p_;
  int64_t seq_len_;
  double alpha_;
};

// inputs {logits [T,E], topk_idx [T,k] i32} -> {alpha * L_Bal, shape {}}.
class RouterBalanceLoss : public Primitive {
 public:
  RouterBalanceLoss(RouterParams p, int64_t seq_len, double alpha) : p_(p), seq_len_(seq_len), alpha_(alpha) {}
  const char* name() const override { return "router_balance_loss"; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[0].contiguous(), idx = in[1].contiguous();
    check_args(logits, idx);
    Tensor loss = Tensor::empty({}, logits.dtype(), logits.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        logits.dtype(), name(),
        router_balance_loss_cpu<scalar_t>(p_, logits.data<scalar_t>(), idx.data<int32_t>(), logits.size(0), seq_len_,
                                          alpha_, loss.data<scalar_t>()));
    return {loss};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Tensor logits = in[0].contiguous(), idx = in[1].contiguous();
    check_args(logits, idx);
    const int64_t T = logits.size(0), S = seq_len_ > 0 ? seq_len_ : T;
    Tensor loss = Tensor::empty({}, DType::f32, logits.device());
    Tensor seq_counts = Tensor::empty({S > 0 ? T / S : 0, p_.num_experts}, DType::i32, logits.device());
    Tensor token_loss = Tensor::empty({T}, DType::f32, logits.device());
    router_balance_loss_cuda(p_, logits.data<float>(), idx.data<int32_t>(), T, seq_len_, alpha_,
                             seq_counts.data<int32_t>(), token_loss.data<float>(), loss.data<float>(),
                             current_stream(logits.device().index));
    return {loss};
  }
  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    if (!needs[0]) return {Tensor(), Tensor()};
    RouterBalanceLossBackward back(p_, seq_len_, alpha_);
    return {eval(back, {in[0], in[1], d_out[0]})[0], Tensor()};
  }

 private:
  RouterParams p_;
  int64_t seq_len_;
  double alpha_;

  void check_args(const Tensor& logits, const Tensor& idx) const {
    check_logits(logits, p_, name());
    check_topk_idx(idx, logits, p_, name());
    const int64_t T = logits.size(0);
    FLOWMOE_CHECK(seq_len_ == 0 || T % seq_len_ == 0, ShapeError, name(), ": ", T,
                  " tokens are not whole sequences of seq_len ", seq_len_);
  }
};

void make_current(const Device& d) {  // the in-place updates run outside eval()
  if (cuda_current_device() != d.index) cuda_set_device(d.index);
}

void check_counts(const Tensor& counts, int64_t num_experts, const char* what) {
  check_dtype(counts, {DType::i32}, what);
  FLOWMOE_CHECK(counts.dim() == 1 && counts.size(0) == num_experts && counts.is_contiguous(), ShapeError, what,
                ": tokens_per_expert must be a contiguous [", num_experts, "], got ", counts.describe());
}

}  // namespace

RouterConfigError::RouterConfigError(std::vector<std::string> keys, const std::string& detail,
                                     const std::string& key_prefix, const char* file, int line)
    : ConfigError(keys.size() == 1 ? key_prefix + keys.front() + ": " + detail : detail, file, line),
      keys_(std::move(keys)),
      detail_(detail) {}

// Throws RouterConfigError for KEYS, a parenthesized list of HF key names, unless cond holds.
#define ROUTER_CHECK(cond, KEYS, ...)                                                                        \
  do {                                                                                                       \
    if (!(cond))                                                                                             \
      throw RouterConfigError(std::vector<std::string> KEYS, detail::cat(__VA_ARGS__), key_prefix, __FILE__, \
                              __LINE__);                                                                     \
  } while (0)

void validate_router_config(const RouterConfig& c, const std::string& key_prefix) {
  const std::string& p = key_prefix;
  const int E = c.num_experts;
  ROUTER_CHECK(E >= 1, ({"n_routed_experts"}), E, " must be at least 1");
  ROUTER_CHECK(c.top_k >= 1, ({"num_experts_per_tok"}), c.top_k, " must be at least 1");
  ROUTER_CHECK(c.n_group >= 1, ({"n_group"}), c.n_group, " must be at least 1");
  ROUTER_CHECK(c.topk_group >= 1, ({"topk_group"}), c.topk_group, " must be at least 1");
  ROUTER_CHECK(E % c.n_group == 0, ({"n_group"}), c.n_group, " does not divide ", p, "n_routed_experts = ", E);
  ROUTER_CHECK(c.topk_group <= c.n_group, ({"topk_group"}), c.topk_group, " exceeds ", p, "n_group = ", c.n_group);
  ROUTER_CHECK(c.top_k <= E, ({"num_experts_per_tok", "n_routed_experts"}), p, "num_experts_per_tok = ", c.top_k,
               " exceeds ", p, "n_routed_experts = ", E);
  ROUTER_CHECK(E <= kRouterMaxExperts, ({"n_routed_experts"}), E, " exceeds the router's limit of ", kRouterMaxExperts);
  ROUTER_CHECK(c.top_k <= kRouterMaxTopk, ({"num_experts_per_tok"}), c.top_k, " exceeds the router's limit of ",
               kRouterMaxTopk);
  ROUTER_CHECK(c.n_group <= kRouterMaxGroups, ({"n_group"}), c.n_group, " exceeds the router's limit of ",
               kRouterMaxGroups);
  // The groups divide the experts evenly here (checked above).
  ROUTER_CHECK(c.top_k <= c.topk_group * (E / c.n_group),
               ({"num_experts_per_tok", "topk_group", "n_group", "n_routed_experts"}),
               "num_experts_per_tok = ", c.top_k, " exceeds the experts in the kept groups (topk_group ", c.topk_group,
               " x ", E / c.n_group, " experts per group)");
  ROUTER_CHECK(std::isfinite(c.routed_scaling_factor) && c.routed_scaling_factor > 0, ({"routed_scaling_factor"}),
               c.routed_scaling_factor, " must be finite and > 0");
  ROUTER_CHECK(std::isfinite(c.aux_loss_alpha) && c.aux_loss_alpha >= 0, ({"aux_loss_alpha"}), c.aux_loss_alpha,
               " must be finite and >= 0");
  ROUTER_CHECK(c.seq_len >= 0, ({"seq_len"}), c.seq_len, " must be >= 0");
}

#undef ROUTER_CHECK

RouterOutput route(const Variable& x, const Variable& weight, const Tensor& expert_bias, const RouterConfig& cfg) {
  validate_router_config(cfg);
  FLOWMOE_CHECK(x.data().dim() == 2 || x.data().dim() == 3, ShapeError, "route: x must be [T, H] or [B, S, H], got ",
                x.data().describe());
  const int64_t H = x.size(-1);
  FLOWMOE_CHECK(weight.data().dim() == 2 && weight.size(0) == cfg.num_experts && weight.size(1) == H, ShapeError,
                "route: weight must be [", cfg.num_experts, ", ", H, "], got ", weight.data().describe());
  RouterConfig c = cfg;
  Variable tokens = x;
  if (x.data().dim() == 3) {
    if (c.seq_len == 0) c.seq_len = int(x.size(1));
    tokens = reshape(x, {x.size(0) * x.size(1), H});
  }
  return route_logits(linear(tokens, weight), expert_bias, c);
}

RouterOutput route_logits(const Variable& logits, const Tensor& expert_bias, const RouterConfig& cfg) {
  validate_router_config(cfg);
  const RouterParams p = params_of(cfg);
  Variable lg = logits.dtype() == DType::bf16 ? cast(logits, DType::f32) : logits;
  check_logits(lg.data(), p, "route");
  Tensor bias = expert_bias.defined() ? expert_bias : Tensor::zeros({cfg.num_experts}, DType::f32, lg.device());
  check_same_device(bias, lg.data(), "route (expert_bias vs logits)");
  std::vector<Variable> outs = apply(std::make_shared<RouterTopk>(p), {lg, Variable(bias)});
  RouterOutput r;
  r.topk_idx = outs[0].data();
  r.topk_prob = outs[1];
  r.tokens_per_expert = outs[2].data();
  if (cfg.aux_loss_alpha > 0) r.aux_loss = router_balance_loss(lg, r.topk_idx, cfg);
  return r;
}

Variable router_balance_loss(const Variable& logits, const Tensor& topk_idx, const RouterConfig& cfg) {
  validate_router_config(cfg);
  Variable lg = logits.dtype() == DType::bf16 ? cast(logits, DType::f32) : logits;
  auto prim = std::make_shared<RouterBalanceLoss>(params_of(cfg), cfg.seq_len, cfg.aux_loss_alpha);
  return apply(prim, {lg, Variable(topk_idx)})[0];
}

void update_expert_bias(Tensor& expert_bias, const Tensor& tokens_per_expert, double rate, BiasUpdateRule rule) {
  check_dtype(expert_bias, {DType::f32}, "update_expert_bias (expert_bias)");
  FLOWMOE_CHECK(expert_bias.dim() == 1 && expert_bias.is_contiguous(), ShapeError,
                "update_expert_bias: expert_bias must be a contiguous [E], got ", expert_bias.describe());
  const int64_t E = expert_bias.size(0);
  check_counts(tokens_per_expert, E, "update_expert_bias");
  check_same_device(expert_bias, tokens_per_expert, "update_expert_bias");
  FLOWMOE_CHECK(std::isfinite(rate) && rate >= 0, ConfigError, "bias_update_rate = ", rate, " must be finite and >= 0");
  if (expert_bias.device().is_cpu()) {
    expert_bias_update_cpu(expert_bias.data<float>(), tokens_per_expert.data<int32_t>(), int(E), rate, rule);
    return;
  }
  make_current(expert_bias.device());
  expert_bias_update_cuda(expert_bias.data<float>(), tokens_per_expert.data<int32_t>(), int(E), rate, rule,
                          current_stream(expert_bias.device().index));
}

void add_tokens_per_expert(Tensor& total, const Tensor& counts) {
  FLOWMOE_CHECK(total.dim() == 1, ShapeError, "add_tokens_per_expert: total must be [E], got ", total.describe());
  check_counts(total, total.size(0), "add_tokens_per_expert (total)");
  check_counts(counts, total.size(0), "add_tokens_per_expert (counts)");
  check_same_device(total, counts, "add_tokens_per_expert");
  const int E = int(total.size(0));
  if (total.device().is_cpu()) {
    add_tokens_per_expert_cpu(total.data<int32_t>(), counts.data<int32_t>(), E);
    return;
  }
  make_current(total.device());
  add_tokens_per_expert_cuda(total.data<int32_t>(), counts.data<int32_t>(), E, current_stream(total.device().index));
}

void update_expert_bias(Tensor& expert_bias, const Tensor& tokens_per_expert, double rate, BiasUpdateRule rule,
                        const StepScalars* control) {
  FLOWMOE_CHECK(control, Error, "update_expert_bias: null step scalars");
  if (expert_bias.device().is_cpu()) {
    update_expert_bias(expert_bias, tokens_per_expert, rate * control->bias_rate_scale, rule);
    return;
  }
  check_dtype(expert_bias, {DType::f32}, "update_expert_bias (expert_bias)");
  FLOWMOE_CHECK(expert_bias.dim() == 1 && expert_bias.is_contiguous(), ShapeError,
                "update_expert_bias: expert_bias must be a contiguous [E], got ", expert_bias.describe());
  check_counts(tokens_per_expert, expert_bias.size(0), "update_expert_bias");
  check_same_device(expert_bias, tokens_per_expert, "update_expert_bias");
  FLOWMOE_CHECK(std::isfinite(rate) && rate >= 0, ConfigError, "bias_update_rate = ", rate, " must be finite and >= 0");
  make_current(expert_bias.device());
  expert_bias_update_scheduled_cuda(expert_bias.data<float>(), tokens_per_expert.data<int32_t>(),
                                    int(expert_bias.size(0)), rate, rule, control,
                                    current_stream(expert_bias.device().index));
}

LoadStats load_stats(const Tensor& tokens_per_expert) {
  FLOWMOE_CHECK(tokens_per_expert.dim() == 1 && tokens_per_expert.size(0) > 0, ShapeError,
                "load_stats: tokens_per_expert must be a non-empty [E], got ", tokens_per_expert.describe());
  return load_stats(tokens_per_expert.to_ints());  // device -> host copy: synchronises
}

LoadStats load_stats(const std::vector<int64_t>& c) {
  FLOWMOE_CHECK(!c.empty(), ShapeError, "load_stats: no experts");
  LoadStats s;
  s.max_load = *std::max_element(c.begin(), c.end());
  s.min_load = *std::min_element(c.begin(), c.end());
  for (int64_t v : c) s.total += v;
  s.mean_load = double(s.total) / double(c.size());
  s.max_over_mean = s.total > 0 ? double(s.max_load) / s.mean_load : 0.0;
  return s;
}

}  // namespace flowmoe
