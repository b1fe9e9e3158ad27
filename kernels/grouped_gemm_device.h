// Grouped GEMMs in one launch with the per-expert row counts read on the device: the GEMMs of
// kernels/grouped_linear.h (bf16) and kernels/fp8_grouped_linear.h (FP8 blockwise, same operands and scale
// layouts) without the host copy of the counts. Expert e owns rows [off_e, off_e + r_e), off = exclusive
// prefix sum of r = padded_tokens_per_expert, an int32 device array (what permute_pad writes).
//   fprop  y_e = x_e · w[e]ᵀ    dgrad  dx_e = dy_e · w[e]    wgrad  dw[e] (+)= dy_eᵀ · x_e (fp32; r_e = 0: 0 or kept)
// Each launcher runs, on `stream`, a kernel that scans the counts into the workspace's per-group arrays
// (and zeroes rows past sum(r), or empty experts' dw), then one persistent CUTLASS Hopper grouped GEMM whose
// grid comes from the SM count. fprop and dgrad with zero_tail false leave the rows past sum(r) unwritten:
// in a zero-sync receive buffer they are about three quarters of the rows, and no consumer reads them
// (ExpertCounts::tail_unread, engine/ops/grouped_linear.h). Nothing synchronises the host; a bad count traps on the
// device. CPU references: kernels/cpu/{grouped_linear,fp8_grouped_linear}.cpp. CUDA: kernels/cuda/grouped_gemm_*.cu.
// Tests: tests/test_grouped_gemm_device.cpp. Benchmark: bench/bench_grouped_gemm_device.cpp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// The counts are scanned by one block of this many threads, one expert each.
constexpr int64_t kGroupedGemmMaxExperts = 256;

// Bytes of workspace every launcher below needs for num_experts experts on the current device: the
// per-group arrays the GEMM reads (shapes, pointers, strides, scale layouts) and CUTLASS's own workspace
// (a TMA descriptor set per SM). Independent of m_total, n and k, so one buffer serves every call on one
// stream; calls that may run at the same time (other streams) need their own.
size_t grouped_gemm_device_workspace_bytes(int64_t num_experts);

// ---- bf16 (fp32 accumulation) ------------------------------------------------------------------
// dtype must be bf16 (f32 operands stay on grouped_linear_*_cuda). n and k must be multiples of 8 and
// every pointer 16-byte aligned (TMA: 16-byte rows and bases); the row counts may be any values >= 0.

void grouped_gemm_fprop_device_cuda(DType dtype, const void* x /*[m_total,k]*/, const void* w /*[E,n,k]*/,
                                    void* y /*[m_total,n]*/, const int32_t* padded_tokens_per_expert /*[E] device*/,
                                    int64_t num_experts, int64_t m_total, int64_t n, int64_t k, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream, bool zero_tail = true);
void grouped_gemm_dgrad_device_cuda(DType dtype, const void* dy /*[m_total,n]*/, const void* w /*[E,n,k]*/,
                                    void* dx /*[m_total,k]*/, const int32_t* padded_tokens_per_expert /*[E] device*/,
                                    int64_t num_experts, int64_t m_total, int64_t n, int64_t k, void* workspace,
                                    size_t workspace_bytes, cudaStream_t stream, bool zero_tail = true);
// dw is fp32: accumulate adds into it (C = D, beta 1; an expert with no rows keeps dw[e]), otherwise it
// is overwritten (an expert with no rows gets zeros).
void grouped_gemm_wgrad_device_cuda(DType dtype, const void* x /*[m_total,k]*/, const void* dy /*[m_total,n]*/,
                                    float* dw /*[E,n,k]*/, const int32_t* padded_tokens_per_expert /*[E] device*/,
                                    int64_t num_experts, int64_t m_total, int64_t n, int64_t k, bool accumulate,
                                    void* workspace, size_t workspace_bytes, cudaStream_t stream);

// ---- FP8 e4m3, power-of-two block scales (kernels/fp8.h) -----------------------------------------
// n and k multiples of 128; device pointers 16-byte aligned.
// fprop (and dgrad: dy rowwise [m_total, n] with the block-transposed weight w_t [E, k, n] and its scales,
// n and k swapped): x 1x128 rowwise scales, w 128x128 block scales, bf16 or f32 out. Any row counts.
void fp8_grouped_gemm_device_cuda(DType out_dtype, const uint8_t* x /*[m_total, k] e4m3*/,
                                  const float* x_scale_inv /*[m_total, k/128]*/, const uint8_t* w /*[E, n, k] e4m3*/,
                                  const float* w_scale_inv /*[E, n/128, k/128]*/, void* y /*[m_total, n]*/,
                                  const int32_t* padded_tokens_per_expert /*[E] device*/, int64_t num_experts,
                                  int64_t m_total, int64_t n, int64_t k, void* workspace, size_t workspace_bytes,
                                  cudaStream_t stream, bool zero_tail = true);
// wgrad on the colwise operands (expert e's columns start at off_e, its scales at block row
// blk_e = Σ_{i<e} ceil(r_i/128); num_blocks = blk_E): m_total and every row count must be multiples of 16
// (the operands' rows then start 16-byte aligned; a count that is not traps). The reduction over an
// expert's r_e columns may end in a partial 1x128 block: TMA reads the columns past r_e as zeros. The scale
// arrays may be null when num_blocks is 0 (every count 0): only an expert's own blocks are read, so the
// worst-case sized layouts of fp8_transpose_device_cuda / quantize_colwise_device_cuda (kernels/fp8.h) serve
// as they are, on the same counts.
void fp8_grouped_wgrad_device_cuda(const uint8_t* dy_t /*[n, m_total] e4m3*/,
                                   const float* dy_t_scale_inv /*[num_blocks, n]*/,
                                   const uint8_t* x_t /*[k, m_total] e4m3*/,
                                   const float* x_t_scale_inv /*[num_blocks, k]*/, float* dw /*[E, n, k]*/,
                                   const int32_t* padded_tokens_per_expert /*[E] device*/, int64_t num_experts,
                                   int64_t m_total, int64_t n, int64_t k, bool accumulate, void* workspace,
                                   size_t workspace_bytes, cudaStream_t stream);

}  // namespace flowmoe
