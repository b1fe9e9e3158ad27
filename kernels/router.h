// MoE router (DeepSeek-V3 "noaux_tc"): scoring, group-limited top-k, its backward, per-expert counts,
// the aux-loss-free bias update and the sequence-wise balance loss.
//   s = sigmoid(logits) | softmax(logits); c = s + expert_bias; group score = sum of the top-2 of c in
//   each of n_group groups; keep the topk_group best groups; top-k of c inside them; prob = s at the
//   chosen experts, / (sum + 1e-20) when norm_topk_prob and k > 1, then * routed_scaling_factor.
// CPU reference: kernels/cpu/router.cpp (f32, f64); CUDA: kernels/cuda/router.cu (f32, one warp per
// token). Node: engine/ops/router.cpp. Tests: tests/test_router.cpp.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/step_control.h"

#if defined(__CUDACC__)
#define FLOWMOE_ROUTER_HD __host__ __device__
#else
#define FLOWMOE_ROUTER_HD
#endif

namespace flowmoe {

enum class RouterScoring : uint8_t { sigmoid, softmax };
// How expert_bias moves after a step (model.bias_update_rule).
enum class BiasUpdateRule : uint8_t { sign, proportional };

// Limits of the CUDA kernel (one warp per token, at most 8 experts per lane). validate_router_config
// (engine/ops/router.h) enforces them on every backend and for the YAML config.
constexpr int kRouterMaxExperts = 256;
constexpr int kRouterMaxTopk = 16;
constexpr int kRouterMaxGroups = 16;
constexpr double kRouterNormEps = 1e-20;  // added to the sum of chosen scores, as HF does

struct RouterParams {
  int num_experts = 0;
  int top_k = 0;
  int n_group = 1;     // experts form n_group contiguous groups of num_experts / n_group
  int topk_group = 1;  // groups kept per token
  RouterScoring scoring = RouterScoring::sigmoid;
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
};

// Selection differs from HF's masked_fill(0.0) in one corner: experts of dropped groups can never be
// chosen, even when every key of a kept group is negative (possible with a negative bias).

// Ordering used by every top-k here, identical on CPU and GPU: larger key first, then the lower index.
// Keys pass through router_key first: NaN ranks as -inf, so the order stays total and deterministic.
template <class K>
FLOWMOE_ROUTER_HD inline bool router_better(K key_a, int idx_a, K key_b, int idx_b) {
  return key_a > key_b || (key_a == key_b && idx_a < idx_b);
}
template <class K>
FLOWMOE_ROUTER_HD inline K router_key(K v) {
  return v != v ? K(-INFINITY) : v;
}

// The sigmoid is evaluated in double and rounded once, so the CPU and the GPU produce the same float
// score (they differ only when the double lands within 1 ulp(double) of a float rounding boundary).
template <class T>
FLOWMOE_ROUTER_HD inline T router_sigmoid(T logit) {
  return T(1.0 / (1.0 + exp(-double(logit))));
}

#undef FLOWMOE_ROUTER_HD

// ---- CPU reference (T = float or double; the bias is always fp32) -------------------------------

// Scores, selection, probabilities and counts (tokens_per_expert is overwritten, not accumulated).
template <class T>
void router_topk_cpu(const RouterParams& p, const T* logits /*[num_tokens, E]*/, const float* expert_bias /*[E]*/,
                     int64_t num_tokens, int32_t* topk_idx /*[num_tokens, k]*/, T* topk_prob /*[num_tokens, k]*/,
                     int32_t* tokens_per_expert /*[E]*/);
// d_logits from d_topk_prob with the selection held fixed (zero at experts that were not chosen for
// sigmoid; softmax spreads it over the row).
template <class T>
void router_topk_backward_cpu(const RouterParams& p, const T* logits /*[num_tokens, E]*/,
                              const int32_t* topk_idx /*[num_tokens, k]*/, const T* d_topk_prob /*[num_tokens, k]*/,
                              int64_t num_tokens, T* d_logits /*[num_tokens, E]*/);

// Sequence-wise balance loss (DeepSeek-V3 L_Bal): tokens form num_tokens / seq_len sequences; per
// sequence f_i = E / (k * seq_len) * (tokens choosing i), P_i = mean over its tokens of s_i / sum_j s_j;
// loss = alpha * mean over sequences of sum_i f_i * P_i. Differentiable through P only.
template <class T>
void router_balance_loss_cpu(const RouterParams& p, const T* logits /*[num_tokens, E]*/,
                             const int32_t* topk_idx /*[num_tokens, k]*/, int64_t num_tokens, int64_t seq_len,
                             double alpha, T* loss /*[1]*/);
template <class T>
void router_balance_loss_backward_cpu(const RouterParams& p, const T* logits /*[num_tokens, E]*/,
                                      const int32_t* topk_idx /*[num_tokens, k]*/, int64_t num_tokens, int64_t seq_len,
                                      double alpha, const T* d_loss /*[1]*/, T* d_logits /*[num_tokens, E]*/);

// sign:         bias_e += rate * sign(mean_load - load_e), compared exactly as sign(sum_load - E * load_e);
// proportional: bias_e += rate * (mean_load - load_e) / mean_load = rate * (sum_load - E * load_e) / sum_load,
//               computed in double and rounded once to f32. No tokens: nothing moves.
void expert_bias_update_cpu(float* expert_bias /*[E]*/, const int32_t* tokens_per_expert /*[E]*/, int num_experts,
                            double rate, BiasUpdateRule rule = BiasUpdateRule::sign);
// total_e += counts_e (counts of several micro-batches before one bias update).
void add_tokens_per_expert_cpu(int32_t* total /*[E]*/, const int32_t* counts /*[E]*/, int num_experts);

// ---- CUDA (f32 logits and probabilities; no host synchronisation) ------------------------------

void router_topk_cuda(const RouterParams& p, const float* logits /*[num_tokens, E]*/, const float* expert_bias /*[E]*/,
                      int64_t num_tokens, int32_t* topk_idx /*[num_tokens, k]*/, float* topk_prob /*[num_tokens, k]*/,
                      int32_t* tokens_per_expert /*[E]*/, cudaStream_t stream);
void router_topk_backward_cuda(const RouterParams& p, const float* logits /*[num_tokens, E]*/,
                               const int32_t* topk_idx /*[num_tokens, k]*/,
                               const float* d_topk_prob /*[num_tokens, k]*/, int64_t num_tokens,
                               float* d_logits /*[num_tokens, E]*/, cudaStream_t stream);
// Workspaces: seq_counts [num_tokens / seq_len, E] i32; token_loss [num_tokens] f32 (forward only).
void router_balance_loss_cuda(const RouterParams& p, const float* logits /*[num_tokens, E]*/,
                              const int32_t* topk_idx /*[num_tokens, k]*/, int64_t num_tokens, int64_t seq_len,
                              double alpha, int32_t* seq_counts, float* token_loss, float* loss /*[1]*/,
                              cudaStream_t stream);
void router_balance_loss_backward_cuda(const RouterParams& p, const float* logits /*[num_tokens, E]*/,
                                       const int32_t* topk_idx /*[num_tokens, k]*/, int64_t num_tokens, int64_t seq_len,
                                       double alpha, const float* d_loss /*[1]*/, int32_t* seq_counts,
                                       float* d_logits /*[num_tokens, E]*/, cudaStream_t stream);
void expert_bias_update_cuda(float* expert_bias /*[E]*/, const int32_t* tokens_per_expert /*[E]*/, int num_experts,
                             double rate, BiasUpdateRule rule, cudaStream_t stream);
// The same at rate × control->bias_rate_scale, read on the device (0 on a skipped step: nothing moves).
void expert_bias_update_scheduled_cuda(float* expert_bias /*[E]*/, const int32_t* tokens_per_expert /*[E]*/,
                                       int num_experts, double rate, BiasUpdateRule rule,
                                       const StepScalars* control /*[1] device*/, cudaStream_t stream);
void add_tokens_per_expert_cuda(int32_t* total /*[E]*/, const int32_t* counts /*[E]*/, int num_experts,
                                cudaStream_t stream);

}  // namespace flowmoe
