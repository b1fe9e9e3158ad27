// `flowmoe walkthrough`, forward steps (see examples/walkthrough.h): the ops in the order of
// MoeLayer::forward (layers/moe.cpp), fp8_flow recipe, each step on leaves of its own.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "engine/cast_stats.h"
#include "engine/ops/fp8_grouped_linear.h"
#include "engine/ops/grouped_linear.h"
#include "engine/ops/swiglu_quant.h"
#include "engine/ops/unpermute.h"
#include "examples/walkthrough.h"
#include "kernels/router.h"
#include "layers/moe.h"

namespace flowmoe::walk {

void router(State& s, const Printer& out) {
  s.x_router = leaf(s.x);
  s.r = route(s.x_router, s.gate, s.layer->expert_bias().data(), s.router);
  out.line("math   s = sigmoid(x·Wrᵀ) in f32; top-2 of s + expert_bias; p_j = s_j / Σ_chosen s");
  out.line("code   engine/ops/router.cpp::route -> kernels/cpu/router.cpp::router_topk_cpu");
  out.line("out    topk_idx %s, topk_prob %s, tokens_per_expert %s", dims(s.r.topk_idx).c_str(),
           dims(s.r.topk_prob.data()).c_str(), dims(s.r.tokens_per_expert).c_str());
  Tensor scores, unbiased;
  {
    NoGradGuard ng;
    scores = linear(s.x_router, s.gate).data();
    unbiased = route(s.x_router, s.gate, Tensor(), s.router).topk_idx;
  }
  const std::vector<float> lg = scores.to_floats(), prob = s.r.topk_prob.data().to_floats();
  const std::vector<int64_t> idx = s.r.topk_idx.to_ints(), plain = unbiased.to_ints();
  const int E = s.router.num_experts, k = s.router.top_k;
  out.line("token  s (expert 0..3)             experts  p");
  for (int64_t t = 0; t < kTokens; ++t) {
    std::string sc, note;
    for (int e = 0; e < E; ++e) append(sc, " ", fixed(router_sigmoid(lg[size_t(t * E + e)])));
    if (plain[size_t(t * k)] != idx[size_t(t * k)] || plain[size_t(t * k + 1)] != idx[size_t(t * k + 1)])
      note =
          "  (no bias: " + std::to_string(plain[size_t(t * k)]) + " " + std::to_string(plain[size_t(t * k + 1)]) + ")";
    out.line("%5lld  %s  %lld %lld      %s %s%s", (long long)t, sc.c_str(), (long long)idx[size_t(t * k)],
             (long long)idx[size_t(t * k + 1)], fixed(prob[size_t(t * k)]).c_str(),
             fixed(prob[size_t(t * k + 1)]).c_str(), note.c_str());
  }
  out.line("tokens_per_expert %s", ints(s.r.tokens_per_expert).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void quantize(State& s, const Printer& out) {
  s.x_quant = leaf(s.x);
  s.xq = quantize_rowwise(s.x_quant, "dispatch: x");
  const Tensor& q = s.xq.data();
  out.line("math   per row and 128-column block: scale_inv = 2^-floor(log2(448/amax)), q = e4m3(x/scale_inv)");
  out.line("code   engine/ops/quantize.cpp::quantize_rowwise -> kernels/cpu/quantize.cpp::quantize_rowwise_cpu");
  out.line("out    xq %s + scale_inv %s (rowwise 1x128)", dims(q).c_str(), dims(q.fp8_scales()->scale_inv).c_str());
  const std::vector<float> xv = s.x.to_floats(), si = q.fp8_scales()->scale_inv.to_floats();
  for (int b = 0; b < 2; ++b) {
    float amax = 0.f;
    for (int j = 0; j < 128; ++j) amax = std::max(amax, std::fabs(xv[size_t(b * 128 + j)]));
    out.line("row 0 block %d: amax %s, 448/amax = %s, scale_inv %s, amax/scale_inv = %s", b, num(amax).c_str(),
             num(448.0 / amax).c_str(), pow2(si[size_t(b)]).c_str(), num(amax / si[size_t(b)]).c_str());
  }
  out.line("x[0,0:4]             %s", values(s.x, 0).c_str());
  out.line("q[0,0:4]             %s = e4m3 %s", codes(q, 0).c_str(), values(q.to(DType::f32), 0).c_str());
  out.line("q·scale_inv[0,0:4]   %s", values(q, 0).c_str());
  const std::vector<float> xhat = dequantize_tensor(q, DType::f32, "").to_floats();
  double err = 0, norm = 0;
  for (size_t i = 0; i < xv.size(); ++i) {
    err += double(xv[i] - xhat[i]) * (xv[i] - xhat[i]);
    norm += double(xv[i]) * xv[i];
  }
  out.line("|x - q·scale_inv| / |x| over the tensor: %s", num(std::sqrt(err / norm)).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void dispatch(State& s, const Printer& out) {
  const int E = s.router.num_experts, k = s.router.top_k, align = s.options.align_size;
  const int64_t H = s.cfg.hidden_size, copies = kTokens * k;
  const int64_t fp8_row = H + 4 * (H / 128);
  s.xq_in = leaf(s.xq.data());
  s.prob_in = leaf(s.r.topk_prob.data());
  DispatchOptions o;
  o.num_experts = E;
  o.align_size = align;
  o.num_rows = moe_permuted_rows(kTokens, k, E, align, s.options.recipe);
  s.d = dispatch(s.xq_in, s.r.topk_idx, s.prob_in, o);
  out.line("math   one rank owns all 4 experts (expert-parallel size 1): nothing travels, and dispatch is the");
  out.line("       permute + pad of the next step; across ranks each (peer, expert) segment would travel");
  out.line("code   parallel/dispatch.cpp::dispatch -> engine/ops/permute.cpp::permute_pad");
  out.line("a row as it would travel: bf16 2H = %lld bytes; e4m3 H + 4·H/128 = %lld + %lld = %lld bytes",
           (long long)(2 * H), (long long)H, (long long)(4 * (H / 128)), (long long)fp8_row);
  out.line("ratio %lld / %lld = %s; the %lld routed copies: %lld bytes in FP8 against %lld in bf16", (long long)fp8_row,
           (long long)(2 * H), num(double(fp8_row) / double(2 * H)).c_str(), (long long)copies,
           (long long)(copies * fp8_row), (long long)(copies * 2 * H));
  out.line("casts  %s", cast_summary().c_str());
}

void permute(State& s, const Printer& out) {
  const int E = s.router.num_experts, k = s.router.top_k, align = s.options.align_size;
  const int64_t num_rows = moe_permuted_rows(kTokens, k, E, align, s.options.recipe);
  s.p = s.d.routing;
  s.counts = s.d.counts.host;
  const Tensor& rows = s.p.rows.data();
  out.line("math   rows[row_map[t,j]] = xq[t] with its scales, probs[row_map[t,j]] = p[t,j]; pad rows written");
  out.line("code   engine/ops/permute.cpp::permute_pad -> kernels/cpu/permute.cpp::permute_map_cpu, permute_rows_cpu");
  out.line("out    rows %s + scale_inv %s, probs %s, row_map %s", dims(rows).c_str(),
           dims(rows.fp8_scales()->scale_inv).c_str(), dims(s.p.probs.data()).c_str(), dims(s.p.row_map).c_str());
  out.line("buffer rows: T·k + min(E, T·k)·(align-1) = %lld + %lld·%d = %lld, rounded up to 16: %lld",
           (long long)(kTokens * k), (long long)std::min<int64_t>(E, kTokens * k), align - 1,
           (long long)permute_worst_case_rows(kTokens, k, E, align), (long long)num_rows);
  const std::vector<int64_t> tpe = s.p.tokens_per_expert.to_ints(), seg = s.p.segment_starts.to_ints();
  out.line("expert  tokens  padded  rows      pad rows");
  for (int e = 0; e < E; ++e)
    out.line("%6d  %6lld  %6lld  [%lld,%lld)%*s%lld", e, (long long)tpe[size_t(e)], (long long)s.counts[size_t(e)],
             (long long)seg[size_t(e)], (long long)seg[size_t(e + 1)],
             int(10 - std::to_string(seg[size_t(e)]).size() - std::to_string(seg[size_t(e + 1)]).size() - 3), "",
             (long long)(s.counts[size_t(e)] - tpe[size_t(e)]));
  out.line("tail   rows [%lld,%lld), written like pad rows", (long long)seg[size_t(E)], (long long)num_rows);
  const std::vector<int64_t> rm = s.p.row_map.to_ints();
  std::string map;
  for (int64_t t = 0; t < kTokens; ++t)
    append(map, " | ", std::to_string(rm[size_t(t * k)]) + " " + std::to_string(rm[size_t(t * k + 1)]));
  out.line("row_map (token 0..7): %s", map.c_str());
  const auto* rb = static_cast<const uint8_t*>(rows.raw_data());
  const auto* xb = static_cast<const uint8_t*>(s.xq.data().raw_data());
  const int64_t H = s.cfg.hidden_size, r0 = rm[0], r1 = rm[1];
  const bool moved = std::memcmp(rb + r0 * H, xb, size_t(H)) == 0 && std::memcmp(rb + r1 * H, xb, size_t(H)) == 0;
  out.line("rows %lld and %lld hold xq[0] byte for byte: %s; scale_inv %s | %s; probs %s %s", (long long)r0,
           (long long)r1, moved ? "yes" : "NO", scales_of_row(rows, r0).c_str(), scales_of_row(rows, r1).c_str(),
           values(s.p.probs.data().view({num_rows, 1}), r0, 0, 1).c_str(),
           values(s.p.probs.data().view({num_rows, 1}), r1, 0, 1).c_str());
  const int64_t pad = pad_row(s);
  bool zero = true;
  for (int64_t j = 0; j < H; ++j) zero = zero && rb[pad * H + j] == 0;
  out.line("pad row %lld: data all zero %s, scale_inv %s, prob %s", (long long)pad, zero ? "yes" : "NO",
           scales_of_row(rows, pad).c_str(), values(s.p.probs.data().view({num_rows, 1}), pad, 0, 1).c_str());
  std::string c;
  for (int64_t v : s.counts) append(c, " ", std::to_string(v));
  out.line("host counts (parallel/dispatch.cpp::dispatch -> read_counts_once, once per forward): %s", c.c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void fc1(State& s, const Printer& out) {
  s.w1q = quantize_weight(s.fc1.data(), s.fc1.name());
  s.rows_in = leaf(s.p.rows.data());
  s.h = fp8_grouped_linear(s.rows_in, s.fc1, s.w1q, s.counts, Fp8Wgrad::transpose, "fc1");
  const Tensor& h = s.h.data();
  const int64_t r = row0(s), M = h.size(0), H = s.cfg.hidden_size, F = s.cfg.moe_intermediate_size;
  out.line("math   h[rows of e] = rows[e]·W1[e]ᵀ per expert, FP8 operands, fp32 accumulation");
  out.line("code   engine/ops/fp8_grouped_linear.cpp::fp8_grouped_linear -> kernels/cpu/fp8_grouped_linear.cpp::");
  out.line("       fp8_grouped_gemm_cpu (cuBLASLt VEC128 x BLK128x128 on a GPU)");
  const Tensor& ws = s.w1q.q.fp8_scales()->scale_inv;
  const std::vector<float> wsv = ws.to_floats();
  out.line("W1     %s -> q %s + scale_inv %s, and q_t for dgrad", dims(s.fc1.data()).c_str(), dims(s.w1q.q).c_str(),
           dims(ws).c_str());
  out.line("       (128x128 blocks, once per optimizer step); W1[0] block scales %s %s / %s %s", pow2(wsv[0]).c_str(),
           pow2(wsv[1]).c_str(), pow2(wsv[2]).c_str(), pow2(wsv[3]).c_str());
  out.line("out    h %s = [gate | up] (bf16 on a GPU)", dims(h).c_str());
  out.line("h[%lld,0:4] = %s; pad row %lld zero: %s; tail row %lld zero: %s", (long long)r, values(h, r).c_str(),
           (long long)(pad_row(s)), all_zero(h, pad_row(s)) ? "yes" : "NO", (long long)(M - 1),
           all_zero(h, M - 1) ? "yes" : "NO");
  out.line("recompute: checkpoint() keeps rows (%lld + %lld bytes of scales) and probs (%lld bytes),",
           (long long)(M * H), (long long)(M * (H / 128) * 4), (long long)(M * 4));
  out.line("       drops h (%lld bytes in f32 here, %lld in bf16) until the backward re-runs fc1 -> SwiGLU",
           (long long)(M * 2 * F * 4), (long long)(M * 2 * F * 2));
  out.line("casts  %s", cast_summary().c_str());
}

void swiglu(State& s, const Printer& out) {
  s.h_in = leaf(s.h.data());
  s.probs_in = leaf(s.p.probs.data());
  s.a = swiglu_quant(s.h_in, s.probs_in, /*quantize_grad=*/true);
  const Tensor& a = s.a.data();
  const int64_t r = row0(s), F = s.cfg.moe_intermediate_size, M = a.size(0);
  const std::vector<float> h = s.h.data().to_floats(), p = s.p.probs.data().to_floats();
  out.line("math   a = silu(gate)·up·prob, gate = h[:, :F], up = h[:, F:]; quantized rowwise in the same pass");
  out.line(
      "code   engine/ops/swiglu_quant.cpp::swiglu_quant -> "
      "kernels/cpu/swiglu_quant.cpp::swiglu_quant_forward_cpu");
  out.line("out    a %s + scale_inv %s (a fused producer of FP8: not a cast)", dims(a).c_str(),
           dims(a.fp8_scales()->scale_inv).c_str());
  out.line("row %lld: gate[0:2] %s %s, up[0:2] %s %s, prob %s", (long long)r, num(h[size_t(r * 2 * F)]).c_str(),
           num(h[size_t(r * 2 * F + 1)]).c_str(), num(h[size_t(r * 2 * F + F)]).c_str(),
           num(h[size_t(r * 2 * F + F + 1)]).c_str(), num(p[size_t(r)]).c_str());
  out.line("       a[0:2] = %s, stored as %s · scale_inv %s", values(a, r, 0, 2).c_str(), codes(a, r, 2).c_str(),
           scales_of_row(a, r).c_str());
  const int64_t pad = pad_row(s);
  out.line("pad row %lld: prob 0, a zero %s, scale_inv %s; tail row %lld: a zero %s, scale_inv %s", (long long)pad,
           all_zero(a, pad) ? "yes" : "NO", scales_of_row(a, pad).c_str(), (long long)(M - 1),
           all_zero(a, M - 1) ? "yes" : "NO", scales_of_row(a, M - 1).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void fc2(State& s, const Printer& out) {
  s.w2q = quantize_weight(s.fc2.data(), s.fc2.name());
  s.a_in = leaf(s.a.data());
  s.out = fp8_grouped_linear(s.a_in, s.fc2, s.w2q, s.counts, Fp8Wgrad::transpose, "fc2");
  const int64_t r = row0(s);
  out.line("math   out[rows of e] = a[e]·W2[e]ᵀ per expert; a arrives in FP8 as SwiGLU wrote it");
  out.line("code   engine/ops/fp8_grouped_linear.cpp::fp8_grouped_linear -> fp8_grouped_gemm_cpu");
  out.line("W2     %s -> q %s + scale_inv %s", dims(s.fc2.data()).c_str(), dims(s.w2q.q).c_str(),
           dims(s.w2q.q.fp8_scales()->scale_inv).c_str());
  out.line("out    out %s (bf16 on a GPU); out[%lld,0:4] = %s", dims(s.out.data()).c_str(), (long long)r,
           values(s.out.data(), r).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void unpermute(State& s, const Printer& out) {
  s.out_in = leaf(s.out.data());
  s.y_routed = combine_grad_to_fp8(combine(s.out_in, s.d, Variable()));
  const std::vector<int64_t> rm = s.p.row_map.to_ints();
  out.line("math   y_routed[t] = Σ_j out[row_map[t,j]] in fp32, j ascending; no probs (SwiGLU applied them)");
  out.line("code   parallel/dispatch.cpp::combine -> engine/ops/unpermute.cpp::unpermute_unpad ->");
  out.line("       kernels/cpu/unpermute.cpp::unpermute_cpu");
  out.line("out    y_routed %s; pad and tail rows are never read", dims(s.y_routed.data()).c_str());
  out.line("out[%lld,0:4]      %s", (long long)rm[0], values(s.out.data(), rm[0]).c_str());
  out.line("out[%lld,0:4]     %s", (long long)rm[1], values(s.out.data(), rm[1]).c_str());
  out.line("y_routed[0,0:4] %s", values(s.y_routed.data(), 0).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

void combine(State& s, const Printer& out) {
  s.y_combined = s.y_routed;
  out.line("math   every expert output is already on its token's rank (expert-parallel size 1): combine is the");
  out.line("       unpermute + unpad of the last step; across ranks the rows first travel back to their tokens");
  out.line(
      "code   parallel/dispatch.cpp::combine; its backward will quantize dy once (layers/moe.cpp::CombineGradToFp8)");
  out.line("casts  %s", cast_summary().c_str());
}

void shared(State& s, const Printer& out) {
  s.x_shared = leaf(s.x);
  s.y_shared = s.layer->shared_experts()->forward(s.x_shared, DType::f32);
  s.y_routed_in = leaf(s.y_combined.data());
  s.y = add(s.y_routed_in, s.y_shared);
  out.line("math   y = y_routed + (silu(x·Wgᵀ)·(x·Wuᵀ))·Wdᵀ, the shared expert in high precision");
  out.line("code   layers/mlp.cpp::Mlp::forward, engine/ops/elementwise.cpp (add)");
  out.line("out    y %s; y_shared[0,0:4] = %s", dims(s.y.data()).c_str(), values(s.y_shared.data(), 0).c_str());
  out.line("y[0,0:4] = %s", values(s.y.data(), 0).c_str());
  out.line("casts  %s", cast_summary().c_str());
}

}  // namespace flowmoe::walk
