// CPU reference for the MoE router (see kernels/router.h): plain loops over tokens, the same
// selection order and float operations as the CUDA kernel, so f32 outputs agree bit for bit.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/router.h"

namespace flowmoe {

namespace {

// Scores of one token: sigmoid per expert, or softmax over the row (exp and sum in double).
template <class T>
void scores_row(RouterScoring scoring, const T* logits /*[E]*/, int num_experts, T* s /*[E]*/) {
  if (scoring == RouterScoring::sigmoid) {
    for (int e = 0; e < num_experts; ++e) s[e] = router_sigmoid(logits[e]);
    return;
  }
  T m = T(-INFINITY);
  for (int e = 0; e < num_experts; ++e)
    if (logits[e] > m) m = logits[e];
  std::vector<double> z(static_cast<size_t>(num_experts));
  double total = 0;
  for (int e = 0; e < num_experts; ++e) total += z[size_t(e)] = std::exp(double(logits[e]) - double(m));
  for (int e = 0; e < num_experts; ++e) s[e] = T(z[size_t(e)] / total);
}

// Backward of scores_row given the scores s and their cotangent d_s; writes d_logits.
template <class T>
void scores_row_backward(RouterScoring scoring, const T* s /*[E]*/, const double* d_s /*[E]*/, int num_experts,
                         T* d_logits /*[E]*/) {
  if (scoring == RouterScoring::sigmoid) {
    for (int e = 0; e < num_experts; ++e) d_logits[e] = T(d_s[e] * double(s[e]) * (1.0 - double(s[e])));
    return;
  }
  double dot = 0;
  for (int e = 0; e < num_experts; ++e) dot += d_s[e] * double(s[e]);
  for (int e = 0; e < num_experts; ++e) d_logits[e] = T(double(s[e]) * (d_s[e] - dot));
}

}  // namespace

template <class T>
void router_topk_cpu(const RouterParams& p, const T* logits, const float* expert_bias, int64_t num_tokens,
                     int32_t* topk_idx, T* topk_prob, int32_t* tokens_per_expert) {
  const int E = p.num_experts, k = p.top_k, group_size = p.num_experts / p.n_group;
  std::vector<T> s(static_cast<size_t>(E)), key(static_cast<size_t>(E)), group_score(static_cast<size_t>(p.n_group));
  std::vector<char> group_kept(static_cast<size_t>(p.n_group)), taken(static_cast<size_t>(E));
  std::fill(tokens_per_expert, tokens_per_expert + E, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    scores_row(p.scoring, logits + t * E, E, s.data());
    for (int e = 0; e < E; ++e) key[size_t(e)] = router_key(T(s[size_t(e)] + T(expert_bias[e])));

    // Group score: sum of the group's two largest keys (the one key when a group has one expert).
    std::fill(group_kept.begin(), group_kept.end(), char(p.n_group == 1));
    if (p.n_group > 1) {
      for (int g = 0; g < p.n_group; ++g) {
        T top1 = T(-INFINITY), top2 = T(-INFINITY);
        for (int e = g * group_size; e < (g + 1) * group_size; ++e) {
          T v = key[size_t(e)];
          if (v > top1)
            top2 = top1, top1 = v;
          else if (v > top2)
            top2 = v;
        }
        group_score[size_t(g)] = router_key(group_size >= 2 ? T(top1 + top2) : top1);
      }
      for (int r = 0; r < p.topk_group; ++r) {
        int best = -1;
        for (int g = 0; g < p.n_group; ++g)
          if (!group_kept[size_t(g)] &&
              (best < 0 || router_better(group_score[size_t(g)], g, group_score[size_t(best)], best)))
            best = g;
        group_kept[size_t(best)] = 1;
      }
    }

    // Top-k experts inside the kept groups, best first; probabilities from the unbiased scores.
    std::fill(taken.begin(), taken.end(), char(0));
    T sum = T(0);
    int32_t* idx_row = topk_idx + t * k;
    T* prob_row = topk_prob + t * k;
    for (int j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < E; ++e)
        if (group_kept[size_t(e / group_size)] && !taken[size_t(e)] &&
            (best < 0 || router_better(key[size_t(e)], e, key[size_t(best)], best)))
          best = e;
      taken[size_t(best)] = 1;
      idx_row[j] = best;
      prob_row[j] = s[size_t(best)];
      sum = T(sum + s[size_t(best)]);
      tokens_per_expert[best] += 1;
    }
    const bool norm = p.norm_topk_prob && k > 1;
    for (int j = 0; j < k; ++j) {
      T w = prob_row[j];
      if (norm) w = T(w / T(sum + T(kRouterNormEps)));
      prob_row[j] = T(w * T(p.routed_scaling_factor));
    }
  }
}

template <class T>
void router_topk_backward_cpu(const RouterParams& p, const T* logits, const int32_t* topk_idx, const T* d_topk_prob,
                              int64_t num_tokens, T* d_logits) {
  const int E = p.num_experts, k = p.top_k;
  const double scale = double(T(p.routed_scaling_factor));
  const bool norm = p.norm_topk_prob && k > 1;
  std::vector<T> s(static_cast<size_t>(E));
  std::vector<double> d_s(static_cast<size_t>(E));
  for (int64_t t = 0; t < num_tokens; ++t) {
    scores_row(p.scoring, logits + t * E, E, s.data());
    const int32_t* idx = topk_idx + t * k;
    const T* d_w = d_topk_prob + t * k;
    // w_j = c * s_j / S with S = sum of chosen s + eps: d_s_i = c * (d_w_i - sum_j d_w_j s_j / S) / S.
    double sum = kRouterNormEps, dot = 0;
    for (int j = 0; j < k; ++j) sum += double(s[size_t(idx[j])]), dot += double(d_w[j]) * double(s[size_t(idx[j])]);
    std::fill(d_s.begin(), d_s.end(), 0.0);
    for (int j = 0; j < k; ++j)
      d_s[size_t(idx[j])] = norm ? scale * (double(d_w[j]) - dot / sum) / sum : scale * double(d_w[j]);
    scores_row_backward(p.scoring, s.data(), d_s.data(), E, d_logits + t * E);
  }
}

template <class T>
void router_balance_loss_cpu(const RouterParams& p, const T* logits, const int32_t* topk_idx, int64_t num_tokens,
                             int64_t seq_len, double alpha, T* loss) {
  const int E = p.num_experts, k = p.top_k;
  const int64_t S = seq_len > 0 ? seq_len : num_tokens;
  const int64_t num_seqs = S > 0 ? num_tokens / S : 0;
  std::vector<T> s(static_cast<size_t>(E));
  std::vector<double> P(static_cast<size_t>(E));
  std::vector<int64_t> count(static_cast<size_t>(E));
  double total = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    std::fill(P.begin(), P.end(), 0.0);
    std::fill(count.begin(), count.end(), 0);
    for (int64_t t = b * S; t < (b + 1) * S; ++t) {
      scores_row(p.scoring, logits + t * E, E, s.data());
      double z = 0;
      for (int e = 0; e < E; ++e) z += double(s[size_t(e)]);
      for (int e = 0; e < E; ++e) P[size_t(e)] += double(s[size_t(e)]) / z / double(S);
      for (int j = 0; j < k; ++j) count[size_t(topk_idx[t * k + j])] += 1;
    }
    for (int e = 0; e < E; ++e) total += double(E) / (double(k) * double(S)) * double(count[size_t(e)]) * P[size_t(e)];
  }
  loss[0] = T(num_seqs > 0 ? alpha * total / double(num_seqs) : 0.0);
}

template <class T>
void router_balance_loss_backward_cpu(const RouterParams& p, const T* logits, const int32_t* topk_idx,
                                      int64_t num_tokens, int64_t seq_len, double alpha, const T* d_loss, T* d_logits) {
  const int E = p.num_experts, k = p.top_k;
  const int64_t S = seq_len > 0 ? seq_len : num_tokens;
  const int64_t num_seqs = S > 0 ? num_tokens / S : 0;
  std::vector<T> s(static_cast<size_t>(E));
  std::vector<double> g(static_cast<size_t>(E)), d_s(static_cast<size_t>(E));
  std::vector<int64_t> count(static_cast<size_t>(E));
  for (int64_t b = 0; b < num_seqs; ++b) {
    std::fill(count.begin(), count.end(), 0);
    for (int64_t t = b * S; t < (b + 1) * S; ++t)
      for (int j = 0; j < k; ++j) count[size_t(topk_idx[t * k + j])] += 1;
    // dL/ds'_{t,e} = d_loss * alpha / B * f_e / S, with s' = s / Z the normalized scores.
    for (int e = 0; e < E; ++e)
      g[size_t(e)] = double(d_loss[0]) * alpha / double(num_seqs) * double(E) / (double(k) * double(S)) *
                     double(count[size_t(e)]) / double(S);
    for (int64_t t = b * S; t < (b + 1) * S; ++t) {
      scores_row(p.scoring, logits + t * E, E, s.data());
      double z = 0, dot = 0;
      for (int e = 0; e < E; ++e) z += double(s[size_t(e)]);
      for (int e = 0; e < E; ++e) dot += g[size_t(e)] * double(s[size_t(e)]) / z;
      for (int e = 0; e < E; ++e) d_s[size_t(e)] = (g[size_t(e)] - dot) / z;
      scores_row_backward(p.scoring, s.data(), d_s.data(), E, d_logits + t * E);
    }
  }
}

void expert_bias_update_cpu(float* expert_bias, const int32_t* tokens_per_expert, int num_experts, double rate,
                            BiasUpdateRule rule) {
  int64_t sum = 0;
  for (int e = 0; e < num_experts; ++e) sum += tokens_per_expert[e];
  if (sum == 0) return;
  const float r = float(rate);
  for (int e = 0; e < num_experts; ++e) {
    int64_t diff = sum - int64_t(num_experts) * tokens_per_expert[e];  // (mean - load) * E, exactly
    if (rule == BiasUpdateRule::sign)
      expert_bias[e] += diff > 0 ? r : (diff < 0 ? -r : 0.f);
    else
      expert_bias[e] += float(rate * double(diff) / double(sum));
  }
}

void add_tokens_per_expert_cpu(int32_t* total, const int32_t* counts, int num_experts) {
  for (int e = 0; e < num_experts; ++e) total[e] += counts[e];
}

#define FLOWMOE_ROUTER_INSTANTIATE(T)                                                                                \
  template void router_topk_cpu<T>(const RouterParams&, const T*, const float*, int64_t, int32_t*, T*, int32_t*);    \
  template void router_topk_backward_cpu<T>(const RouterParams&, const T*, const int32_t*, const T*, int64_t, T*);   \
  template void router_balance_loss_cpu<T>(const RouterParams&, const T*, const int32_t*, int64_t, int64_t, double,  \
                                           T*);                                                                      \
  template void router_balance_loss_backward_cpu<T>(const RouterParams&, const T*, const int32_t*, int64_t, int64_t, \
                                                    double, const T*, T*);
FLOWMOE_ROUTER_INSTANTIATE(float)
FLOWMOE_ROUTER_INSTANTIATE(double)
#undef FLOWMOE_ROUTER_INSTANTIATE

}  // namespace flowmoe
