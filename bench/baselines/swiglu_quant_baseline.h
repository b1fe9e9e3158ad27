// The unfused SwiGLU + FP8 quantize that bench/bench_swiglu_quant.cpp measures the fused kernels of
// kernels/swiglu_quant.h against: the prob product, the d_prob row dot and a plain rowwise quantize as
// separate launches, each a full pass over memory. Kernels: bench/baselines/swiglu_quant_baseline.cu, linked
// into bench_swiglu_quant only (bench/CMakeLists.txt), never into a flowmoe library.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// out[r,:] = x[r,:] * row_scale[r] (dtype f32 or bf16, fp32 math; out may be x).
void swiglu_quant_baseline_row_scale_cuda(DType dtype, void* out /*[M, K]*/, const void* x /*[M, K]*/,
                                          const float* row_scale /*[M]*/, int64_t M, int64_t K, cudaStream_t stream);
// out[r] = sum_k a[r,k] * b[r,k] in fp32 (dtype f32 or bf16).
void swiglu_quant_baseline_row_dot_cuda(DType dtype, float* out /*[M]*/, const void* a /*[M, K]*/,
                                        const void* b /*[M, K]*/, int64_t M, int64_t K, cudaStream_t stream);
// A plain rowwise 1x128 quantize (one warp per block, scalar loads): what a separate cast kernel costs.
void swiglu_quant_baseline_quantize_cuda(DType dtype, const void* x /*[M, K]*/, int64_t M, int64_t K,
                                         uint8_t* q /*[M, K] e4m3*/, float* scale_inv /*[M, ceil(K/128)]*/,
                                         cudaStream_t stream);

}  // namespace flowmoe
