// FP8 GroupedLinear GEMMs: e4m3 operands with power-of-two block scales (kernels/fp8.h), fp32 accumulation.
//   fprop  y[off_e : off_e+r_e] = x[off_e : off_e+r_e] · w[e]ᵀ   x 1x128 rowwise, w 128x128 blocks -> bf16/f32 y
//   dgrad  the same call with dy rowwise [m_total, n] and the transposed weight w_t [E, k, n] (block transpose)
//   wgrad  dw[e] (+)= dy_eᵀ · x_e, a sum over the expert's r_e rows; both operands colwise 1x128 over
//          segments = padded_tokens_per_expert (the scaling-aware transpose's output)
// Expert e owns rows [off_e, off_e + r_e), off = exclusive prefix sum of padded_tokens_per_expert (host values, read
// once per layer by the caller). CPU reference: kernels/cpu/fp8_grouped_linear.cpp (dequantize, f32 GEMM).
// CUDA: kernels/cuda/fp8_grouped_linear.cu (one cuBLASLt VEC128 / BLK128x128 call per expert).
// Tests: tests/test_fp8_grouped_linear.cpp. Benchmark: bench/bench_fp8_grouped_linear.cpp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// Bytes of the fprop/dgrad workspace: x's scales re-laid out per expert as cuBLASLt reads them
// ([k/128][r_e], rows contiguous: m_total · ceil(k/128) floats), then the weights' 128x128 scale grids
// with the K-block stride padded to a multiple of 4 ([E][n/128][round_up(k/128, 4)]): measured on the
// H200, cuBLASLt 13 reads BLK128x128 scales with that stride (k/128 = 2 or 11 gave wrong results).
size_t fp8_grouped_gemm_workspace_bytes(int64_t m_total, int64_t k, int64_t num_experts, int64_t n);

// ---- CPU reference ----------------------------------------------------------------------------
// Dequantizes each expert's operands (e4m3_to_f32(q) · scale_inv) to f32 and runs gemm_cpu (fp32
// accumulation); bf16 output is rounded to nearest even once. Any n, k >= 0 (partial blocks allowed) and
// any row counts; rows past sum(padded_tokens_per_expert) are written as zeros. out_dtype: bf16 or f32.
void fp8_grouped_gemm_cpu(DType out_dtype, const uint8_t* x /*[m_total, k] e4m3*/,
                          const float* x_scale_inv /*[m_total, ceil(k/128)]*/, const uint8_t* w /*[E, n, k] e4m3*/,
                          const float* w_scale_inv /*[E, ceil(n/128), ceil(k/128)]*/, void* y /*[m_total, n]*/,
                          const int64_t* padded_tokens_per_expert /*[E] host*/, int64_t num_experts, int64_t m_total,
                          int64_t n, int64_t k);
// dw f32; accumulate adds into dw (an expert with no rows then keeps dw[e]), otherwise it overwrites (an
// expert with no rows gets 0). num_blocks = Σ_e ceil(rows_e / 128).
void fp8_grouped_wgrad_cpu(const uint8_t* dy_t /*[n, m_total] e4m3*/, const float* dy_t_scale_inv /*[num_blocks, n]*/,
                           const uint8_t* x_t /*[k, m_total] e4m3*/, const float* x_t_scale_inv /*[num_blocks, k]*/,
                           float* dw /*[E, n, k]*/, const int64_t* padded_tokens_per_expert /*[E] host*/,
                           int64_t num_experts, int64_t m_total, int64_t n, int64_t k, bool accumulate);

// ---- CUDA launchers ---------------------------------------------------------------------------
// One cuBLASLt block-scaled GEMM per expert with rows, in expert order on `stream`, no host sync.
// Requirements (ShapeError naming the values): n and k multiples of 128; m_total and every row count
// multiples of 16 (permute_pad with align_size >= 16); device pointers 16-byte aligned.
// Host cost: a cached plan per exact problem; the algorithm is chosen per bucket of row counts.

// workspace: fp8_grouped_gemm_workspace_bytes(m_total, k, num_experts, n) bytes on the device (may be null when no
// expert has rows), used by the scale re-layout kernel that runs before the GEMMs on `stream`.
void fp8_grouped_gemm_cuda(DType out_dtype, const uint8_t* x /*[m_total, k] e4m3*/,
                           const float* x_scale_inv /*[m_total, k/128]*/, const uint8_t* w /*[E, n, k] e4m3*/,
                           const float* w_scale_inv /*[E, n/128, k/128]*/, void* y /*[m_total, n]*/,
                           const int64_t* padded_tokens_per_expert /*[E] host*/, int64_t num_experts, int64_t m_total,
                           int64_t n, int64_t k, void* workspace, cudaStream_t stream);
// The inner dimension of each expert's GEMM is its row count r_e (a multiple of 16, not necessarily of
// 128: the last 1x128 block is partial). If cuBLASLt refuses such a shape it throws CudaError saying so.
void fp8_grouped_wgrad_cuda(const uint8_t* dy_t /*[n, m_total] e4m3*/, const float* dy_t_scale_inv /*[num_blocks, n]*/,
                            const uint8_t* x_t /*[k, m_total] e4m3*/, const float* x_t_scale_inv /*[num_blocks, k]*/,
                            float* dw /*[E, n, k]*/, const int64_t* padded_tokens_per_expert /*[E] host*/,
                            int64_t num_experts, int64_t m_total, int64_t n, int64_t k, bool accumulate,
                            cudaStream_t stream);

}  // namespace flowmoe
