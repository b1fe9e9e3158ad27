// SwiGLU: out[r, j] = silu(gate[r, j]) * up[r, j] with gate = in[r, :F] and up = in[r, F:2F].
// Backward: d_gate = d_out * up * silu'(gate), d_up = d_out * silu(gate), written as d_in [rows, 2F].
// CPU reference: kernels/cpu/swiglu.cpp, built from silu_value / silu_grad_value (kernels/silu.h) so
// it equals mul(silu(gate), up) bit for bit. CUDA: kernels/cuda/swiglu.cu (f32 and bf16, fp32 math).
// With counted rows (kernels/common/counted_rows.h) the CUDA kernels compute only the rows the counts cover.
// Node: engine/ops/swiglu.cpp. Tests: tests/test_swiglu.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/counted_rows.h"
#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

template <class T>
void swiglu_forward_cpu(T* out /*[rows, F]*/, const T* gate_up /*[rows, 2F]*/, int64_t rows, int64_t F);
template <class T>
void swiglu_backward_cpu(T* d_gate_up /*[rows, 2F]*/, const T* d_out /*[rows, F]*/, const T* gate_up /*[rows, 2F]*/,
                         int64_t rows, int64_t F);

// dtype f32 or bf16 (bf16 as raw bits, fp32 math, each output rounded to nearest even once).
void swiglu_forward_cuda(DType dtype, void* out /*[rows, F]*/, const void* gate_up /*[rows, 2F]*/, int64_t rows,
                         int64_t F, cudaStream_t stream, CountedRows counted = {});
void swiglu_backward_cuda(DType dtype, void* d_gate_up /*[rows, 2F]*/, const void* d_out /*[rows, F]*/,
                          const void* gate_up /*[rows, 2F]*/, int64_t rows, int64_t F, cudaStream_t stream,
                          CountedRows counted = {});

}  // namespace flowmoe
