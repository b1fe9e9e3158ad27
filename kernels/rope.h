// Rotary position embedding. For x [batch, seq_len, num_heads, head_dim] (head_dim even), each pair
// (x[2i], x[2i+1]) of a head at position pos = pos_offset + t turns by angle pos * theta^(-2i/head_dim):
//   out[2i] = x[2i] cos - x[2i+1] sin,   out[2i+1] = x[2i] sin + x[2i+1] cos.
// The backward is the inverse rotation of d_out. Angles and their cos/sin are computed in double on
// both backends (then rounded), so CPU f32 and GPU f32 agree to an ulp or two at any position.
// CPU reference: kernels/cpu/rope.cpp (f32, f64); CUDA: kernels/cuda/rope.cu (f32, bf16, fp32 math).
// Node: engine/ops/rope.cpp. Tests: tests/test_rope.cpp.
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

// dtype f32 or bf16; head_dim even.
void rope_forward_cuda(DType dtype, void* out /*[batch, seq_len, num_heads, head_dim]*/, const void* x /*[same]*/,
                       int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim, double theta,
                       int64_t pos_offset, cudaStream_t stream);
void rope_backward_cuda(DType dtype, void* d_x /*[batch, seq_len, num_heads, head_dim]*/, const void* d_out /*[same]*/,
                        int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim, double theta,
                        int64_t pos_offset, cudaStream_t stream);

}  // namespace flowmoe
