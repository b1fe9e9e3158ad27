// Elementwise add / mul / scale. CPU reference: kernels/cpu/elementwise.cpp (templated on the
// scalar type, f32 and f64); CUDA: kernels/cuda/elementwise.cu (f32 and bf16, fp32 math).
// Node: engine/ops/elementwise.cpp. Tests: tests/test_elementwise.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

enum class BinaryOp : uint8_t { add, mul };

template <class T>
void binary_cpu(BinaryOp op, T* out /*[n]*/, const T* a /*[n]*/, const T* b /*[n]*/, int64_t n);
template <class T>
void scale_cpu(T* out /*[n]*/, const T* a /*[n]*/, double s, int64_t n);

// dtype f32 or bf16 (bf16 stored as raw bits, computed in fp32, rounded to nearest even).
void binary_cuda(BinaryOp op, DType dtype, void* out /*[n]*/, const void* a /*[n]*/, const void* b /*[n]*/, int64_t n,
                 cudaStream_t stream);
void scale_cuda(DType dtype, void* out /*[n]*/, const void* a /*[n]*/, double s, int64_t n, cudaStream_t stream);

}  // namespace flowmoe
