// SwiGLU on the GPU, f32 or bf16 in and out, fp32 math:
//   out[r, j] = silu(g) * u,  g = gate_up[r, j], u = gate_up[r, F + j]     gate_up [rows, 2F] -> out [rows, F]
//   d_gate_up[r, j] = dy * u * silu'(g),  d_gate_up[r, F + j] = dy * silu(g)
// silu comes from kernels/cuda/silu.cuh, the same code the silu kernel runs. With counted rows, the rows past
// the counts' sum are skipped (the grid still covers every row: its size is set on the host).
// CPU reference: kernels/cpu/swiglu.cpp. Tests: tests/test_swiglu.cpp.
#include <cuda_bf16.h>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/silu.cuh"
#include "kernels/swiglu.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

// Grid: x over column chunks of blockDim.x, y strides over rows (no per-element division).
template <class T>
__global__ void swiglu_forward_kernel(T* __restrict__ out, const T* __restrict__ gate_up, int64_t all_rows, int64_t F,
                                      CountedRows counted) {
  const int64_t rows = counted_rows(all_rows, counted);
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < F; j += int64_t(gridDim.x) * blockDim.x)
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
      const T* gate = gate_up + r * 2 * F;
      out[r * F + j] = from_float<T>(silu_f32(to_float(gate[j])) * to_float(gate[F + j]));
    }
}

template <class T>
__global__ void swiglu_backward_kernel(T* __restrict__ d_gate_up, const T* __restrict__ d_out,
                                       const T* __restrict__ gate_up, int64_t all_rows, int64_t F,
                                       CountedRows counted) {
  const int64_t rows = counted_rows(all_rows, counted);
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < F; j += int64_t(gridDim.x) * blockDim.x)
    for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
      const T* gate = gate_up + r * 2 * F;
      float g = to_float(gate[j]), u = to_float(gate[F + j]), dy = to_float(d_out[r * F + j]);
      d_gate_up[r * 2 * F + j] = from_float<T>(dy * u * silu_grad_f32(g));
      d_gate_up[r * 2 * F + F + j] = from_float<T>(dy * silu_f32(g));
    }
}

// ---- launchers --------------------------------------------------------------------------------

static dim3 swiglu_grid(int64_t rows, int64_t F, int threads) {
  int64_t col_blocks = (F + threads - 1) / threads;
  return dim3(unsigned(col_blocks < 65536 ? col_blocks : 65536), unsigned(rows < 65535 ? rows : 65535));
}

void swiglu_forward_cuda(DType dtype, void* out, const void* gate_up, int64_t rows, int64_t F, cudaStream_t stream,
                         CountedRows counted) {
  FLOWMOE_CHECK(rows >= 0 && F >= 0, ShapeError, "swiglu_forward_cuda: bad shape rows ", rows, ", F ", F);
  if (rows == 0 || F == 0) return;
  const int threads = 256;
  dispatch_cuda_float(dtype, "swiglu_forward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_forward_kernel<<<swiglu_grid(rows, F, threads), threads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(gate_up), rows, F, counted);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void swiglu_backward_cuda(DType dtype, void* d_gate_up, const void* d_out, const void* gate_up, int64_t rows, int64_t F,
                          cudaStream_t stream, CountedRows counted) {
  FLOWMOE_CHECK(rows >= 0 && F >= 0, ShapeError, "swiglu_backward_cuda: bad shape rows ", rows, ", F ", F);
  if (rows == 0 || F == 0) return;
  const int threads = 256;
  dispatch_cuda_float(dtype, "swiglu_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    swiglu_backward_kernel<<<swiglu_grid(rows, F, threads), threads, 0, stream>>>(
        static_cast<T*>(d_gate_up), static_cast<const T*>(d_out), static_cast<const T*>(gate_up), rows, F, counted);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
