// AdamW update and deterministic sum-of-squares reduction on the GPU (math in kernels/adamw.h).
//   adamw:        one thread per element (grid-stride), f32 params, grads and moments, fp32 math; the
//                 weights' copy (kernels/adamw.h) in C = float or bf16, or none.
//   sum_squares:  pass 1 - each of G <= kReduceMaxBlocks blocks reduces a grid-stride slice to
//                 partials[block]; pass 2 - one block adds the G partials. G depends on n only, and
//                 no atomics are used, so a given input always gives the same bits.
// CPU reference: kernels/cpu/adamw.cpp. Tests: tests/test_adamw.cpp.
#include <cuda_bf16.h>

#include "kernels/adamw.h"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

// control: null for a step given by value, else the step's scalars on the device (kernels/step_control.h).
// copy: null, or the weights' copy to write.
template <class C>
__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ exp_avg,
                             float* __restrict__ exp_avg_sq, int64_t n, AdamWStep s,
                             const StepScalars* __restrict__ control, double lr_multiplier, C* __restrict__ copy) {
  if (control) {
    if (!control->apply) return;  // a skipped step: parameters and moments stay as they are
    s = scheduled_adamw_step(s, *control, lr_multiplier);
  }
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float g = s.grad_scale * grad[i];
    float m = s.beta1 * exp_avg[i] + (1.0f - s.beta1) * g;
    float v = s.beta2 * exp_avg_sq[i] + (1.0f - s.beta2) * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    float update = (m / s.bias_correction1) / (sqrtf(v / s.bias_correction2) + s.eps);
    float p = param[i];
    p = p - s.lr * (update + s.weight_decay * p);
    param[i] = p;
    if (copy) copy[i] = from_float<C>(p);
  }
}

template <bool kSquare>
__global__ void reduce_partials_kernel(const float* __restrict__ x, int64_t n, float* __restrict__ partials) {
  __shared__ float scratch[32];
  float acc = 0.f;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    float v = x[i];
    acc += kSquare ? v * v : v;
  }
  acc = block_sum(acc, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// One block of kReduceMaxBlocks threads: thread t holds partials[t] (or 0).
__global__ void reduce_final_kernel(const float* __restrict__ partials, int num_partials, float* __restrict__ out) {
  __shared__ float scratch[32];
  float v = int(threadIdx.x) < num_partials ? partials[threadIdx.x] : 0.f;
  v = block_sum(v, scratch);
  if (threadIdx.x == 0) *out = v;
}

// ---- launchers --------------------------------------------------------------------------------

// Picks the kernel for the copy's dtype.
static void launch_adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                         const AdamWStep& s, const StepScalars* control, double lr_multiplier, WeightCopy copy,
                         cudaStream_t stream, const char* what) {
  FLOWMOE_CHECK(n >= 0, Error, what, ": negative size ", n);
  if (n == 0) return;
  FLOWMOE_CHECK(param && grad && exp_avg && exp_avg_sq, Error, what, ": null buffer for ", n, " elements");
  const int threads = 256, blocks = grid_size(n, threads);
  if (copy.data && copy.dtype == DType::bf16)
    adamw_kernel<<<blocks, threads, 0, stream>>>(param, grad, exp_avg, exp_avg_sq, n, s, control, lr_multiplier,
                                                 static_cast<__nv_bfloat16*>(copy.data));
  else if (copy.data && copy.dtype == DType::f32)
    adamw_kernel<<<blocks, threads, 0, stream>>>(param, grad, exp_avg, exp_avg_sq, n, s, control, lr_multiplier,
                                                 static_cast<float*>(copy.data));
  else if (!copy.data)
    adamw_kernel<<<blocks, threads, 0, stream>>>(param, grad, exp_avg, exp_avg_sq, n, s, control, lr_multiplier,
                                                 static_cast<float*>(nullptr));
  else
    FLOWMOE_THROW(DTypeError, what, ": a weight copy in ", dtype_name(copy.dtype), " (f32 or bf16)");
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void adamw_cuda(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamWStep& s,
                cudaStream_t stream, WeightCopy copy) {
  launch_adamw(param, grad, exp_avg, exp_avg_sq, n, s, nullptr, 1.0, copy, stream, "adamw_cuda");
}

void adamw_scheduled_cuda(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                          const AdamWStep& base, const StepScalars* control, double lr_multiplier, cudaStream_t stream,
                          WeightCopy copy) {
  FLOWMOE_CHECK(control, Error, "adamw_scheduled_cuda: null step scalars");
  launch_adamw(param, grad, exp_avg, exp_avg_sq, n, base, control, lr_multiplier, copy, stream, "adamw_scheduled_cuda");
}

template <bool kSquare>
static void reduce_cuda(const float* x, int64_t n, float* out, float* partials, cudaStream_t stream) {
  FLOWMOE_CHECK(n >= 0, Error, "sum reduction: negative size ", n);
  FLOWMOE_CHECK(out && partials, Error, "sum reduction: null output or scratch");
  const int threads = 256;
  int64_t want = (n + threads * 4 - 1) / (threads * 4);  // about 4 elements per thread
  int blocks = int(want < kReduceMaxBlocks ? want : kReduceMaxBlocks);
  if (blocks > 0) {
    reduce_partials_kernel<kSquare><<<blocks, threads, 0, stream>>>(x, n, partials);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  }
  reduce_final_kernel<<<1, kReduceMaxBlocks, 0, stream>>>(partials, blocks, out);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void sum_squares_cuda(const float* x, int64_t n, float* out, float* partials, cudaStream_t stream) {
  reduce_cuda<true>(x, n, out, partials, stream);
}

void sum_values_cuda(const float* x, int64_t n, float* out, float* partials, cudaStream_t stream) {
  reduce_cuda<false>(x, n, out, partials, stream);
}

}  // namespace flowmoe
