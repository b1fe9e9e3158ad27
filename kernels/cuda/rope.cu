// Rotary position embedding on the GPU.
//   out[b,t,h,2i:2i+2] = R(dir * (pos_offset + t) * theta^(-2i/hd)) x[b,t,h,2i:2i+2], x [B,T,nh,hd], hd even;
//   dir = +1 forward, -1 backward (the inverse rotation of d_out). f32 or bf16 data, fp32 math.
// One block per (b, t) row; it first fills a cos/sin table of hd/2 entries in shared memory, computed in
// double and rounded to float exactly as the CPU reference does, so f32 results agree to ~1 ulp.
// CPU reference: kernels/cpu/rope.cpp. Tests: tests/test_rope.cpp.
#include <cuda_bf16.h>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/rope.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

template <class T>
__global__ void rope_kernel(T* __restrict__ out /*[B*T, nh, hd]*/, const T* __restrict__ x /*[B*T, nh, hd]*/,
                            int seq_len, int num_heads, int head_dim, double theta, int64_t pos_offset,
                            double direction) {
  extern __shared__ float2 cos_sin[];  // [hd/2]: (cos, dir * sin)
  const int64_t row = blockIdx.x;      // b * seq_len + t
  const int half = head_dim / 2;
  const double pos = double(pos_offset + row % seq_len);
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    double s, c;
    sincos(pos * pow(theta, -2.0 * double(i) / double(head_dim)), &s, &c);
    cos_sin[i] = make_float2(float(c), float(direction * s));
  }
  __syncthreads();
  const int64_t base = row * num_heads * head_dim;
  for (int j = threadIdx.x; j < num_heads * half; j += blockDim.x) {
    const float2 cs = cos_sin[j % half];
    const int64_t e = base + 2 * int64_t(j);
    const float x0 = to_float(x[e]), x1 = to_float(x[e + 1]);
    out[e] = from_float<T>(x0 * cs.x - x1 * cs.y);
    out[e + 1] = from_float<T>(x0 * cs.y + x1 * cs.x);
  }
}

// ---- launchers --------------------------------------------------------------------------------

static void rope_launch(DType dtype, void* out, const void* x, int64_t batch, int64_t seq_len, int64_t num_heads,
                        int64_t head_dim, double theta, int64_t pos_offset, double direction, cudaStream_t stream,
                        const char* what) {
  FLOWMOE_CHECK(batch >= 0 && seq_len >= 0 && num_heads >= 0 && head_dim >= 0, ShapeError, what, ": negative size");
  FLOWMOE_CHECK(head_dim % 2 == 0, ShapeError, what, ": head_dim must be even, got ", head_dim);
  FLOWMOE_CHECK(theta > 0, Error, what, ": theta must be positive, got ", theta);
  const int64_t rows = batch * seq_len, pairs = num_heads * head_dim / 2;
  if (rows == 0 || pairs == 0) return;
  FLOWMOE_CHECK(rows < (int64_t(1) << 31) && num_heads * head_dim < (int64_t(1) << 31), ShapeError, what,
                ": too large (batch*seq_len ", rows, ", num_heads*head_dim ", num_heads * head_dim, ")");
  const int threads = int(pairs >= 256 ? 256 : (pairs + 31) / 32 * 32);
  const size_t smem = size_t(head_dim / 2) * sizeof(float2);
  dispatch_cuda_float(dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_kernel<<<unsigned(rows), threads, smem, stream>>>(static_cast<T*>(out), static_cast<const T*>(x), int(seq_len),
                                                           int(num_heads), int(head_dim), theta, pos_offset, direction);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void rope_forward_cuda(DType dtype, void* out, const void* x, int64_t batch, int64_t seq_len, int64_t num_heads,
                       int64_t head_dim, double theta, int64_t pos_offset, cudaStream_t stream) {
  rope_launch(dtype, out, x, batch, seq_len, num_heads, head_dim, theta, pos_offset, 1.0, stream, "rope_forward_cuda");
}

void rope_backward_cuda(DType dtype, void* d_x, const void* d_out, int64_t batch, int64_t seq_len, int64_t num_heads,
                        int64_t head_dim, double theta, int64_t pos_offset, cudaStream_t stream) {
  rope_launch(dtype, d_x, d_out, batch, seq_len, num_heads, head_dim, theta, pos_offset, -1.0, stream,
              "rope_backward_cuda");
}

}  // namespace flowmoe
