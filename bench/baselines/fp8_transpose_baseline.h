// The "double quantization" baseline that bench/bench_fp8_transpose.cpp measures the scaling-aware FP8
// transpose of kernels/fp8_transpose.h against: y = bf16(e4m3_to_f32(q) * s_inv), then an ordinary
// colwise quantize of y over the segments. Kernels: bench/baselines/fp8_transpose_baseline.cu, linked into
// bench_fp8_transpose only (bench/CMakeLists.txt), never into a flowmoe library.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"

namespace flowmoe {

void fp8_transpose_baseline_dequantize_cuda(const uint8_t* q /*[M,K]*/, const float* scale_inv /*[M, ceil(K/128)]*/,
                                            int64_t M, int64_t K, uint16_t* y /*[M,K] bf16 bits*/, cudaStream_t stream);
void fp8_transpose_baseline_quantize_colwise_cuda(const uint16_t* y /*[M,K] bf16 bits*/, int64_t M, int64_t K,
                                                  const int64_t* rows_per_segment /*[num_segments] host*/,
                                                  int64_t num_segments, uint8_t* q_t /*[K,M]*/,
                                                  float* scale_inv_t /*[num_blocks, K]*/, cudaStream_t stream);

}  // namespace flowmoe
