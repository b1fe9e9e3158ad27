// Blockwise FP8 e4m3 quantize / dequantize in the three layouts of kernels/fp8.h:
//   quantize:   scale_inv = fp8_scale_inv(amax(block)),  q = e4m3_satfinite(x * fp8_scale_from_inv(scale_inv))
//   dequantize: y = e4m3_to_f32(q) * scale_inv  (then rounded to the output dtype; NaN is 0x7FFFFFFF)
// x / y are f32 or bf16 (raw bits) on both backends; q is e4m3 bytes, scale_inv f32. The CPU
// (kernels/cpu/quantize.cpp) and CUDA (kernels/cuda/quantize.cu) backends agree bit for bit on every
// output. Autograd ops: engine/ops/quantize.h. Tests: tests/test_quantize.cpp, tests/test_fp8_colwise_device.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// ---- rowwise 1x128: x [M,K] -> q [M,K], scale_inv [M, ceil(K/128)] (K need not be a multiple of 128)
void quantize_rowwise_cpu(DType dtype, const void* x /*[M,K]*/, int64_t M, int64_t K, uint8_t* q /*[M,K]*/,
                          float* scale_inv /*[M, ceil(K/128)]*/);
void quantize_rowwise_cuda(DType dtype, const void* x /*[M,K]*/, int64_t M, int64_t K, uint8_t* q /*[M,K]*/,
                           float* scale_inv /*[M, ceil(K/128)]*/, cudaStream_t stream);
void dequantize_rowwise_cpu(DType out_dtype, const uint8_t* q /*[M,K]*/, const float* scale_inv /*[M, ceil(K/128)]*/,
                            int64_t M, int64_t K, void* y /*[M,K]*/);
void dequantize_rowwise_cuda(DType out_dtype, const uint8_t* q /*[M,K]*/, const float* scale_inv /*[M, ceil(K/128)]*/,
                             int64_t M, int64_t K, void* y /*[M,K]*/, cudaStream_t stream);

// ---- colwise 1x128 over segments: x [M,K] -> q [K,M] (transposed), scale_inv [num_blocks, K].
// rows_per_segment is a HOST array [num_segments], each >= 0, summing to at most M; each segment is cut
// into 128-row blocks (the last partial). Columns of q past the sum are written as zero, and so are
// the rows of y past the sum in dequantize. Throws ShapeError for a negative count (or a sum > M).
int64_t colwise_num_blocks(const int64_t* rows_per_segment /*[num_segments]*/, int64_t num_segments);
int64_t colwise_total_rows(const int64_t* rows_per_segment /*[num_segments]*/, int64_t num_segments);  // the sum
void quantize_colwise_cpu(DType dtype, const void* x /*[M,K]*/, int64_t M, int64_t K,
                          const int64_t* rows_per_segment /*[num_segments]*/, int64_t num_segments,
                          uint8_t* q /*[K,M]*/, float* scale_inv /*[num_blocks, K]*/);
void quantize_colwise_cuda(DType dtype, const void* x /*[M,K]*/, int64_t M, int64_t K,
                           const int64_t* rows_per_segment /*[num_segments]*/, int64_t num_segments,
                           uint8_t* q /*[K,M]*/, float* scale_inv /*[num_blocks, K]*/, cudaStream_t stream);
// The same quantize with the segments as per-expert counts [E] (E <= 256): int32 on the device for the
// CUDA launcher (no host synchronisation: it can be captured in a CUDA graph), on the host for the CPU
// reference. scale_inv is sized for the worst case, max_blocks = fp8_colwise_max_blocks(M, E) rows (kernels/fp8.h):
// rows [0, num_blocks) as above, rows past them 1.0f; columns of q past sum(r) zero. A count < 0 or a
// sum > M traps on the device (ShapeError on the CPU). CPU: kernels/cpu/fp8_colwise_device.cpp.
void quantize_colwise_device_cpu(DType dtype, const void* x /*[M,K]*/, int64_t M, int64_t K,
                                 const int32_t* counts /*[E] host*/, int64_t num_experts, uint8_t* q /*[K,M]*/,
                                 float* scale_inv /*[max_blocks, K]*/);
void quantize_colwise_device_cuda(DType dtype, const void* x /*[M,K]*/, int64_t M, int64_t K,
                                  const int32_t* counts /*[E] device*/, int64_t num_experts, uint8_t* q /*[K,M]*/,
                                  float* scale_inv /*[max_blocks, K]*/, cudaStream_t stream);
void dequantize_colwise_cpu(DType out_dtype, const uint8_t* q /*[K,M]*/, const float* scale_inv /*[num_blocks, K]*/,
                            int64_t M, int64_t K, const int64_t* rows_per_segment /*[num_segments]*/,
                            int64_t num_segments, void* y /*[M,K]*/);
void dequantize_colwise_cuda(DType out_dtype, const uint8_t* q /*[K,M]*/, const float* scale_inv /*[num_blocks, K]*/,
                             int64_t M, int64_t K, const int64_t* rows_per_segment /*[num_segments]*/,
                             int64_t num_segments, void* y /*[M,K]*/, cudaStream_t stream);

// ---- block 128x128 (weights): w [B,N,K] -> q [B,N,K], scale_inv [B, ceil(N/128), ceil(K/128)].
// When q_t is non-null, also the exact transpose q_t [B,K,N] with scale_inv_t [B, ceil(K/128), ceil(N/128)]:
// the same bytes and the same scales, transposed (no re-quantization).
void quantize_block_cpu(DType dtype, const void* w /*[B,N,K]*/, int64_t B, int64_t N, int64_t K, uint8_t* q /*[B,N,K]*/,
                        float* scale_inv /*[B, ceil(N/128), ceil(K/128)]*/, uint8_t* q_t /*[B,K,N] or null*/,
                        float* scale_inv_t /*[B, ceil(K/128), ceil(N/128)]*/);
void quantize_block_cuda(DType dtype, const void* w /*[B,N,K]*/, int64_t B, int64_t N, int64_t K,
                         uint8_t* q /*[B,N,K]*/, float* scale_inv /*[B, ceil(N/128), ceil(K/128)]*/,
                         uint8_t* q_t /*[B,K,N] or null*/, float* scale_inv_t /*[B, ceil(K/128), ceil(N/128)]*/,
                         cudaStream_t stream);
void dequantize_block_cpu(DType out_dtype, const uint8_t* q /*[B,N,K]*/,
                          const float* scale_inv /*[B, ceil(N/128), ceil(K/128)]*/, int64_t B, int64_t N, int64_t K,
                          void* y /*[B,N,K]*/);
void dequantize_block_cuda(DType out_dtype, const uint8_t* q /*[B,N,K]*/,
                           const float* scale_inv /*[B, ceil(N/128), ceil(K/128)]*/, int64_t B, int64_t N, int64_t K,
                           void* y /*[B,N,K]*/, cudaStream_t stream);

}  // namespace flowmoe
