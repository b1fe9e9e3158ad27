// Scaling-aware FP8 transpose (DESIGN.md §3): rowwise 1x128 [M,K] -> colwise 1x128 [K,M] over segments,
// without dequantize/requantize. For a 128-row block r of one segment and a column j in block b = j/128:
//   S[r,b] = max over rows i in r of s_inv[i,b], rows whose block b is all zeros (+-0) left out unless
//            their scale is NaN; no row left: S = 1; NaN among them: S = NaN (written 0x7FC00000)
//   q_t[j,i] = e4m3_satfinite(e4m3_to_f32(q[i,j]) * 2^-k),  k = log2 S - log2 s_inv[i,b] (clamped to [0,64])
// i.e. exact while normal, round-to-nearest-even on the subnormal grid, signed zeros kept, NaN -> 0x7F.
// With S NaN the bytes are kept (NaN canonicalised). Layouts: kernels/fp8.h. CPU: kernels/cpu/fp8_transpose.cpp
// (device counts: kernels/cpu/fp8_colwise_device.cpp), CUDA: kernels/cuda/fp8_transpose.cu (bit-identical).
// Op: engine/ops/fp8_transpose.h. Tests: tests/test_fp8_transpose.cpp, tests/test_fp8_colwise_device.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"

namespace flowmoe {

// Checks the segments (each >= 0, sum <= M; ShapeError naming the values) and returns
// num_blocks = sum_s ceil(rows_s / 128), the row count of scale_inv_t.
int64_t fp8_transpose_num_blocks(const int64_t* rows_per_segment /*[num_segments] host*/, int64_t num_segments,
                                 int64_t M);

// Columns of q_t past the segments' total are written as zero. rows_per_segment is a host array.
void fp8_transpose_cpu(const uint8_t* q /*[M,K]*/, const float* scale_inv /*[M, ceil(K/128)]*/, int64_t M, int64_t K,
                       const int64_t* rows_per_segment /*[num_segments] host*/, int64_t num_segments,
                       uint8_t* q_t /*[K,M]*/, float* scale_inv_t /*[num_blocks, K]*/);
// Same, on `stream`; no host synchronisation (the segment table travels in the launch parameters).
void fp8_transpose_cuda(const uint8_t* q /*[M,K]*/, const float* scale_inv /*[M, ceil(K/128)]*/, int64_t M, int64_t K,
                        const int64_t* rows_per_segment /*[num_segments] host*/, int64_t num_segments,
                        uint8_t* q_t /*[K,M]*/, float* scale_inv_t /*[num_blocks, K]*/, cudaStream_t stream);

// The same with the segments as per-expert counts [E] (E <= 256), int32 on the device for the CUDA
// launcher (nothing reads them on the host: it can be captured in a CUDA graph) and on the host for the CPU
// reference. scale_inv_t is sized for the worst case, max_blocks = fp8_colwise_max_blocks(M, E) rows: rows
// [0, num_blocks) as above (expert e's from blk_e = sum_{i<e} ceil(r_i/128), what
// fp8_grouped_wgrad_device_cuda reads), rows [num_blocks, max_blocks) 1.0f; columns of q_t past sum(r)
// zero. A count < 0 or a sum > M traps on the device (ShapeError on the CPU).
void fp8_transpose_device_cpu(const uint8_t* q /*[M,K]*/, const float* scale_inv /*[M, ceil(K/128)]*/, int64_t M,
                              int64_t K, const int32_t* counts /*[E] host*/, int64_t num_experts,
                              uint8_t* q_t /*[K,M]*/, float* scale_inv_t /*[max_blocks, K]*/);
void fp8_transpose_device_cuda(const uint8_t* q /*[M,K]*/, const float* scale_inv /*[M, ceil(K/128)]*/, int64_t M,
                               int64_t K, const int32_t* counts /*[E] device*/, int64_t num_experts,
                               uint8_t* q_t /*[K,M]*/, float* scale_inv_t /*[max_blocks, K]*/, cudaStream_t stream);

}  // namespace flowmoe
