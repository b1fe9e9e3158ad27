// Fused SwiGLU (optionally x prob) + rowwise 1x128 FP8 quantize, forward and backward (DESIGN.md §2).
//   forward:  a[r,j] = (silu(g) * u) * p,  g = h[r,j], u = h[r,F+j], p = prob[r] (1 when prob is null)
//             q [M,F] e4m3 and scale_inv [M, ceil(F/128)] quantize a rowwise (kernels/fp8.h).
//   backward: dy = d_a * p;  d_g = (dy * u) * silu'(g);  d_u = dy * silu(g);  d_prob[r] = sum_j d_a * (silu(g) * u)
//             d_h = [d_g | d_u] [M,2F], quantized rowwise over its 2F columns (blocks may straddle
//             the gate/up seam) or written unquantized in the input dtype. The quantize is straight-through.
// fp32 math, products in this order on both backends. CPU reference (kernels/cpu/swiglu_quant.cpp) is the
// composition of swiglu_*_cpu, the prob product and the fp8.h quantize; CUDA: kernels/cuda/swiglu_quant.cu.
// With counted rows (kernels/common/counted_rows.h) the CUDA kernels compute only the rows the counts cover.
// Node: engine/ops/swiglu_quant.cpp. Tests: tests/test_swiglu_quant.cpp. Bench: bench/bench_swiglu_quant.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/counted_rows.h"
#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// dtype f32 or bf16 (bf16 as raw bits) for h. prob may be null.
void swiglu_quant_forward_cpu(DType dtype, const void* h /*[M, 2F]*/, const float* prob /*[M] or null*/, int64_t M,
                              int64_t F, uint8_t* q /*[M, F] e4m3*/, float* scale_inv /*[M, ceil(F/128)]*/);
void swiglu_quant_forward_cuda(DType dtype, const void* h /*[M, 2F]*/, const float* prob /*[M] or null*/, int64_t M,
                               int64_t F, uint8_t* q /*[M, F] e4m3*/, float* scale_inv /*[M, ceil(F/128)]*/,
                               cudaStream_t stream, CountedRows counted = {});

// d_a and h share dtype (f32 or bf16). Each output is written when its pointer is non-null:
// d_h_q + d_h_scale_inv (quantized d_h), d_h (d_h in dtype), d_prob (f32; with prob null it is the
// gradient of an implicit all-ones prob). Any subset may be asked for, none of d_h_q / d_h included.
void swiglu_quant_backward_cpu(DType dtype, const void* d_a /*[M, F]*/, const void* h /*[M, 2F]*/,
                               const float* prob /*[M] or null*/, int64_t M, int64_t F,
                               uint8_t* d_h_q /*[M, 2F] e4m3 or null*/,
                               float* d_h_scale_inv /*[M, ceil(2F/128)] or null*/, void* d_h /*[M, 2F] or null*/,
                               float* d_prob /*[M] or null*/);
void swiglu_quant_backward_cuda(DType dtype, const void* d_a /*[M, F]*/, const void* h /*[M, 2F]*/,
                                const float* prob /*[M] or null*/, int64_t M, int64_t F,
                                uint8_t* d_h_q /*[M, 2F] e4m3 or null*/,
                                float* d_h_scale_inv /*[M, ceil(2F/128)] or null*/, void* d_h /*[M, 2F] or null*/,
                                float* d_prob /*[M] or null*/, cudaStream_t stream, CountedRows counted = {});

}  // namespace flowmoe
