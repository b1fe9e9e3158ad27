// The residual add fused with the RMSNorm that reads it (and, optionally, with the rowwise 1x128 FP8 quantize of
// the norm's output), as TransformerEngine fuses a block's residual add into the next norm:
//   h = x + a, rounded to the dtype (the residual stream, always written);
//   y = rmsnorm(h, w) (kernels/rmsnorm.h), written where asked; q, scale_inv = quantize_rowwise(y) where asked.
// Each backend gives its unfused composition (binary add, then rmsnorm_forward or rmsnorm_quant_forward) bit for bit.
// The backward is the add's and RMSNorm's (kernels/rmsnorm.h), the quantize straight-through.
// CPU reference: kernels/cpu/add_rmsnorm.cpp (the composition); CUDA: kernels/cuda/add_rmsnorm.cu.
// Node: engine/ops/add_rmsnorm.h. Tests: tests/test_add_rmsnorm.cpp. Bench: bench/bench_rmsnorm_quant.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// T float or double. At least one of y and q is non-null; scale_inv goes with q.
template <class T>
void add_rmsnorm_forward_cpu(T* h /*[rows, hidden]*/, T* y /*[rows, hidden] or null*/,
                             uint8_t* q /*[rows, hidden] e4m3 or null*/, float* scale_inv /*[rows, ceil(hidden/128)]*/,
                             const T* x /*[rows, hidden]*/, const T* a /*[rows, hidden]*/, const T* weight /*[hidden]*/,
                             int64_t rows, int64_t hidden, double eps);

// dtype f32 or bf16 (raw bits) for h, y, x, a and weight.
void add_rmsnorm_forward_cuda(DType dtype, void* h /*[rows, hidden]*/, void* y /*[rows, hidden] or null*/,
                              uint8_t* q /*[rows, hidden] e4m3 or null*/, float* scale_inv /*[rows, ceil(hidden/128)]*/,
                              const void* x /*[rows, hidden]*/, const void* a /*[rows, hidden]*/,
                              const void* weight /*[hidden]*/, int64_t rows, int64_t hidden, double eps,
                              cudaStream_t stream);

}  // namespace flowmoe
