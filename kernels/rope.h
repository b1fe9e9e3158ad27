// Rotary position embedding. For x [batch, seq_len, num_heads, head_dim] (head_dim even), each pair
// (x[2i], x[2i+1]) of a head at position pos = pos_offset + t turns by angle pos * theta^(-2i/head_dim):
//   out[2i] = x[2i] cos - x[2i+1] sin,   out[2i+1] = x[2i] sin + x[2i+1] cos.
// The backward is the inverse rotation of d_out. Angles and their cos/sin are computed in double on
// both backends (then rounded), so CPU f32 and GPU f32 agree to an ulp or two at any position.
// rope_qk_* rotate an attention's queries and keys in one pass (one launch on the GPU, which computes each row's
// angles once for both): the rows, head_dim and positions are shared, the head counts may differ (MLA's one rope
// key beside its query heads); each result is the single tensor's rope bit for bit.
// CPU reference: kernels/cpu/rope.cpp (f32, f64; rope_qk_* the composition); CUDA: kernels/cuda/rope.cu
// (f32, bf16, fp32 math). Node: engine/ops/rope.cpp. Tests: tests/test_rope.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

template <class T>
void rope_forward_cpu(T* out /*[batch, seq_len, num_heads, head_dim]*/, const T* x /*[same]*/, int64_t batch,
                      int64_t seq_len, int64_t num_heads, int64_t head_dim, double theta, int64_t pos_offset);
template <class T>
void rope_backward_cpu(T* d_x /*[batch, seq_len, num_heads, head_dim]*/, const T* d_out /*[same]*/, int64_t batch,
                       int64_t seq_len, int64_t num_heads, int64_t head_dim, double theta, int64_t pos_offset);

// q [batch, seq_len, q_heads, head_dim] and k [batch, seq_len, k_heads, head_dim]; outputs of their shapes.
template <class T>
void rope_qk_forward_cpu(T* q_out, T* k_out, const T* q, const T* k, int64_t batch, int64_t seq_len, int64_t q_heads,
                         int64_t k_heads, int64_t head_dim, double theta, int64_t pos_offset);
template <class T>
void rope_qk_backward_cpu(T* d_q, T* d_k, const T* d_q_out, const T* d_k_out, int64_t batch, int64_t seq_len,
                          int64_t q_heads, int64_t k_heads, int64_t head_dim, double theta, int64_t pos_offset);

// dtype f32 or bf16; head_dim even.
void rope_forward_cuda(DType dtype, void* out /*[batch, seq_len, num_heads, head_dim]*/, const void* x /*[same]*/,
                       int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim, double theta,
                       int64_t pos_offset, cudaStream_t stream);
void rope_backward_cuda(DType dtype, void* d_x /*[batch, seq_len, num_heads, head_dim]*/, const void* d_out /*[same]*/,
                        int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim, double theta,
                        int64_t pos_offset, cudaStream_t stream);
void rope_qk_forward_cuda(DType dtype, void* q_out /*[batch, seq_len, q_heads, head_dim]*/,
                          void* k_out /*[batch, seq_len, k_heads, head_dim]*/, const void* q /*[same as q_out]*/,
                          const void* k /*[same as k_out]*/, int64_t batch, int64_t seq_len, int64_t q_heads,
                          int64_t k_heads, int64_t head_dim, double theta, int64_t pos_offset, cudaStream_t stream);
void rope_qk_backward_cuda(DType dtype, void* d_q /*[batch, seq_len, q_heads, head_dim]*/,
                           void* d_k /*[batch, seq_len, k_heads, head_dim]*/, const void* d_q_out /*[same as d_q]*/,
                           const void* d_k_out /*[same as d_k]*/, int64_t batch, int64_t seq_len, int64_t q_heads,
                           int64_t k_heads, int64_t head_dim, double theta, int64_t pos_offset, cudaStream_t stream);

}  // namespace flowmoe
