// Reductions over all elements: sum(x) and mean(x) = sum(x) / n (0 when n == 0); backward fills
// d_x with d_out (sum) or d_out / n (mean). CPU reference: kernels/cpu/reduce.cpp (f32, f64,
// accumulated in double); CUDA: kernels/cuda/reduce.cu (f32 and bf16 input, fp32 accumulation,
// f32 result). Node: engine/ops/reduce.cpp. Tests: tests/test_reduce.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

enum class ReduceOp : uint8_t { sum, mean };

template <class T>
T reduce_cpu(ReduceOp op, const T* x /*[n]*/, int64_t n);
template <class T>
void reduce_backward_cpu(ReduceOp op, T* d_x /*[n]*/, T d_out, int64_t n);

// Floats of scratch the CUDA reduction needs (one partial sum per block of the first pass).
constexpr int kReducePartials = 1024;

// Deterministic two-pass reduction, no atomics: blocks write partial sums in a fixed layout, one
// block adds them in a fixed order. dtype (of x) f32 or bf16; out is f32.
void reduce_cuda(ReduceOp op, DType dtype, float* out /*[]*/, float* partials /*[kReducePartials]*/,
                 const void* x /*[n]*/, int64_t n, cudaStream_t stream);
// Fill from a device scalar (no host sync): d_x[i] = d_out[0] (/ n for mean), in dtype f32 or bf16.
void reduce_backward_cuda(ReduceOp op, DType dtype, void* d_x /*[n]*/, const float* d_out /*[]*/, int64_t n,
                          cudaStream_t stream);

}  // namespace flowmoe
