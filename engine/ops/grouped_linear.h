// GroupedLinear: a linear layer per local expert over the expert-major permuted buffer
// (permute_pad's rows, engine/ops/permute.h). Kernels and shapes: kernels/grouped_linear.h.
//
// Expert e owns rows [off_e, off_e + padded_tokens_per_expert[e]) of x, off_e = sum of the earlier counts, so
// padded_tokens_per_expert is permute_pad's padded_tokens_per_expert (each segment then starts at a multiple
// of align_size, pad rows are zeros and give zero outputs). The counts must be on the host because
// each expert's cuBLASLt call needs its M: read them with read_counts_once, ONCE per MoE layer, and
// pass the same vector to fc1 and fc2 (and nothing else in the layer may read counts back).
// sum(padded_tokens_per_expert) <= M_total: rows past the last segment (a worst-case sized buffer) get zero
// outputs and zero input gradients.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/autograd.h"

namespace flowmoe {

// THE one host synchronisation of an MoE layer: copies the per-expert counts ([L] i32 or i64, e.g.
// PermuteResult::padded_tokens_per_expert) to the host, waiting for the engine stream, which counts
// as one note_host_sync() (reported per step in the metrics). A CPU tensor is read without a sync and
// is not counted.
std::vector<int64_t> read_counts_once(const Tensor& padded_tokens_per_expert);

// 2·rows·N·K over the experts' rows, for weight [E, N, K]: the FLOPs of one grouped GEMM, the FP8 one
// too (the step profiler's Primitive::flops); 0 when weight is not 3-D.
double grouped_gemm_flops(const std::vector<int64_t>& padded_tokens_per_expert, const Tensor& weight);

// An MoE layer's per-expert row counts, in one of two places: host values (read_counts_once, one sync)
// or left on the device, i32 [E] as permute_pad wrote them, for the one-launch grouped GEMMs of
// kernels/grouped_gemm_device.h and the colwise FP8 layouts over device counts (fp8_transpose,
// quantize_colwise_tensor), which read them there (nothing then synchronises the host). On the CPU
// backend a CPU i32 tensor stands in for them (the CPU references read it without a sync), so both
// backends run the same op path.
// With both, the GEMMs read the device counts and the colwise layouts follow the host values.
struct ExpertCounts {
  std::vector<int64_t> host;
  Tensor device;  // defined: the GEMMs read these
  // The rows past the device counts' sum are never read: every consumer of the buffer takes the counts
  // (a worst-case dispatch buffer, whose tail in a zero-sync exchange is most of its rows). The one-launch
  // GEMMs then leave those rows of their outputs unwritten rather than zeroing them.
  bool tail_unread = false;
  bool on_device() const { return device.defined(); }
  // The host holds the counts: the colwise FP8 layouts follow them (host-known shapes). Otherwise they
  // follow the device counts (worst-case scale shapes) and the profiler counts every row.
  bool host_known() const { return !on_device() || !host.empty(); }
  int64_t num_experts() const { return on_device() ? device.numel() : int64_t(host.size()); }
};

// Checks that counts can serve as the device counts of x: a contiguous [E] i32 (E = num_experts when
// given) on x's device (a CPU tensor for a CPU x). Throws DTypeError / ShapeError / DeviceError
// starting with `what`.
void check_device_counts(const Tensor& counts, const Tensor& x, const std::string& what, int64_t num_experts = -1);

// The step profiler's FLOPs of a grouped GEMM over x [M_total, ..] and weight [E, N, K]: grouped_gemm_flops of
// the host counts or, with device counts (the host does not know the rows), of every row of x, the padded
// worst case; 0 when weight is not 3-D.
double grouped_gemm_flops(const ExpertCounts& counts, const Tensor& x, const Tensor& weight);

// Scratch for the one-launch grouped GEMMs of num_experts experts (kernels/grouped_gemm_device.h), on
// like's device: what grouped_linear and fp8_grouped_linear hand them.
Tensor grouped_gemm_device_workspace(const Tensor& like, int64_t num_experts);

// Whether grouped_linear can take device counts for x: a bf16 x on a GPU of a build with the one-launch
// grouped GEMMs.
bool grouped_linear_takes_device_counts(const Tensor& x);
// The expert GEMMs' counts from counts [L] i32 on the rows' device: left there where the GEMMs over rows read
// them there (FP8 GEMMs on any backend, bf16 ones per grouped_linear_takes_device_counts), else read to the host
// (one sync on a GPU).
ExpertCounts gemm_counts(const Tensor& counts, const Tensor& rows, bool fp8_experts);

// y [M_total, N] = per expert e: x[rows of e] · weight[e]ᵀ.
//   x [M_total, K]; weight [E, N, K] (E = padded_tokens_per_expert.size()).
//   CPU: x and weight both f32 or both f64. CUDA: x bf16 (or f32) and weight the f32 master (or x's
//   dtype); a weight of another dtype than x is cast to x's dtype once per call, and that copy is
//   reused by the backward (caching it per optimizer step would save the cast: a later optimisation).
//   y and d_x have x's dtype. d_weight is computed in fp32 (bf16 operands, fp32 output) and returned
//   in the weight's dtype, so an f32 master accumulates its gradient in fp32.
Variable grouped_linear(const Variable& x, const Variable& weight,
                        const std::vector<int64_t>& padded_tokens_per_expert);
// The same with either kind of counts; device counts need grouped_linear_takes_device_counts(x).
Variable grouped_linear(const Variable& x, const Variable& weight, const ExpertCounts& counts);

}  // namespace flowmoe
