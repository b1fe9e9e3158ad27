// AdamW update and the gradient-norm reduction used for clipping, on f32 buffers.
//   g = grad_scale * grad;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p - lr * (m / bc1 / (sqrt(v / bc2) + eps) + weight_decay * p)      (bc = 1 - beta^t)
// copy (optional): the model's weights as the forward reads them, written from the updated p in their dtype
// (f32, or bf16 rounded to nearest even) beside the f32 master, so nothing casts them again before use.
// multi: many tensors, each with its own step and copy, in one launch per kTensorsPerLaunch (an optimizer's
// parameters); each element's math is the one-tensor update's, so the bits are too.
// sum_squares: out = sum_i x[i]^2 (sum_values: sum_i x[i]), deterministic: a fixed two-pass tree,
// no atomics, so the same input always gives the same bits. CPU reference: kernels/cpu/adamw.cpp;
// CUDA: kernels/cuda/adamw.cu; optimizer: train/optimizer.cpp; tests: tests/test_adamw.cpp, test_adamw_multi.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"
#include "kernels/step_control.h"

namespace flowmoe {

struct AdamWStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  float grad_scale = 1;                              // clipping factor applied to the gradient
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta1^t, 1 - beta2^t
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
  return base;
}

// One tensor of a multi-tensor update: its f32 buffers, its own step and its copy.
struct AdamWTensor {
  float* param = nullptr;  // [n] the weights (the master where a copy is written)
  const float* grad = nullptr;
  float* exp_avg = nullptr;
  float* exp_avg_sq = nullptr;
  int64_t n = 0;
  AdamWStep step;              // the whole step; with step scalars, the base (betas, eps, weight decay)
  double lr_multiplier = 1.0;  // with step scalars: lr = the scalars' lr × this (an MoE router's scale)
  WeightCopy copy;
};

// Tensors a multi-tensor launch takes (its table travels as the kernel's parameters, within 4 KiB).
constexpr int kTensorsPerLaunch = 32;
// Blocks of the first reduction pass of one sum; a one-sum `partials` must hold this many floats.
constexpr int kReduceMaxBlocks = 1024;

void adamw_cpu(float* param /*[n]*/, const float* grad /*[n]*/, float* exp_avg /*[n]*/, float* exp_avg_sq /*[n]*/,
               int64_t n, const AdamWStep& s, WeightCopy copy = {});
// adamw_cpu over each tensor. control (host memory), when given: nothing changes unless control->apply, and each
// tensor steps with scheduled_adamw_step(its step, *control, its lr_multiplier).
void adamw_multi_cpu(const AdamWTensor* tensors /*[num_tensors]*/, int64_t num_tensors,
                     const StepScalars* control = nullptr);
// Accumulates in double, in index order.
double sum_squares_cpu(const float* x /*[n]*/, int64_t n);

void adamw_cuda(float* param /*[n]*/, const float* grad /*[n]*/, float* exp_avg /*[n]*/, float* exp_avg_sq /*[n]*/,
                int64_t n, const AdamWStep& s, cudaStream_t stream, WeightCopy copy = {});
// The same with the step's scalars read on the device: nothing changes unless control->apply, else
// scheduled_adamw_step(base, *control, lr_multiplier) (a skipped step writes no copy either). No host
// synchronisation.
void adamw_scheduled_cuda(float* param /*[n]*/, const float* grad /*[n]*/, float* exp_avg /*[n]*/,
                          float* exp_avg_sq /*[n]*/, int64_t n, const AdamWStep& base,
                          const StepScalars* control /*[1] device*/, double lr_multiplier, cudaStream_t stream,
                          WeightCopy copy = {});
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
