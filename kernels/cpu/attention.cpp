// CPU reference for causal attention (see kernels/attention.h): plain loops, one query row at a time,
// with the row's probabilities written out explicitly.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/attention.h"

namespace flowmoe {

namespace {

// Row i of (batch b, head h): probs[j] = softmax_j(q_i·k_j * scale) for j <= i.
template <class T>
void causal_probs(std::vector<T>& probs, const T* q, const T* k, int64_t b, int64_t h, int64_t i, int64_t seq_len,
                  int64_t num_heads, int64_t head_dim, T scale) {
  auto row = [&](int64_t t) { return ((b * seq_len + t) * num_heads + h) * head_dim; };
  const T* qi = q + row(i);
  T max_score = -INFINITY;
  for (int64_t j = 0; j <= i; ++j) {
    const T* kj = k + row(j);
    T dot = 0;
    for (int64_t d = 0; d < head_dim; ++d) dot += qi[d] * kj[d];
    probs[size_t(j)] = dot * scale;
    max_score = std::max(max_score, probs[size_t(j)]);
  }
  T total = 0;
  for (int64_t j = 0; j <= i; ++j) total += probs[size_t(j)] = std::exp(probs[size_t(j)] - max_score);
  for (int64_t j = 0; j <= i; ++j) probs[size_t(j)] /= total;
}

}  // namespace

template <class T>
void attention_forward_cpu(T* out, const T* q, const T* k, const T* v, int64_t batch, int64_t seq_len,
                           int64_t num_heads, int64_t head_dim, int64_t v_head_dim) {
  const T scale = T(1.0 / std::sqrt(double(head_dim)));
  std::vector<T> probs(static_cast<size_t>(seq_len));
  auto v_row = [&](int64_t b, int64_t t, int64_t h) { return ((b * seq_len + t) * num_heads + h) * v_head_dim; };
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < num_heads; ++h)
      for (int64_t i = 0; i < seq_len; ++i) {
        causal_probs(probs, q, k, b, h, i, seq_len, num_heads, head_dim, scale);
        T* oi = out + v_row(b, i, h);
        std::fill(oi, oi + v_head_dim, T(0));
        for (int64_t j = 0; j <= i; ++j) {
          const T* vj = v + v_row(b, j, h);
          for (int64_t d = 0; d < v_head_dim; ++d) oi[d] += probs[size_t(j)] * vj[d];
        }
      }
}

template <class T>
void attention_backward_cpu(T* d_q, T* d_k, T* d_v, const T* d_out, const T* q, const T* k, const T* v, int64_t batch,
                            int64_t seq_len, int64_t num_heads, int64_t head_dim, int64_t v_head_dim) {
  const T scale = T(1.0 / std::sqrt(double(head_dim)));
  const int64_t n = batch * seq_len * num_heads * head_dim, n_v = batch * seq_len * num_heads * v_head_dim;
  std::fill(d_q, d_q + n, T(0));
  std::fill(d_k, d_k + n, T(0));
  std::fill(d_v, d_v + n_v, T(0));
  std::vector<T> probs(static_cast<size_t>(seq_len)), d_probs(static_cast<size_t>(seq_len));
  auto row = [&](int64_t b, int64_t t, int64_t h) { return ((b * seq_len + t) * num_heads + h) * head_dim; };
  auto v_row = [&](int64_t b, int64_t t, int64_t h) { return ((b * seq_len + t) * num_heads + h) * v_head_dim; };
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < num_heads; ++h)
      for (int64_t i = 0; i < seq_len; ++i) {
        causal_probs(probs, q, k, b, h, i, seq_len, num_heads, head_dim, scale);
        const T* doi = d_out + v_row(b, i, h);
        // dP_ij = dO_i·v_j; the softmax backward subtracts sum_j P_ij dP_ij (= dO_i·o_i).
        T p_dot_dp = 0;
        for (int64_t j = 0; j <= i; ++j) {
          const T* vj = v + v_row(b, j, h);
          T dot = 0;
          for (int64_t d = 0; d < v_head_dim; ++d) dot += doi[d] * vj[d];
          d_probs[size_t(j)] = dot;
          p_dot_dp += probs[size_t(j)] * dot;
        }
        const T* qi = q + row(b, i, h);
        T* dqi = d_q + row(b, i, h);
        for (int64_t j = 0; j <= i; ++j) {
          const T p = probs[size_t(j)];
          const T d_score = p * (d_probs[size_t(j)] - p_dot_dp) * scale;
          const T* kj = k + row(b, j, h);
          T* dkj = d_k + row(b, j, h);
          T* dvj = d_v + v_row(b, j, h);
          for (int64_t d = 0; d < head_dim; ++d) {
            dqi[d] += d_score * kj[d];
            dkj[d] += d_score * qi[d];
          }
          for (int64_t d = 0; d < v_head_dim; ++d) dvj[d] += p * doi[d];
        }
      }
}

template void attention_forward_cpu<float>(float*, const float*, const float*, const float*, int64_t, int64_t, int64_t,
                                           int64_t, int64_t);
template void attention_forward_cpu<double>(double*, const double*, const double*, const double*, int64_t, int64_t,
                                            int64_t, int64_t, int64_t);
template void attention_backward_cpu<float>(float*, float*, float*, const float*, const float*, const float*,
                                            const float*, int64_t, int64_t, int64_t, int64_t, int64_t);
template void attention_backward_cpu<double>(double*, double*, double*, const double*, const double*, const double*,
                                             const double*, int64_t, int64_t, int64_t, int64_t, int64_t);

}  // namespace flowmoe
