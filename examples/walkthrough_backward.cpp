// `flowmoe walkthrough`, backward steps (see examples/walkthrough.h): each step runs the vjp of one
// forward step by calling backward() on that step's output with the gradient the step after it
// produced; the graph between two steps is the engine's own. Then the layer check and the casts.
#include <algorithm>
#include <cmath>
#include <map>

#include "engine/cast_stats.h"
#include "engine/ops/fp8_grouped_linear.h"
#include "engine/ops/fp8_transpose.h"
#include "engine/ops/swiglu_quant.h"
#include "examples/walkthrough.h"
#include "kernels/router.h"

namespace flowmoe::walk {

namespace {

// What the scaling-aware transpose did to a rowwise FP8 tensor: per value, exact, rounded on the
// subnormal grid, or flushed to zero (compared as dequantized values, over the experts' rows).
void transpose_report(const State& s, const char* name, const Tensor& q, const Printer& out) {
  const Tensor t = fp8_transpose(q, s.counts);
  const int64_t K = q.size(1);
  const std::vector<float> row = dequantize_tensor(q, DType::f32, "").to_floats();
  const std::vector<float> col = dequantize_tensor(t, DType::f32, "").to_floats();
  int64_t nonzero = 0, exact = 0, flushed = 0, rows = 0;
  for (int64_t c : s.counts) rows += c;
  for (int64_t i = 0; i < rows * K; ++i) {
    if (row[size_t(i)] == 0.f) continue;
    ++nonzero;
    exact += col[size_t(i)] == row[size_t(i)];
    flushed += col[size_t(i)] == 0.f;
  }
  // The first expert with rows, first 128-column block: the coarsest scale S and the shifts 2^-k.
  const std::vector<float> si = q.fp8_scales()->scale_inv.to_floats();
  const std::vector<float> st = t.fp8_scales()->scale_inv.to_floats();
  const auto* b = static_cast<const uint8_t*>(q.raw_data());
  size_t e = 0;
  int64_t first = 0, blk = 0;  // the expert's first row and first 128-row block
  while (s.counts[e] == 0) ++e;
  for (size_t i = 0; i < e; ++i) first += s.counts[i], blk += (s.counts[i] + 127) / 128;
  int lo = 1000, hi = -1000;
  for (int64_t i = first; i < first + s.counts[e]; ++i) {
    bool any = false;
    for (int64_t j = 0; j < 128; ++j) any = any || (b[i * K + j] & 0x7F) != 0;
    if (!any) continue;  // an all-zero block (a pad row) does not vote
    const int ex = std::ilogb(si[size_t(i * ((K + 127) / 128))]);
    lo = std::min(lo, ex), hi = std::max(hi, ex);
  }
  out.line("  %-6s %s -> %s + scale_inv %s", name, dims(q).c_str(), dims(t).c_str(),
           dims(t.fp8_scales()->scale_inv).c_str());
  out.line("         expert %zu, columns 0-127: row scales 2^%d..2^%d, S = %s, shifts k = 0..%d", e, lo, hi,
           pow2(st[size_t(blk * K)]).c_str(), hi - lo);
  out.line("         all experts: %lld nonzero, %lld exact, %lld rounded on the subnormal grid, %lld flushed to zero",
           (long long)nonzero, (long long)exact, (long long)(nonzero - exact - flushed), (long long)flushed);
}

}  // namespace

void dy_split(State& s, const Printer& out) {
  s.y.backward(s.dy);
  s.dx_shared = s.x_shared.grad();
  out.line("math   y = y_routed + y_shared, so both receive dy; the shared MLP backpropagates as any MLP");
  out.line("code   engine/autograd.cpp::backward, layers/mlp.cpp (linear, silu, mul vjps)");
  out.line("out    d y_routed %s = dy: %s; dx_shared[0,0:4] = %s", dims(s.y_routed_in.grad()).c_str(),
           same_bits(s.y_routed_in.grad(), s.dy) ? "yes" : "NO", values(s.dx_shared, 0).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void combine_backward(State& s, const Printer& out) {
  s.y_combined.backward(s.y_routed_in.grad());
  s.d_out = s.out_in.grad();
  const std::vector<int64_t> rm = s.p.row_map.to_ints();
  const int64_t pad = pad_row(s);
  out.line("math   d out[row_map[t,j]] = dy[t] for every j: one gradient per token, quantized once, then moved");
  out.line("code   layers/moe.cpp::CombineGradToFp8::vjp -> quantize_rowwise_tensor; then");
  out.line("       engine/ops/unpermute.cpp::UnpermuteUnpad::vjp -> engine/ops/permute.cpp::permute_rows_like");
  out.line("out    d_out %s + scale_inv %s", dims(s.d_out).c_str(), dims(s.d_out.fp8_scales()->scale_inv).c_str());
  out.line("rows %lld and %lld: codes %s (both), scale_inv %s | %s", (long long)rm[0], (long long)rm[1],
           codes(s.d_out, rm[0]).c_str(), scales_of_row(s.d_out, rm[0]).c_str(), scales_of_row(s.d_out, rm[1]).c_str());
  out.line("dy[0,0:4] = %s, d_out[%lld,0:4] = %s", values(s.dy, 0).c_str(), (long long)rm[0],
           values(s.d_out, rm[0]).c_str());
  out.line("pad row %lld: zero %s, scale_inv %s", (long long)pad, all_zero(s.d_out, pad) ? "yes" : "NO",
           scales_of_row(s.d_out, pad).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void fc2_backward(State& s, const Printer& out) {
  s.out.backward(s.d_out);
  s.d_a = s.a_in.grad();
  const int64_t r = row0(s);
  out.line("math   wgrad dW2[e] = Σ over expert e's rows of d_out[i]ᵀ·a[i]; dgrad d_a = d_out·W2[e]");
  out.line("code   engine/ops/fp8_grouped_linear.cpp::Fp8GroupedLinear::vjp -> engine/ops/fp8_transpose.cpp::");
  out.line("       fp8_transpose, kernels/cpu/fp8_grouped_linear.cpp::fp8_grouped_wgrad_cpu, fp8_grouped_gemm_cpu");
  out.line("wgrad operands, rowwise -> colwise 1x128 over the experts' segments (scaling-aware transpose):");
  transpose_report(s, "d_out", s.d_out, out);
  transpose_report(s, "a", s.a.data(), out);
  out.line("out    dW2 %s, dW2[0,0,0:4] = %s", dims(s.fc2.grad()).c_str(), values(s.fc2.grad(), 0).c_str());
  out.line("       d_a %s (bf16 on a GPU), d_a[%lld,0:4] = %s", dims(s.d_a).c_str(), (long long)r,
           values(s.d_a, r).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void swiglu_backward(State& s, const Printer& out) {
  s.a.backward(s.d_a);
  s.d_h = s.h_in.grad();
  s.d_probs = s.probs_in.grad();
  const int64_t r = row0(s), F = s.cfg.moe_intermediate_size;
  out.line("math   g = d_a·prob; d_gate = g·up·silu'(gate); d_up = g·silu(gate); d_prob = Σ_j d_a·silu(gate)·up");
  out.line("code   engine/ops/swiglu_quant.cpp::SwigluQuantBackward -> kernels/cpu/swiglu_quant.cpp::");
  out.line("       swiglu_quant_backward_cpu (d_h quantized in the same pass: not a cast)");
  out.line("out    d_h %s + scale_inv %s, d_probs %s", dims(s.d_h).c_str(), dims(s.d_h.fp8_scales()->scale_inv).c_str(),
           dims(s.d_probs).c_str());
  out.line("row %lld: d_gate[0:2] = %s, d_up[0:2] = %s, scale_inv %s", (long long)r, values(s.d_h, r, 0, 2).c_str(),
           values(s.d_h, r, F, 2).c_str(), scales_of_row(s.d_h, r).c_str());
  out.line("       d_prob = %s", values(s.d_probs.view({s.d_probs.size(0), 1}), r, 0, 1).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void fc1_backward(State& s, const Printer& out) {
  // What the checkpoint node of MoeLayer does first: fc1 -> SwiGLU again, from the kept FP8 rows.
  const int64_t casts_before = cast_counts().activation_casts();
  Tensor h2, a2;
  {
    NoGradGuard ng;
    h2 = fp8_grouped_linear(Variable(s.p.rows.data()), s.fc1, s.w1q, s.counts, Fp8Wgrad::transpose, "fc1").data();
    a2 = swiglu_quant(Variable(h2), Variable(s.p.probs.data()), true).data();
  }
  const bool same = same_bits(h2, s.h.data()) && same_bits(a2, s.a.data());
  s.h.backward(s.d_h);
  s.d_rows = s.rows_in.grad();
  const int64_t r = row0(s);
  out.line("math   recompute h and a; then dW1[e] = Σ over expert e's rows of d_h[i]ᵀ·rows[i]; d_rows = d_h·W1[e]");
  out.line("code   engine/autograd.cpp::CheckpointNode::backward, then Fp8GroupedLinear::vjp as for fc2");
  out.line("recompute from the kept rows and probs: h and a bit-identical to the forward's: %s; casts added: %lld",
           same ? "yes" : "NO", (long long)(cast_counts().activation_casts() - casts_before));
  transpose_report(s, "d_h", s.d_h, out);
  transpose_report(s, "rows", s.p.rows.data(), out);
  out.line("out    dW1 %s, dW1[0,0,0:4] = %s", dims(s.fc1.grad()).c_str(), values(s.fc1.grad(), 0).c_str());
  out.line("       d_rows %s, d_rows[%lld,0:4] = %s", dims(s.d_rows).c_str(), (long long)r,
           values(s.d_rows, r).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void permute_backward(State& s, const Printer& out) {
  backward({s.p.rows, s.p.probs}, {s.d_rows, s.d_probs});
  s.dx_routed = s.xq_in.grad();
  s.d_topk_prob = s.prob_in.grad();
  const std::vector<int64_t> rm = s.p.row_map.to_ints();
  out.line("math   dx_routed[t] = Σ_j d_rows[row_map[t,j]] (fp32, j ascending); d_p[t,j] = d_probs[row_map[t,j]]");
  out.line("code   engine/ops/permute.cpp::PermutePadBackward -> kernels/cpu/permute.cpp::permute_backward_cpu");
  out.line("out    dx_routed %s, d_topk_prob %s", dims(s.dx_routed).c_str(), dims(s.d_topk_prob).c_str());
  out.line("d_rows[%lld,0:4]    %s", (long long)rm[0], values(s.d_rows, rm[0]).c_str());
  out.line("d_rows[%lld,0:4]   %s", (long long)rm[1], values(s.d_rows, rm[1]).c_str());
  out.line("dx_routed[0,0:4] %s", values(s.dx_routed, 0).c_str());
  out.line("d_topk_prob[0] = %s", values(s.d_topk_prob, 0, 0, 2).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void quantize_backward(State& s, const Printer& out) {
  s.xq.backward(s.dx_routed);
  out.line("math   straight-through: d x = d xq, in x's dtype (the rounding is treated as identity)");
  out.line("code   engine/ops/quantize.cpp::QuantizeRowwise::vjp");
  out.line("out    dx_quant %s (x's dtype), the same bits as dx_routed: %s", dims(s.x_quant.grad()).c_str(),
           same_bits(s.x_quant.grad(), s.dx_routed) ? "yes" : "NO");
  out.line("casts  %s", cast_summary().c_str());
}

void router_backward(State& s, const Printer& out) {
  s.r.topk_prob.backward(s.d_topk_prob);
  s.dx_router = s.x_router.grad();
  // The same vjp on a leaf holding the logits, to show d_logits (inside route() it feeds linear's vjp).
  Tensor logits, d_logits;
  {
    NoGradGuard ng;
    logits = linear(s.x_router, s.gate).data();
  }
  Variable lg = leaf(logits);
  route_logits(lg, s.layer->expert_bias().data(), s.router).topk_prob.backward(s.d_topk_prob);
  d_logits = lg.grad();
  const std::vector<float> l = logits.to_floats(), dp = s.d_topk_prob.to_floats();
  const std::vector<int64_t> idx = s.r.topk_idx.to_ints();
  // The derivation, in double: S = s_a + s_b, p_j = s_j / S, d_s_i = (d_p_i - Σ_j d_p_j p_j) / S.
  const double sa = router_sigmoid(double(l[size_t(idx[0])])), sb = router_sigmoid(double(l[size_t(idx[1])]));
  const double S = sa + sb, dot = (dp[0] * sa + dp[1] * sb) / S;
  const double ga = (dp[0] - dot) / S * sa * (1 - sa), gb = (dp[1] - dot) / S * sb * (1 - sb);
  out.line("math   d_s_i = (d_p_i - Σ_j d_p_j·p_j) / S for chosen i, 0 otherwise; d_logit = d_s·s·(1-s);");
  out.line("       dx = d_logits·Wr, dWr = d_logitsᵀ·x; expert_bias gets nothing");
  out.line("code   engine/ops/router.cpp::RouterTopkBackward -> kernels/cpu/router.cpp::router_topk_backward_cpu,");
  out.line("       engine/ops/linear.cpp (dx, dWr)");
  out.line("token 0: experts %lld %lld, d_p = %s, d_logits (expert 0..3) = %s", (long long)idx[0], (long long)idx[1],
           values(s.d_topk_prob, 0, 0, 2).c_str(), values(d_logits, 0).c_str());
  out.line("         the formula in double: d_logit %lld = %s, d_logit %lld = %s", (long long)idx[0], num(ga).c_str(),
           (long long)idx[1], num(gb).c_str());
  out.line("out    dx_router %s, dx_router[0,0:4] = %s", dims(s.dx_router).c_str(), values(s.dx_router, 0).c_str());
  out.line("       dWr %s, dWr[0,0:4] = %s", dims(s.gate.grad()).c_str(), values(s.gate.grad(), 0).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void dx_sum(State& s, const Printer& out) {
  // The order in which the engine's graph walk reaches x's three uses: the shared experts first (a side
  // branch's nodes go as soon as they are ready), then the ready node recorded last, the quantize before
  // the router.
  s.dx = tensor_add(tensor_add(s.dx_shared, s.x_quant.grad()), s.dx_router);
  out.line("math   dx = (dx_shared + dx_routed) + dx_router: x has three uses, and autograd adds their");
  out.line("       gradients in the order its graph walk reaches them (float addition is not associative)");
  out.line("code   engine/autograd.cpp::backward (accumulate)");
  out.line("out    dx %s, dx[0,0:4] = %s", dims(s.dx).c_str(), values(s.dx, 0).c_str());
  for (const Variable& p : s.factory->params()) s.grads.push_back(p.grad());
  out.line("casts  %s", cast_summary().c_str());
}

namespace {

struct LayerRun {
  Tensor y, dx;
  std::vector<Tensor> grads;
  CastCounts casts;
};

// One forward + backward of a fresh MoeLayer with the walk's weights (same seed), bias and batch.
LayerRun run_layer(const State& s, MoeRecipe recipe, bool recompute) {
  MoeOptions o(s.options.align_size);
  o.recipe = recipe;
  o.recompute_expert = recompute;
  ParamFactory f(s.seed, Device::cpu());
  MoeLayer layer(f, s.cfg, "mlp", o, Device::cpu());
  Tensor bias = layer.expert_bias().data();  // shares the buffer's storage
  bias.copy_(s.layer->expert_bias().data());
  reset_cast_counts();
  Variable x(s.x, true);
  Variable y = layer.forward(x, DType::f32);
  y.backward(s.dy);
  LayerRun r{y.data(), x.grad(), {}, cast_counts()};
  for (const Variable& p : f.params()) r.grads.push_back(p.grad());
  return r;
}

double rel_diff(const Tensor& a, const Tensor& b) {
  const std::vector<float> u = a.to_floats(), v = b.to_floats();
  double d = 0, n = 0;
  for (size_t i = 0; i < u.size(); ++i) d += double(u[i] - v[i]) * (u[i] - v[i]), n += double(v[i]) * v[i];
  return std::sqrt(d / n);
}

}  // namespace

void layer_check(State& s, const Printer& out) {
  const CastCounts walk_casts = cast_counts();
  const LayerRun r = run_layer(s, MoeRecipe::fp8_flow, /*recompute=*/true);
  out.line("MoeLayer::forward and backward (layers/moe.cpp), fp8_flow with recompute moe_expert, on the");
  out.line("same weights, expert_bias, x and dy; every tensor compared bit for bit with the walk's:");
  out.line("y      %s; dx %s", same_bits(r.y, s.y.data()) ? "identical" : "DIFFERENT",
           same_bits(r.dx, s.dx) ? "identical" : "DIFFERENT");
  const std::vector<Variable>& params = s.factory->params();
  std::vector<std::string> items;
  for (size_t i = 0; i < params.size(); ++i)
    items.push_back(params[i].name() + (same_bits(r.grads[i], s.grads[i]) ? " identical" : " DIFFERENT"));
  out.list("grads", items);
  out.line("activation casts: the layer %lld, the walk %lld; weight quantizations %lld (fc1, fc2: once per step)",
           (long long)r.casts.activation_casts(), (long long)walk_casts.activation_casts(),
           (long long)r.casts.weight_quantize);
}

void recipe_casts(State& s, const Printer& out) {
  const LayerRun ref = run_layer(s, MoeRecipe::bf16, false);
  out.line("the same step through MoeLayer in each recipe; casts counted by engine/cast_stats.cpp::note_cast;");
  out.line("sites are quantizes unless marked; y and dx as |a - b| / |b| against the bf16 recipe (f32 here)");
  out.line("recipe         recompute  casts  y vs bf16  dx vs bf16");
  for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow}) {
    CastCounts plain;
    for (bool recompute : {false, true}) {
      const LayerRun r = run_layer(s, recipe, recompute);
      out.line("%-14s %-9s  %5lld  %9s  %10s", moe_recipe_name(recipe), recompute ? "yes" : "no",
               (long long)r.casts.activation_casts(), num(rel_diff(r.y, ref.y)).c_str(),
               num(rel_diff(r.dx, ref.dx)).c_str());
      // The sites grouped by layer ("fc1.", "fc2." or none), in the order the step meets them.
      std::map<std::string, std::vector<std::pair<int, std::string>>> by_layer;
      for (const auto& [site, n] : r.casts.by_site) {
        if (site.rfind("weight_quantize", 0) == 0 || (recompute && plain.by_site[site] == n)) continue;
        const size_t space = site.find(' '), dot = site.find('.', space);
        const bool deq = site.rfind("dequantize", 0) == 0;
        const std::string layer = dot == std::string::npos ? "" : site.substr(space + 1, dot - space - 1);
        const std::string where = site.substr(dot == std::string::npos ? space + 1 : dot + 1);
        by_layer[layer].push_back(
            {site_order(where),
             where + (deq ? " (dequantize)" : "") + (recompute ? " x" + std::to_string(n) + " (recomputed)" : "")});
      }
      for (auto& [layer, sites] : by_layer) {
        std::sort(sites.begin(), sites.end());
        std::string list;
        for (const auto& site : sites) append(list, " | ", site.second);
        out.line("    %s%s", layer.empty() ? "" : (layer + ": ").c_str(), list.c_str());
      }
      if (!recompute) plain = r.casts;
    }
  }
}

}  // namespace flowmoe::walk
