// MoE router on the GPU (DeepSeek-V3 "noaux_tc"), one warp per token, lane l holding experts l + 32i.
//   forward:  s = sigmoid | softmax(logits), key = s + bias; group score = top-2 sum of keys per group;
//             topk_group groups, then top-k keys among them (larger key first, ties to the lower index);
//             prob = s / (sum + 1e-20) (norm_topk_prob, k > 1) * routed_scaling_factor; counts by atomics.
//   backward: d_logits from d_topk_prob with the selection fixed. Balance loss: per-token terms, then a
//             fixed-order block sum (deterministic). Bias update: bias_e += rate * sign(mean - load_e), or
//             rate * (mean - load_e) / mean (rule proportional).
// Shapes: logits [T,E] f32; E, k and n_group within the limits of kernels/router.h (kRouterMax*).
// CPU reference: kernels/cpu/router.cpp.
// Tests: tests/test_router.cpp.
#include <climits>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/router.h"

namespace flowmoe {

namespace {

constexpr int kWarpsPerBlock = 8;
constexpr int kMaxPerLane = kRouterMaxExperts / 32;
constexpr unsigned kFull = 0xffffffffu;

// ---- kernels ----------------------------------------------------------------------------------

__device__ __forceinline__ double warp_sum_d(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// A candidate in a warp-wide argmax. Empty slots carry (-inf, INT_MAX) and lose to any real entry.
struct Cand {
  float key;
  int idx;
  float raw;  // the unbiased score that travels with the winner
};

// Every lane ends with the same winner: router_better is a strict total order on (key, idx).
__device__ __forceinline__ Cand warp_argmax(Cand c) {
  for (int o = 16; o > 0; o >>= 1) {
    Cand other{__shfl_xor_sync(kFull, c.key, o), __shfl_xor_sync(kFull, c.idx, o), __shfl_xor_sync(kFull, c.raw, o)};
    if (router_better(other.key, other.idx, c.key, c.idx)) c = other;
  }
  return c;
}

// Row statistics for softmax scoring (max and sum of exp in double); unused for sigmoid.
struct RowStats {
  float max;
  double sum;
};

__device__ __forceinline__ float score_of(RouterScoring scoring, float logit, RowStats st) {
  if (scoring == RouterScoring::sigmoid) return router_sigmoid(logit);
  return float(exp(double(logit) - double(st.max)) / st.sum);
}

// Loads this lane's logits of one token and turns them into scores; every lane gets the row stats.
__device__ __forceinline__ RowStats lane_scores(RouterScoring scoring, const float* __restrict__ row, int E, int lane,
                                                float (&l)[kMaxPerLane], float (&s)[kMaxPerLane]) {
  RowStats st{-INFINITY, 0.0};
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    int e = lane + 32 * i;
    l[i] = e < E ? row[e] : -INFINITY;
  }
  if (scoring == RouterScoring::softmax) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) m = fmaxf(m, l[i]);
    st.max = warp_max(m);
    double z = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      if (lane + 32 * i < E) z += exp(double(l[i]) - double(st.max));
    st.sum = warp_sum_d(z);
  }
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) s[i] = lane + 32 * i < E ? score_of(scoring, l[i], st) : 0.f;
  return st;
}

__global__ void router_topk_kernel(RouterParams p, float scale, const float* __restrict__ logits,
                                   const float* __restrict__ bias, int64_t num_tokens, int32_t* __restrict__ topk_idx,
                                   float* __restrict__ topk_prob, int32_t* __restrict__ counts) {
  extern __shared__ float keys_smem[];  // [kWarpsPerBlock, E]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, E = p.num_experts, k = p.top_k;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= num_tokens) return;  // whole warps leave; only warp-level sync below
  float* keys = keys_smem + warp * E;
  const int group_size = E / p.n_group;

  float l[kMaxPerLane], s[kMaxPerLane], key[kMaxPerLane];
  lane_scores(p.scoring, logits + t * E, E, lane, l, s);
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    int e = lane + 32 * i;
    key[i] = e < E ? router_key(s[i] + bias[e]) : -INFINITY;
    if (e < E) keys[e] = key[i];
  }

  // Groups: lane g scores group g serially (top-2 sum), then topk_group rounds of warp argmax.
  uint32_t kept = 1u;
  if (p.n_group > 1) {
    __syncwarp();
    kept = 0u;
    float group_score = -INFINITY;
    if (lane < p.n_group) {
      float top1 = -INFINITY, top2 = -INFINITY;
      for (int e = lane * group_size; e < (lane + 1) * group_size; ++e) {
        float v = keys[e];
        if (v > top1)
          top2 = top1, top1 = v;
        else if (v > top2)
          top2 = v;
      }
      group_score = router_key(group_size >= 2 ? top1 + top2 : top1);
    }
    for (int r = 0; r < p.topk_group; ++r) {
      bool open = lane < p.n_group && !((kept >> lane) & 1u);
      Cand c = warp_argmax(open ? Cand{group_score, lane, 0.f} : Cand{-INFINITY, INT_MAX, 0.f});
      kept |= 1u << c.idx;
    }
  }
  uint32_t eligible = 0u;  // bit i: expert lane + 32i exists and sits in a kept group
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    int e = lane + 32 * i;
    if (e < E && ((kept >> (e / group_size)) & 1u)) eligible |= 1u << i;
  }

  // Experts: k rounds of warp argmax; the sum of chosen scores runs in selection order, as on the CPU.
  float sum = 0.f, my_s = 0.f;
  int my_idx = 0;
  for (int j = 0; j < k; ++j) {
    Cand c{-INFINITY, INT_MAX, 0.f};
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      int e = lane + 32 * i;
      if (((eligible >> i) & 1u) && router_better(key[i], e, c.key, c.idx)) c = Cand{key[i], e, s[i]};
    }
    c = warp_argmax(c);
    if ((c.idx & 31) == lane) eligible &= ~(1u << (c.idx >> 5));
    sum = sum + c.raw;
    if (lane == j) my_idx = c.idx, my_s = c.raw;
  }
  if (lane < k) {
    float w = my_s;
    if (p.norm_topk_prob && k > 1) w = w / (sum + float(kRouterNormEps));
    topk_idx[t * k + lane] = my_idx;
    topk_prob[t * k + lane] = w * scale;
    atomicAdd(&counts[my_idx], 1);
  }
}

// Scatters this warp's per-chosen-slot values (lanes < k) into per-expert registers (0 elsewhere).
__device__ __forceinline__ void gather_chosen(int k, int lane, int my_idx, double my_val, double (&out)[kMaxPerLane]) {
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) out[i] = 0.0;
  for (int j = 0; j < k; ++j) {
    int idx = __shfl_sync(kFull, my_idx, j);
    double v = __shfl_sync(kFull, my_val, j);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      if (idx == lane + 32 * i) out[i] = v;
  }
}

// d_logits of a row given d_s per expert (sigmoid: d_s * s(1-s); softmax: s * (d_s - sum d_s s)).
__device__ __forceinline__ void write_d_logits(RouterScoring scoring, const float (&s)[kMaxPerLane],
                                               const double (&d_s)[kMaxPerLane], int E, int lane,
                                               float* __restrict__ d_row) {
  double dot = 0;
  if (scoring == RouterScoring::softmax) {
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) dot += d_s[i] * double(s[i]);
    dot = warp_sum_d(dot);
  }
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    int e = lane + 32 * i;
    if (e >= E) continue;
    double si = s[i];
    d_row[e] = float(scoring == RouterScoring::sigmoid ? d_s[i] * si * (1.0 - si) : si * (d_s[i] - dot));
  }
}

__global__ void router_topk_backward_kernel(RouterParams p, double scale, const float* __restrict__ logits,
                                            const int32_t* __restrict__ topk_idx, const float* __restrict__ d_prob,
                                            int64_t num_tokens, float* __restrict__ d_logits) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, E = p.num_experts, k = p.top_k;
  const int64_t t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (t >= num_tokens) return;
  const float* row = logits + t * E;
  float l[kMaxPerLane], s[kMaxPerLane];
  RowStats st = lane_scores(p.scoring, row, E, lane, l, s);

  int my_idx = lane < k ? topk_idx[t * k + lane] : -1;
  double my_s = lane < k ? double(score_of(p.scoring, row[my_idx], st)) : 0.0;
  double d_w = lane < k ? double(d_prob[t * k + lane]) : 0.0;
  // w_j = c * s_j / S, S = sum of chosen s + eps: d_s_j = c * (d_w_j - sum_i d_w_i s_i / S) / S.
  double sum = warp_sum_d(my_s) + kRouterNormEps, dot = warp_sum_d(d_w * my_s);
  double d_s = p.norm_topk_prob && k > 1 ? scale * (d_w - dot / sum) / sum : scale * d_w;
  double d_s_e[kMaxPerLane];
  gather_chosen(k, lane, my_idx, d_s, d_s_e);
  write_d_logits(p.scoring, s, d_s_e, E, lane, d_logits + t * E);
}

__global__ void seq_counts_kernel(const int32_t* __restrict__ topk_idx, int64_t num_tokens, int k, int64_t seq_len,
                                  int E, int32_t* __restrict__ seq_counts) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < num_tokens * k;
       i += int64_t(gridDim.x) * blockDim.x)
    atomicAdd(&seq_counts[(i / k) / seq_len * E + topk_idx[i]], 1);
}

// The balance loss's per-token start, forward and backward alike: warp w of block b takes token
// t = b * kWarpsPerBlock + w (false past the last), its lanes' scores and its sequence's expert counts.
struct BalanceToken {
  int64_t t;
  float s[kMaxPerLane];
  const int32_t* count;
};
__device__ __forceinline__ bool balance_token(const RouterParams& p, const float* __restrict__ logits,
                                              int64_t num_tokens, int64_t seq_len,
                                              const int32_t* __restrict__ seq_counts, BalanceToken& tok) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, E = p.num_experts;
  tok.t = int64_t(blockIdx.x) * kWarpsPerBlock + warp;
  if (tok.t >= num_tokens) return false;
  float l[kMaxPerLane];
  lane_scores(p.scoring, logits + tok.t * E, E, lane, l, tok.s);
  tok.count = seq_counts + tok.t / seq_len * E;
  return true;
}

// Per token: coef * sum_e count[b,e] * s_e / Z, with coef = alpha / B * E / (k S) / S.
__global__ void balance_token_kernel(RouterParams p, double coef, const float* __restrict__ logits, int64_t num_tokens,
                                     int64_t seq_len, const int32_t* __restrict__ seq_counts,
                                     float* __restrict__ token_loss) {
  const int lane = threadIdx.x & 31, E = p.num_experts;
  BalanceToken tok;
  if (!balance_token(p, logits, num_tokens, seq_len, seq_counts, tok)) return;
  double z = 0, acc = 0;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    int e = lane + 32 * i;
    if (e < E) z += tok.s[i], acc += double(tok.count[e]) * tok.s[i];
  }
  z = warp_sum_d(z), acc = warp_sum_d(acc);
  if (lane == 0) token_loss[tok.t] = float(coef * acc / z);
}

// One block: each thread sums a fixed stride of tokens, then a fixed tree; same bits every run.
__global__ void sum_tokens_kernel(const float* __restrict__ token_loss, int64_t num_tokens, float* __restrict__ loss) {
  __shared__ float scratch[32];
  float v = 0.f;
  for (int64_t t = threadIdx.x; t < num_tokens; t += blockDim.x) v += token_loss[t];
  v = block_sum(v, scratch);
  if (threadIdx.x == 0) loss[0] = v;
}

__global__ void balance_backward_kernel(RouterParams p, double coef, const float* __restrict__ logits,
                                        int64_t num_tokens, int64_t seq_len, const int32_t* __restrict__ seq_counts,
                                        const float* __restrict__ d_loss, float* __restrict__ d_logits) {
  const int lane = threadIdx.x & 31, E = p.num_experts;
  BalanceToken tok;
  if (!balance_token(p, logits, num_tokens, seq_len, seq_counts, tok)) return;
  const double c = coef * double(d_loss[0]);
  double g[kMaxPerLane], d_s[kMaxPerLane], z = 0, dot = 0;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    int e = lane + 32 * i;
    g[i] = e < E ? c * double(tok.count[e]) : 0.0;  // dL/ds'_e, s' = s / Z
    z += tok.s[i], dot += g[i] * tok.s[i];
  }
  z = warp_sum_d(z), dot = warp_sum_d(dot) / z;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) d_s[i] = (g[i] - dot) / z;
  write_d_logits(p.scoring, tok.s, d_s, E, lane, d_logits + tok.t * E);
}

// control: null for a rate given by value, else the rate is scaled by the step's bias_rate_scale.
__global__ void expert_bias_update_kernel(float* __restrict__ bias, const int32_t* __restrict__ counts, int E,
                                          double rate, BiasUpdateRule rule, const StepScalars* __restrict__ control) {
  if (control) rate *= control->bias_rate_scale;
  __shared__ unsigned long long total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  unsigned long long part = 0;
  for (int e = threadIdx.x; e < E; e += blockDim.x) part += unsigned(counts[e]);
  atomicAdd(&total, part);  // integer sum: order-independent
  __syncthreads();
  if (total == 0) return;
  const float r = float(rate);
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    long long diff = (long long)total - (long long)E * counts[e];  // (mean - load) * E, exactly
    if (rule == BiasUpdateRule::sign)
      bias[e] += diff > 0 ? r : (diff < 0 ? -r : 0.f);
    else  // the same double arithmetic as the CPU reference, so the two agree bit for bit
      bias[e] += float(__ddiv_rn(__dmul_rn(rate, double(diff)), double(total)));
  }
}

__global__ void add_counts_kernel(int32_t* __restrict__ total, const int32_t* __restrict__ counts, int E) {
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < E; e += gridDim.x * blockDim.x) total[e] += counts[e];
}

void check_params(const RouterParams& p, const char* what) {
  FLOWMOE_CHECK(p.num_experts >= 1 && p.num_experts <= kRouterMaxExperts, ShapeError, what, ": num_experts ",
                p.num_experts, " outside [1, ", kRouterMaxExperts, "]");
  FLOWMOE_CHECK(p.top_k >= 1 && p.top_k <= kRouterMaxTopk, ShapeError, what, ": top_k ", p.top_k, " outside [1, ",
                kRouterMaxTopk, "]");
  FLOWMOE_CHECK(p.n_group >= 1 && p.n_group <= kRouterMaxGroups && p.num_experts % p.n_group == 0, ShapeError, what,
                ": n_group ", p.n_group, " must divide num_experts ", p.num_experts, " and be <= ", kRouterMaxGroups);
  FLOWMOE_CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group && p.top_k <= p.topk_group * (p.num_experts / p.n_group),
                ShapeError, what, ": topk_group ", p.topk_group, " cannot hold top_k ", p.top_k);
}

unsigned token_blocks(int64_t num_tokens) { return unsigned((num_tokens + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void router_topk_cuda(const RouterParams& p, const float* logits, const float* expert_bias, int64_t num_tokens,
                      int32_t* topk_idx, float* topk_prob, int32_t* tokens_per_expert, cudaStream_t stream) {
  check_params(p, "router_topk_cuda");
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(tokens_per_expert, 0, sizeof(int32_t) * size_t(p.num_experts), stream));
  if (num_tokens == 0) return;
  size_t smem = sizeof(float) * size_t(kWarpsPerBlock) * size_t(p.num_experts);
  router_topk_kernel<<<token_blocks(num_tokens), kWarpsPerBlock * 32, smem, stream>>>(
      p, float(p.routed_scaling_factor), logits, expert_bias, num_tokens, topk_idx, topk_prob, tokens_per_expert);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void router_topk_backward_cuda(const RouterParams& p, const float* logits, const int32_t* topk_idx,
                               const float* d_topk_prob, int64_t num_tokens, float* d_logits, cudaStream_t stream) {
  check_params(p, "router_topk_backward_cuda");
  if (num_tokens == 0) return;
  router_topk_backward_kernel<<<token_blocks(num_tokens), kWarpsPerBlock * 32, 0, stream>>>(
      p, double(float(p.routed_scaling_factor)), logits, topk_idx, d_topk_prob, num_tokens, d_logits);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

// Loss = sum over tokens of alpha / B * E / (k S^2) * sum_e count[b(t), e] * s'_{t,e}.
static double balance_coef(const RouterParams& p, int64_t num_tokens, int64_t seq_len, double alpha) {
  double S = double(seq_len), B = double(num_tokens / seq_len);
  return alpha / B * double(p.num_experts) / (double(p.top_k) * S) / S;
}

void router_balance_loss_cuda(const RouterParams& p, const float* logits, const int32_t* topk_idx, int64_t num_tokens,
                              int64_t seq_len, double alpha, int32_t* seq_counts, float* token_loss, float* loss,
                              cudaStream_t stream) {
  check_params(p, "router_balance_loss_cuda");
  const int64_t S = seq_len > 0 ? seq_len : num_tokens;
  FLOWMOE_CHECK(S == 0 || num_tokens % S == 0, ShapeError, "router_balance_loss_cuda: ", num_tokens,
                " tokens are not whole sequences of ", S);
  if (num_tokens > 0) {
    FLOWMOE_CUDA_CHECK(
        cudaMemsetAsync(seq_counts, 0, sizeof(int32_t) * size_t(num_tokens / S * p.num_experts), stream));
    seq_counts_kernel<<<grid_size(num_tokens * p.top_k, 256), 256, 0, stream>>>(topk_idx, num_tokens, p.top_k, S,
                                                                                p.num_experts, seq_counts);
    FLOWMOE_CUDA_CHECK_LAUNCH();
    balance_token_kernel<<<token_blocks(num_tokens), kWarpsPerBlock * 32, 0, stream>>>(
        p, balance_coef(p, num_tokens, S, alpha), logits, num_tokens, S, seq_counts, token_loss);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  }
  sum_tokens_kernel<<<1, 1024, 0, stream>>>(token_loss, num_tokens, loss);  // writes 0 for no tokens
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void router_balance_loss_backward_cuda(const RouterParams& p, const float* logits, const int32_t* topk_idx,
                                       int64_t num_tokens, int64_t seq_len, double alpha, const float* d_loss,
                                       int32_t* seq_counts, float* d_logits, cudaStream_t stream) {
  check_params(p, "router_balance_loss_backward_cuda");
  const int64_t S = seq_len > 0 ? seq_len : num_tokens;
  FLOWMOE_CHECK(S == 0 || num_tokens % S == 0, ShapeError, "router_balance_loss_backward_cuda: ", num_tokens,
                " tokens are not whole sequences of ", S);
  if (num_tokens == 0) return;
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(seq_counts, 0, sizeof(int32_t) * size_t(num_tokens / S * p.num_experts), stream));
  seq_counts_kernel<<<grid_size(num_tokens * p.top_k, 256), 256, 0, stream>>>(topk_idx, num_tokens, p.top_k, S,
                                                                              p.num_experts, seq_counts);
  FLOWMOE_CUDA_CHECK_LAUNCH();
  balance_backward_kernel<<<token_blocks(num_tokens), kWarpsPerBlock * 32, 0, stream>>>(
      p, balance_coef(p, num_tokens, S, alpha), logits, num_tokens, S, seq_counts, d_loss, d_logits);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void expert_bias_update_cuda(float* expert_bias, const int32_t* tokens_per_expert, int num_experts, double rate,
                             BiasUpdateRule rule, cudaStream_t stream) {
  if (num_experts == 0) return;
  expert_bias_update_kernel<<<1, 256, 0, stream>>>(expert_bias, tokens_per_expert, num_experts, rate, rule, nullptr);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void expert_bias_update_scheduled_cuda(float* expert_bias, const int32_t* tokens_per_expert, int num_experts,
                                       double rate, BiasUpdateRule rule, const StepScalars* control,
                                       cudaStream_t stream) {
  FLOWMOE_CHECK(control, Error, "expert_bias_update_scheduled_cuda: null step scalars");
  if (num_experts == 0) return;
  expert_bias_update_kernel<<<1, 256, 0, stream>>>(expert_bias, tokens_per_expert, num_experts, rate, rule, control);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void add_tokens_per_expert_cuda(int32_t* total, const int32_t* counts, int num_experts, cudaStream_t stream) {
  if (num_experts == 0) return;
  add_counts_kernel<<<grid_size(num_experts, 256), 256, 0, stream>>>(total, counts, num_experts);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
