#include "layers/mla.h"

#include <vector>

#include "engine/ops/quantize.h"
#include "layers/kv_cache.h"

namespace flowmoe {

namespace {

// transformers' DeepseekV3RMSNorm default: q_a_layernorm and kv_a_layernorm are built without the config's
// rms_norm_eps, so they keep 1e-6 whatever it is.
constexpr double kLatentNormEps = 1e-6;

}  // namespace

LatentAttention::LatentAttention(ParamFactory& f, const std::string& prefix, const ModelConfig& c, double out_init_std,
                                 bool fp8)
    : hidden_(c.hidden_size),
      num_heads_(c.num_attention_heads),
      q_lora_rank_(c.q_lora_rank),
      kv_lora_rank_(c.kv_lora_rank),
      nope_(c.qk_nope_head_dim),
      rope_(c.qk_rope_head_dim),
      v_dim_(c.v_head_dim),
      rope_theta_(c.rope_theta),
      eps_(kLatentNormEps),
      fp8_(fp8),
      backend_(c.attention_kernel),
      site_(prefix.substr(prefix.rfind('.') + 1)) {
  FLOWMOE_CHECK(rope_ % 2 == 0 && nope_ >= 1 && v_dim_ >= 1 && kv_lora_rank_ >= 1 && q_lora_rank_ >= 0, ShapeError,
                prefix, ": MLA needs an even qk_rope_head_dim and positive widths, got rope ", rope_, ", nope ", nope_,
                ", v ", v_dim_, ", kv_lora_rank ", kv_lora_rank_, ", q_lora_rank ", q_lora_rank_);
  const int64_t qk = nope_ + rope_;
  const double init = c.initializer_range;
  if (q_lora_rank_ > 0) {
    q_a_proj_ = f.normal(prefix + ".q_a_proj.weight", {q_lora_rank_, hidden_}, init);
    q_a_layernorm_ = f.ones(prefix + ".q_a_layernorm.weight", {q_lora_rank_});
    q_b_proj_ = f.normal(prefix + ".q_b_proj.weight", {num_heads_ * qk, q_lora_rank_}, init);
  } else {
    q_proj_ = f.normal(prefix + ".q_proj.weight", {num_heads_ * qk, hidden_}, init);
  }
  kv_a_proj_ = f.normal(prefix + ".kv_a_proj_with_mqa.weight", {kv_lora_rank_ + rope_, hidden_}, init);
  kv_a_layernorm_ = f.ones(prefix + ".kv_a_layernorm.weight", {kv_lora_rank_});
  kv_b_proj_ = f.normal(prefix + ".kv_b_proj.weight", {num_heads_ * (nope_ + v_dim_), kv_lora_rank_}, init);
  o_proj_ = f.normal(prefix + ".o_proj.weight", {hidden_, num_heads_ * v_dim_}, out_init_std);
  if (fp8) {
    for (const Variable* w : {&q_a_proj_, &q_b_proj_, &q_proj_, &kv_b_proj_, &o_proj_}) {
      if (!w->defined()) continue;
      check_fp8_linear_dims(w->size(0), w->size(1), w->name());
      f.read_in_f32(*w);  // quantized from f32
    }
  }
}

Variable LatentAttention::project(const Variable& in, const Variable& w, const Fp8WeightCache& cache, const char* name,
                                  DType compute) const {
  if (is_fp8(in.dtype())) return cached_fp8_linear(in, w, cache, site_ + "." + name, compute);
  return linear(in, compute_weight(w, compute));
}

LatentAttention::Heads LatentAttention::heads(const Variable& xq, const Variable& y, DType compute, int64_t pos) const {
  const int64_t b = y.size(0), t = y.size(1), n = b * t, qk = nope_ + rope_;
  const bool fp8 = xq.defined();
  const Variable rows = reshape(y, {n, hidden_});
  // A norm's output feeding an FP8 projection is quantized once, at that projection's site.
  auto input_of = [&](const Variable& v, const char* name) {
    return fp8 ? quantize_rowwise(v, site_ + "." + name + ": x") : v;
  };
  Variable q;
  if (q_lora_rank_ > 0) {
    const Variable qa = project(fp8 ? xq : rows, q_a_proj_, q_a_fp8_, "q_a_proj", compute);
    const Variable qn = rmsnorm(qa, compute_weight(q_a_layernorm_, compute), eps_);
    q = project(input_of(qn, "q_b_proj"), q_b_proj_, q_b_fp8_, "q_b_proj", compute);
  } else {
    q = project(fp8 ? xq : rows, q_proj_, q_fp8_, "q_proj", compute);
  }
  const std::vector<Variable> q_parts = split_last(reshape(q, {b, t, num_heads_, qk}), {nope_, rope_});
  Heads h;
  h.q = concat_last({q_parts[0], rope(q_parts[1], rope_theta_, pos)});

  const std::vector<Variable> kv_a =
      split_last(linear(rows, compute_weight(kv_a_proj_, compute)), {kv_lora_rank_, rope_});
  const Variable latent = rmsnorm(kv_a[0], compute_weight(kv_a_layernorm_, compute), eps_);
  const Variable kv = project(input_of(latent, "kv_b_proj"), kv_b_proj_, kv_b_fp8_, "kv_b_proj", compute);
  const std::vector<Variable> kv_parts = split_last(reshape(kv, {b, t, num_heads_, nope_ + v_dim_}), {nope_, v_dim_});
  // The one rotated k_pe per token, repeated for every head (its gradient sums over them).
  const Variable k_pe = rope(reshape(kv_a[1], {b, t, 1, rope_}), rope_theta_, pos);
  const Variable k_pe_heads =
      reshape(concat_last(std::vector<Variable>(size_t(num_heads_), k_pe)), {b, t, num_heads_, rope_});
  h.k = concat_last({kv_parts[0], k_pe_heads});
  h.v = kv_parts[1];
  return h;
}

Variable LatentAttention::output(const Variable& o, bool fp8, DType compute) const {
  const int64_t b = o.size(0), t = o.size(1);
  Variable rows = reshape(o, {b * t, num_heads_ * v_dim_});
  if (fp8) rows = quantize_rowwise(rows, site_ + ".o_proj: x");
  return reshape(project(rows, o_proj_, o_fp8_, "o_proj", compute), {b, t, hidden_});
}

Variable LatentAttention::forward(const Variable& x, DType compute) const {
  FLOWMOE_CHECK(x.data().dim() == 3 && x.size(2) == hidden_, ShapeError, "mla: input ", x.data().describe(),
                ", expected [B, T, ", hidden_, "]");
  if (fp8_)
    return forward_quantized(quantize_rowwise(reshape(x, {x.size(0) * x.size(1), hidden_}), input_site()), x, x.size(0),
                             x.size(1), compute);
  const Heads h = heads(Variable(), x, compute, 0);
  return output(causal_attention(h.q, h.k, h.v, backend_), false, compute);
}

Variable LatentAttention::forward_quantized(const Variable& xq, const Variable& y, int64_t b, int64_t t,
                                            DType compute) const {
  FLOWMOE_CHECK(fp8_ && is_fp8(xq.dtype()) && xq.data().dim() == 2 && xq.size(0) == b * t && xq.size(1) == hidden_ &&
                    y.defined() && y.data().dim() == 3 && y.size(0) == b && y.size(1) == t,
                ShapeError, "mla: quantized input ", xq.data().describe(), ", expected FP8 [", b * t, ", ", hidden_,
                "] and the norm's output [", b, ", ", t, ", ", hidden_, "] for an FP8 attention");
  const Heads h = heads(xq, y, compute, 0);
  return output(causal_attention(h.q, h.k, h.v, backend_), true, compute);
}

// In FP8 too the projections run in the compute dtype here: one row is no FP8 GEMM's row count.
Variable LatentAttention::forward_cached(const Variable& x, DType compute, const Tensor& keys, const Tensor& values,
                                         int64_t pos) const {
  FLOWMOE_CHECK(!grad_enabled(), Error, "mla: the cached forward is for inference (under NoGradGuard)");
  FLOWMOE_CHECK(x.data().dim() == 3 && x.size(0) == 1 && x.size(2) == hidden_, ShapeError, "mla: input ",
                x.data().describe(), ", expected one sequence [1, T, ", hidden_, "]");
  const Heads h = heads(Variable(), x, compute, pos);
  return output(attend_with_cache(h.q, h.k, h.v, keys, values, pos, backend_, "mla"), false, compute);
}

}  // namespace flowmoe
