// AdamW update and the gradient-norm reduction used for clipping, on f32 buffers.
//   g = grad_scale * grad;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p - lr * (m / bc1 / (sqrt(v / bc2) + eps) + weight_decay * p)      (bc = 1 - beta^t)
// One function computes an element (adamw_element, below) on the host and the device alike; the device spells
// each operation out, so nvcc contracts none into an FMA, and the CPU reference and the kernel agree bit for bit.
// copy (optional): the model's weights as the forward reads them, written from the updated p in their dtype
// (f32, or bf16 rounded to nearest even) beside the f32 master, so nothing casts them again before use.
// moments: f32, or bf16 (optimizer.moment_dtype, as DeepSeek-V3 trains): loaded to f32, updated in f32 and
// rounded back STOCHASTICALLY (kernels/stochastic_round.h) from a hash of (seed, update t, tensor, element).
// Round-to-nearest would freeze v: with beta2 = 0.95..0.999 its relative change per step, (1 - b2)(g^2/v - 1),
// is often below bf16's half ulp (2^-9), so v would round back to itself every step and stop tracking g^2;
// stochastic rounding moves it by the right amount in expectation. A range of a tensor (a sharded optimizer's)
// rounds as the whole tensor does: the hash takes the element's index in the tensor.
// multi: many tensors, each with its own step, copy and moments, in one launch per kTensorsPerLaunch (an
// optimizer's parameters); each element's math is the one-tensor update's, so the bits are too. The kernel
// reads and writes 8 elements per thread in 16-byte accesses where the tensor's buffers are 16-byte aligned,
// one at a time otherwise and for the tail.
// sum_squares: out = sum_i x[i]^2 (sum_values: sum_i x[i]), deterministic: a fixed two-pass tree,
// no atomics, so the same input always gives the same bits. CPU reference: kernels/cpu/adamw.cpp;
// CUDA: kernels/cuda/adamw.cu; optimizer: train/optimizer.cpp; tests: tests/test_adamw.cpp, test_adamw_multi.cpp,
// test_bf16_moments.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"
#include "kernels/step_control.h"
#include "kernels/stochastic_round.h"

namespace flowmoe {

struct AdamWStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  float grad_scale = 1;                              // clipping factor applied to the gradient
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta1^t, 1 - beta2^t
  uint32_t update = 0;                               // t (1-based): bf16 moments' rounding draws from it
};

// Where an update also writes the weights' copy (null data: no copy).
struct WeightCopy {
  void* data = nullptr;  // [n] of dtype
  DType dtype = DType::f32;
};

// The update of a scheduled step (kernels/step_control.h): base's betas, eps and weight decay with the
// step's lr × lr_multiplier, clip factor and bias corrections, as the host would convert them to float.
FLOWMOE_HOST_DEVICE inline AdamWStep scheduled_adamw_step(AdamWStep base, const StepScalars& c, double lr_multiplier) {
  base.lr = float(c.lr * lr_multiplier);
  base.grad_scale = float(c.grad_scale);
  base.bias_correction1 = c.bias_correction1;
  base.bias_correction2 = c.bias_correction2;
  base.update = uint32_t(c.num_updates);
  return base;
}

// Where a tensor's bf16 moments draw their rounding (kernels/stochastic_round.h).
struct MomentRounding {
  uint64_t key = 0;         // rounding_key(seed, the tensor's id)
  int64_t first_index = 0;  // element 0's index in the tensor: a range's begin, so a shard rounds as the whole
};

// Float operations the device may not contract into FMAs (an x86-64 host build has no FMA to contract into,
// unless FLOWMOE_NATIVE asks for the host's instructions).
FLOWMOE_HOST_DEVICE inline float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
FLOWMOE_HOST_DEVICE inline float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
FLOWMOE_HOST_DEVICE inline float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
FLOWMOE_HOST_DEVICE inline float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
FLOWMOE_HOST_DEVICE inline float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// One element's update (the formula above), in f32 on the host and the device alike.
FLOWMOE_HOST_DEVICE inline void adamw_element(float& p, float& m, float& v, float grad, const AdamWStep& s) {
  const float g = mul_rn(s.grad_scale, grad);
  m = add_rn(mul_rn(s.beta1, m), mul_rn(sub_rn(1.0f, s.beta1), g));
  v = add_rn(mul_rn(s.beta2, v), mul_rn(mul_rn(sub_rn(1.0f, s.beta2), g), g));
  const float update = div_rn(div_rn(m, s.bias_correction1), add_rn(sqrt_rn(div_rn(v, s.bias_correction2)), s.eps));
  p = sub_rn(p, mul_rn(s.lr, add_rn(update, mul_rn(s.weight_decay, p))));
}

// Element `index` of a tensor's moments rounded to bf16 from one draw of the hash of the tensor's stream
// (rounding_stream(key, t)): m from its low 32 bits, v from its high 32.
FLOWMOE_HOST_DEVICE inline void round_moments_bf16(float m, float v, uint64_t stream, int64_t index, uint16_t* m_out,
                                                   uint16_t* v_out) {
  const uint64_t r = rounding_bits(stream, uint64_t(index));
  *m_out = bf16_bits_stochastic(m, uint32_t(r));
  *v_out = bf16_bits_stochastic(v, uint32_t(r >> 32));
}

// One tensor of a multi-tensor update: its f32 weights and gradient, its moments, its own step and its copy.
// (The fields' order keeps a launch's table of kTensorsPerLaunch within the kernel parameters' 4 KiB.)
struct AdamWTensor {
  float* param = nullptr;  // [n] the weights (the master where a copy is written)
  const float* grad = nullptr;
  void* exp_avg = nullptr;  // [n] of moment_dtype
  void* exp_avg_sq = nullptr;
  int64_t n = 0;
  AdamWStep step;                   // the whole step; with step scalars, the base (betas, eps, weight decay)
  DType moment_dtype = DType::f32;  // f32 or bf16
  double lr_multiplier = 1.0;       // with step scalars: lr = the scalars' lr × this (an MoE router's scale)
  WeightCopy copy;
  MomentRounding rounding;  // bf16 moments
};

// Tensors a multi-tensor launch takes (its table travels as the kernel's parameters, within 4 KiB).
constexpr int kTensorsPerLaunch = 32;
// Blocks of the first reduction pass of one sum; a one-sum `partials` must hold this many floats.
constexpr int kReduceMaxBlocks = 1024;

// exp_avg, exp_avg_sq: [n] of moment_dtype (f32 or bf16).
void adamw_cpu(float* param /*[n]*/, const float* grad /*[n]*/, void* exp_avg, void* exp_avg_sq, int64_t n,
               const AdamWStep& s, WeightCopy copy = {}, DType moment_dtype = DType::f32, MomentRounding rounding = {});
// adamw_cpu over each tensor. control (host memory), when given: nothing changes unless control->apply, and each
// tensor steps with scheduled_adamw_step(its step, *control, its lr_multiplier).
void adamw_multi_cpu(const AdamWTensor* tensors /*[num_tensors]*/, int64_t num_tensors,
                     const StepScalars* control = nullptr);
// Accumulates in double, in index order.
double sum_squares_cpu(const float* x /*[n]*/, int64_t n);

void adamw_cuda(float* param /*[n]*/, const float* grad /*[n]*/, void* exp_avg, void* exp_avg_sq, int64_t n,
                const AdamWStep& s, cudaStream_t stream, WeightCopy copy = {}, DType moment_dtype = DType::f32,
                MomentRounding rounding = {});
// The same with the step's scalars read on the device: nothing changes unless control->apply, else
// scheduled_adamw_step(base, *control, lr_multiplier) (a skipped step writes no copy either). No host
// synchronisation.
void adamw_scheduled_cuda(float* param /*[n]*/, const float* grad /*[n]*/, void* exp_avg, void* exp_avg_sq, int64_t n,
                          const AdamWStep& base, const StepScalars* control /*[1] device*/, double lr_multiplier,
                          cudaStream_t stream, WeightCopy copy = {}, DType moment_dtype = DType::f32,
                          MomentRounding rounding = {});
// The same as adamw_multi_cpu on the GPU (tensors: a host table of device buffers; control: device memory or
// null), one launch per kTensorsPerLaunch tensors, no host synchronisation.
void adamw_multi_cuda(const AdamWTensor* tensors /*[num_tensors]*/, int64_t num_tensors,
                      const StepScalars* control /*[1] device, or null*/, cudaStream_t stream);

// One sum of a multi-tensor reduction: *out (one device float) = the sum over x's n elements.
struct SumSlice {
  const float* x = nullptr;  // [n] device
  int64_t n = 0;
  float* out = nullptr;  // [1] device
};
// Each slice's sum of squares (sum_values_multi_cuda: of values), bit for bit what sum_squares_cuda gives it
// alone, in two launches per kTensorsPerLaunch slices.
void sum_squares_multi_cuda(const SumSlice* slices /*[num_slices]*/, int64_t num_slices,
                            float* partials /*[kTensorsPerLaunch * kReduceMaxBlocks]*/, cudaStream_t stream);
void sum_values_multi_cuda(const SumSlice* slices /*[num_slices]*/, int64_t num_slices,
                           float* partials /*[kTensorsPerLaunch * kReduceMaxBlocks]*/, cudaStream_t stream);
// *out (one device float) = sum of x[i]^2; partials: device scratch of kReduceMaxBlocks floats.
void sum_squares_cuda(const float* x /*[n]*/, int64_t n, float* out /*[1]*/, float* partials /*[kReduceMaxBlocks]*/,
                      cudaStream_t stream);
// *out = sum of x[i] (used to add up per-tensor squared norms).
void sum_values_cuda(const float* x /*[n]*/, int64_t n, float* out /*[1]*/, float* partials /*[kReduceMaxBlocks]*/,
                     cudaStream_t stream);

}  // namespace flowmoe
