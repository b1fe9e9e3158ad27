// Blockwise FP8 (e4m3) quantize / dequantize at the autograd level. Quantized tensors carry their
// scale_inv (Tensor::with_scales) in the three layouts of kernels/fp8.h; every explicit cast is
// counted (engine/cast_stats.h) at the `site` its caller names. Kernels: kernels/quantize.h
// (CPU reference kernels/cpu/quantize.cpp, CUDA kernels/cuda/quantize.cu, bit-identical).
// Implementation: engine/ops/quantize.cpp. Tests: tests/test_quantize.cpp.
#pragma once
#include <string>
#include <vector>

#include "engine/autograd.h"
#include "engine/ops/grouped_linear.h"
#include "kernels/adamw_fp8.h"

namespace flowmoe {

// x [..., K] f32/bf16 -> e4m3 [..., K] with scale_inv [rows, ceil(K/128)] f32, rowwise_1x128 (rows =
// the product of the leading dims). Counts one CastKind::quantize at `site`. Gradient: straight
// through, d_x = d_q converted to x's dtype (an FP8 d_q with scales is dequantized, not counted).
Variable quantize_rowwise(const Variable& x, const std::string& site);

// FP8 with rowwise_1x128 or block_128x128 scales -> dtype (f32 or bf16), same shape. Counts one
// CastKind::dequantize. Gradient: identity (d_y is handed back as it comes, f32 or bf16).
Variable dequantize(const Variable& q, DType dtype, const std::string& site);

// ---- non-differentiable helpers (used inside other ops' backward) ----------------------------

// The straight-through gradient of a rowwise quantize whose input had `dtype`: d_q converted to it, an FP8 d_q
// with scales dequantized (part of the backward, not a cast: not counted).
Tensor straight_through_grad(const Tensor& d_q, DType dtype);

// As quantize_rowwise, on a tensor. Counts one quantize.
Tensor quantize_rowwise_tensor(const Tensor& x, const std::string& site);
// x [M,K] f32/bf16 -> e4m3 [K,M] with colwise_1x128 scale_inv [num_blocks, K] and the segments attached
// (an empty rows_per_segment means one segment of M rows; segments may sum to less than M, and the
// columns of the data past their sum are zero). Counts one quantize.
Tensor quantize_colwise_tensor(const Tensor& x, const std::vector<int64_t>& rows_per_segment, const std::string& site);
// The same over an MoE layer's expert counts: host counts as above; device counts (i32 [E] on x's device,
// E <= 256; a CPU tensor on the CPU) are read only by the kernel (no host synchronisation): scale_inv is
// then the worst case [fp8_colwise_max_blocks(M, E), K], its rows past the real blocks 1.0f, and the counts
// are attached as Fp8Scales::segment_counts (dequantize_tensor reads them on the CPU only). Counts one quantize.
Tensor quantize_colwise_tensor(const Tensor& x, const ExpertCounts& counts, const std::string& site);
// Any of the three forms -> dtype (f32 or bf16); colwise [K,M] gives [M,K] (rows past the segments
// zero). Counts one dequantize unless `site` is empty.
Tensor dequantize_tensor(const Tensor& q, DType dtype, const std::string& site);

// A weight in 128x128 blocks and its exact transpose, both e4m3 with block_128x128 scales:
// q [.., N, K] with scale_inv [.., ceil(N/128), ceil(K/128)], q_t [.., K, N] with the transposed grid. q_t is
// undefined where the weight keeps no transpose (precision.fp8_weight_transpose: rebuilt); weight_transpose then
// rebuilds it for the GEMM that reads it.
struct QuantizedWeight {
  Tensor q;
  Tensor q_t;
};
// w [E,N,K] or [N,K], f32 or bf16; with_transpose false leaves q_t undefined. Counts one
// CastKind::weight_quantize.
QuantizedWeight quantize_weight(const Tensor& w, const std::string& site, bool with_transpose = true);
// The kernels' view of wq's four buffers (kernels/adamw_fp8.h): wq.q [B, N, K] or [N, K] (B = 1); q_t and
// scale_inv_t null where wq keeps no transpose.
Fp8BlockCopy block_copy(const QuantizedWeight& wq);

// wq.q_t, or where it is undefined its rebuild from wq.q: each 128x128 block's bytes and the scale grid transposed
// (kernels/adamw_fp8.h fp8_block_transpose_*), bit for bit the q_t quantize_weight writes. Not a cast: no rounding.
Tensor weight_transpose(const QuantizedWeight& wq);

}  // namespace flowmoe
