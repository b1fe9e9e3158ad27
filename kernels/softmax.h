// Softmax over the last dim: y = exp(x - max(x)) / sum(exp(x - max(x))) per row of [rows, cols];
// backward dx = y * (dy - sum(dy * y)). CPU reference: kernels/cpu/softmax.cpp (f32, f64);
// CUDA: kernels/cuda/softmax.cu (f32 and bf16, fp32 math). Node: engine/ops/softmax.cpp.
// Tests: tests/test_softmax.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

template <class T>
void softmax_forward_cpu(T* y /*[rows, cols]*/, const T* x /*[rows, cols]*/, int64_t rows, int64_t cols);
template <class T>
void softmax_backward_cpu(T* d_x /*[rows, cols]*/, const T* d_y /*[rows, cols]*/, const T* y /*[rows, cols]*/,
                          int64_t rows, int64_t cols);

// dtype f32 or bf16 (raw bits), fp32 math; one block per row, so any width (vocab 50k+) works.
void softmax_forward_cuda(DType dtype, void* y /*[rows, cols]*/, const void* x /*[rows, cols]*/, int64_t rows,
                          int64_t cols, cudaStream_t stream);
void softmax_backward_cuda(DType dtype, void* d_x /*[rows, cols]*/, const void* d_y /*[rows, cols]*/,
                           const void* y /*[rows, cols]*/, int64_t rows, int64_t cols, cudaStream_t stream);

}  // namespace flowmoe
