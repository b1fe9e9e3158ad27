// Device SiLU in fp32, shared by kernels/cuda/silu.cu and kernels/cuda/swiglu.cu so the fused
// SwiGLU computes silu(gate) with exactly the instructions the silu kernel uses.
#pragma once

namespace flowmoe {

__device__ __forceinline__ float sigmoid_f32(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_f32(float x) { return x * sigmoid_f32(x); }
__device__ __forceinline__ float silu_grad_f32(float x) {  // d silu / dx
  float s = sigmoid_f32(x);
  return s + x * s * (1.f - s);
}

}  // namespace flowmoe
