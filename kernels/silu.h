// SiLU: y = x * sigmoid(x); dx = dy * (s + x * s * (1 - s)) with s = sigmoid(x).
// CPU reference: kernels/cpu/silu.cpp (f32 and f64); CUDA: kernels/cuda/silu.cu (f32 and bf16, fp32
// math). Node: engine/ops/silu.cpp. Tests: tests/test_silu.cpp. swiglu's reference reuses the
// scalar functions below, so it is the composition of silu and mul bit for bit.
#pragma once
#include <cmath>
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// One element of the reference, shared by silu_*_cpu and swiglu_*_cpu.
template <class T>
inline T silu_value(T x) {
  T s = T(1) / (T(1) + std::exp(-x));
  return x * s;
}
template <class T>
inline T silu_grad_value(T x) {  // d silu / dx
  T s = T(1) / (T(1) + std::exp(-x));
  return s + x * s * (T(1) - s);
}

template <class T>
void silu_forward_cpu(T* y /*[n]*/, const T* x /*[n]*/, int64_t n);
template <class T>
void silu_backward_cpu(T* d_x /*[n]*/, const T* d_y /*[n]*/, const T* x /*[n]*/, int64_t n);

// dtype f32 or bf16 (bf16 as raw bits, fp32 math, rounded to nearest even once).
void silu_forward_cuda(DType dtype, void* y /*[n]*/, const void* x /*[n]*/, int64_t n, cudaStream_t stream);
void silu_backward_cuda(DType dtype, void* d_x /*[n]*/, const void* d_y /*[n]*/, const void* x /*[n]*/, int64_t n,
                        cudaStream_t stream);

}  // namespace flowmoe
