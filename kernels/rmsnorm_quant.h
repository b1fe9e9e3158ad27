// Fused RMSNorm + rowwise 1x128 FP8 quantize (DESIGN.md §7: fp8_full quantizes a norm's output where
// the norm produces it, for the FP8 linears that read it):
//   y = rmsnorm(x, w) as kernels/rmsnorm.h computes it, rounded to the output dtype;
//   q [rows, hidden] e4m3, scale_inv [rows, ceil(hidden/128)] = quantize_rowwise(y) (kernels/quantize.h).
// The quantize reads y as rounded, so each backend gives its unfused composition (rmsnorm_forward_* then
// quantize_rowwise_*) bit for bit: y, q and scale_inv. y is optional (null: only q and scale_inv are written).
// The backward is RMSNorm's (kernels/rmsnorm.h), the quantize straight-through.
// CPU reference: kernels/cpu/rmsnorm_quant.cpp (the composition itself); CUDA: kernels/cuda/rmsnorm_quant.cu.
// Node: engine/ops/rmsnorm_quant.h. Tests: tests/test_rmsnorm_quant.cpp. Bench: bench/bench_rmsnorm_quant.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// T float or double; the quantize reads y as f32 (a double y is rounded to f32 first).
template <class T>
void rmsnorm_quant_forward_cpu(T* y /*[rows, hidden] or null*/, uint8_t* q /*[rows, hidden] e4m3*/,
                               float* scale_inv /*[rows, ceil(hidden/128)]*/, const T* x /*[rows, hidden]*/,
                               const T* weight /*[hidden]*/, int64_t rows, int64_t hidden, double eps);

// dtype f32 or bf16 (raw bits) for x, weight and y.
void rmsnorm_quant_forward_cuda(DType dtype, void* y /*[rows, hidden] or null*/, uint8_t* q /*[rows, hidden] e4m3*/,
                                float* scale_inv /*[rows, ceil(hidden/128)]*/, const void* x /*[rows, hidden]*/,
                                const void* weight /*[hidden]*/, int64_t rows, int64_t hidden, double eps,
                                cudaStream_t stream);

}  // namespace flowmoe
