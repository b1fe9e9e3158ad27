// CPU reference for rotary position embedding (see kernels/rope.h).
#include <cmath>

#include "kernels/rope.h"

namespace flowmoe {

namespace {

// Rotates every pair by +angle (forward) or -angle (backward: the inverse rotation).
template <class T>
void rope_rotate_cpu(T* out, const T* x, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
                     double theta, int64_t pos_offset, double direction) {
  const int64_t half = head_dim / 2;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < seq_len; ++t) {
      const double pos = double(pos_offset + t);
      for (int64_t i = 0; i < half; ++i) {
        const double angle = pos * std::pow(theta, -2.0 * double(i) / double(head_dim));
        const T c = T(std::cos(angle)), s = T(direction * std::sin(angle));
        for (int64_t h = 0; h < num_heads; ++h) {
          const int64_t base = ((b * seq_len + t) * num_heads + h) * head_dim + 2 * i;
          const T x0 = x[base], x1 = x[base + 1];
          out[base] = x0 * c - x1 * s;
          out[base + 1] = x0 * s + x1 * c;
        }
      }
    }
}

}  // namespace

template <class T>
void rope_forward_cpu(T* out, const T* x, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
                      double theta, int64_t pos_offset) {
  rope_rotate_cpu(out, x, batch, seq_len, num_heads, head_dim, theta, pos_offset, 1.0);
}

template <class T>
void rope_backward_cpu(T* d_x, const T* d_out, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
                       double theta, int64_t pos_offset) {
  rope_rotate_cpu(d_x, d_out, batch, seq_len, num_heads, head_dim, theta, pos_offset, -1.0);
}

template <class T>
void rope_qk_forward_cpu(T* q_out, T* k_out, const T* q, const T* k, int64_t batch, int64_t seq_len, int64_t q_heads,
                         int64_t k_heads, int64_t head_dim, double theta, int64_t pos_offset) {
  rope_forward_cpu(q_out, q, batch, seq_len, q_heads, head_dim, theta, pos_offset);
  rope_forward_cpu(k_out, k, batch, seq_len, k_heads, head_dim, theta, pos_offset);
}

template <class T>
void rope_qk_backward_cpu(T* d_q, T* d_k, const T* d_q_out, const T* d_k_out, int64_t batch, int64_t seq_len,
                          int64_t q_heads, int64_t k_heads, int64_t head_dim, double theta, int64_t pos_offset) {
  rope_backward_cpu(d_q, d_q_out, batch, seq_len, q_heads, head_dim, theta, pos_offset);
  rope_backward_cpu(d_k, d_k_out, batch, seq_len, k_heads, head_dim, theta, pos_offset);
}

template void rope_forward_cpu<float>(float*, const float*, int64_t, int64_t, int64_t, int64_t, double, int64_t);
template void rope_forward_cpu<double>(double*, const double*, int64_t, int64_t, int64_t, int64_t, double, int64_t);
template void rope_backward_cpu<float>(float*, const float*, int64_t, int64_t, int64_t, int64_t, double, int64_t);
template void rope_backward_cpu<double>(double*, const double*, int64_t, int64_t, int64_t, int64_t, double, int64_t);
#define FLOWMOE_ROPE_QK_CPU(T)                                                                                   \
  template void rope_qk_forward_cpu<T>(T*, T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t,  \
                                       double, int64_t);                                                         \
  template void rope_qk_backward_cpu<T>(T*, T*, const T*, const T*, int64_t, int64_t, int64_t, int64_t, int64_t, \
                                        double, int64_t);
FLOWMOE_ROPE_QK_CPU(float)
FLOWMOE_ROPE_QK_CPU(double)
#undef FLOWMOE_ROPE_QK_CPU

}  // namespace flowmoe
