// Rotary position embedding on the GPU.
//   out[b,t,h,2i:2i+2] = R(dir * (pos_offset + t) * theta^(-2i/hd)) x[b,t,h,2i:2i+2], x [B,T,nh,hd], hd even;
//   dir = +1 forward, -1 backward (the inverse rotation of d_out). f32 or bf16 data, fp32 math.
// One block per (b, t) row; it first fills a cos/sin table of hd/2 entries in shared memory, computed in
// double and rounded to float exactly as the CPU reference does, so f32 results agree to ~1 ulp. The same
// launch rotates a second tensor of the same rows (rope_qk_*: the keys beside the queries) from that table:
// the row's pairs of x, then of k, each computed as a launch for that tensor alone would.
// CPU reference: kernels/cpu/rope.cpp. Tests: tests/test_rope.cpp.
#include <cuda_bf16.h>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/rope.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

// One tensor's pair j of a row: rotated by the table's entry for its place in the head.
template <class T>
__device__ __forceinline__ void rope_pair(T* __restrict__ out, const T* __restrict__ x, int64_t e, float2 cs) {
  const float x0 = to_float(x[e]), x1 = to_float(x[e + 1]);
  out[e] = from_float<T>(x0 * cs.x - x1 * cs.y);
  out[e + 1] = from_float<T>(x0 * cs.y + x1 * cs.x);
}

// x [B*T, nh, hd] into out, and k [B*T, k_heads, hd] into k_out (k_heads 0: x alone).
template <class T>
__global__ void rope_kernel(T* __restrict__ out, const T* __restrict__ x, T* __restrict__ k_out,
                            const T* __restrict__ k, int seq_len, int num_heads, int k_heads, int head_dim,
                            double theta, int64_t pos_offset, double direction) {
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
  const int x_pairs = num_heads * half;
  for (int j = threadIdx.x; j < (num_heads + k_heads) * half; j += blockDim.x) {
    if (j < x_pairs) {
      rope_pair(out, x, row * num_heads * head_dim + 2 * int64_t(j), cos_sin[j % half]);
    } else {
      const int jk = j - x_pairs;
      rope_pair(k_out, k, row * k_heads * head_dim + 2 * int64_t(jk), cos_sin[jk % half]);
    }
  }
}

// ---- launchers --------------------------------------------------------------------------------

// k_heads 0: x alone (k and k_out unused).
static void rope_launch(DType dtype, void* out, const void* x, void* k_out, const void* k, int64_t batch,
                        int64_t seq_len, int64_t num_heads, int64_t k_heads, int64_t head_dim, double theta,
                        int64_t pos_offset, double direction, cudaStream_t stream, const char* what) {
  FLOWMOE_CHECK(batch >= 0 && seq_len >= 0 && num_heads >= 0 && k_heads >= 0 && head_dim >= 0, ShapeError, what,
                ": negative size");
  FLOWMOE_CHECK(head_dim % 2 == 0, ShapeError, what, ": head_dim must be even, got ", head_dim);
  FLOWMOE_CHECK(theta > 0, Error, what, ": theta must be positive, got ", theta);
  const int64_t rows = batch * seq_len, pairs = (num_heads + k_heads) * head_dim / 2;
  if (rows == 0 || pairs == 0) return;
  FLOWMOE_CHECK(rows < (int64_t(1) << 31) && (num_heads + k_heads) * head_dim < (int64_t(1) << 31), ShapeError, what,
                ": too large (batch*seq_len ", rows, ", heads*head_dim ", (num_heads + k_heads) * head_dim, ")");
  const int threads = int(pairs >= 256 ? 256 : (pairs + 31) / 32 * 32);
  const size_t smem = size_t(head_dim / 2) * sizeof(float2);
  dispatch_cuda_float(dtype, what, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_kernel<<<unsigned(rows), threads, smem, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(x), static_cast<T*>(k_out), static_cast<const T*>(k), int(seq_len),
        int(num_heads), int(k_heads), int(head_dim), theta, pos_offset, direction);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void rope_forward_cuda(DType dtype, void* out, const void* x, int64_t batch, int64_t seq_len, int64_t num_heads,
                       int64_t head_dim, double theta, int64_t pos_offset, cudaStream_t stream) {
  rope_launch(dtype, out, x, nullptr, nullptr, batch, seq_len, num_heads, 0, head_dim, theta, pos_offset, 1.0, stream,
              "rope_forward_cuda");
}

void rope_backward_cuda(DType dtype, void* d_x, const void* d_out, int64_t batch, int64_t seq_len, int64_t num_heads,
                        int64_t head_dim, double theta, int64_t pos_offset, cudaStream_t stream) {
  rope_launch(dtype, d_x, d_out, nullptr, nullptr, batch, seq_len, num_heads, 0, head_dim, theta, pos_offset, -1.0,
              stream, "rope_backward_cuda");
}

void rope_qk_forward_cuda(DType dtype, void* q_out, void* k_out, const void* q, const void* k, int64_t batch,
                          int64_t seq_len, int64_t q_heads, int64_t k_heads, int64_t head_dim, double theta,
                          int64_t pos_offset, cudaStream_t stream) {
  rope_launch(dtype, q_out, q, k_out, k, batch, seq_len, q_heads, k_heads, head_dim, theta, pos_offset, 1.0, stream,
              "rope_qk_forward_cuda");
}

void rope_qk_backward_cuda(DType dtype, void* d_q, void* d_k, const void* d_q_out, const void* d_k_out, int64_t batch,
                           int64_t seq_len, int64_t q_heads, int64_t k_heads, int64_t head_dim, double theta,
                           int64_t pos_offset, cudaStream_t stream) {
  rope_launch(dtype, d_q, d_q_out, d_k, d_k_out, batch, seq_len, q_heads, k_heads, head_dim, theta, pos_offset, -1.0,
              stream, "rope_qk_backward_cuda");
}

}  // namespace flowmoe
