// The scaling-aware FP8 transpose as a tensor op (math: kernels/fp8_transpose.h, DESIGN.md §3):
// rowwise FP8 [M,K] -> colwise FP8 [K,M] without dequantize/requantize. It is a layout move, not a
// cast (no note_cast). Kernels: kernels/cpu/fp8_transpose.cpp, kernels/cuda/fp8_transpose.cu.
// Tests: tests/test_fp8_transpose.cpp, tests/test_fp8_colwise_device.cpp.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/ops/grouped_linear.h"
#include "engine/tensor.h"

namespace flowmoe {

// q_rowwise: e4m3 [M,K] with rowwise_1x128 scales attached (scale_inv f32 [M, ceil(K/128)]), on cpu or cuda.
// Returns e4m3 [K,M] with colwise_1x128 scales (scale_inv_t f32 [num_blocks, K]) and rows_per_segment
// attached as given; an empty rows_per_segment means one segment of M rows. Columns past the segments'
// total are zero. Not differentiable (run through eval(): the device of q_rowwise picks the backend).
Tensor fp8_transpose(const Tensor& q_rowwise, const std::vector<int64_t>& rows_per_segment);
// The same over an MoE layer's expert counts: host counts as above; device counts (i32 [E] on q_rowwise's
// device, E <= 256; a CPU tensor on the CPU) are read only by the kernel, so nothing synchronises the host:
// scale_inv_t is then the worst case [fp8_colwise_max_blocks(M, E), K] (its rows past the real blocks 1.0f)
// and the counts tensor is attached as Fp8Scales::segment_counts. What fp8_grouped_linear's wgrad takes.
Tensor fp8_transpose(const Tensor& q_rowwise, const ExpertCounts& counts);

}  // namespace flowmoe
