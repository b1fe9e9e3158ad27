// AdamW with the FP8 block copy written in the same kernel (kernels/adamw_fp8.h): one CTA per 128x128 block of a
// weight [B, N, K]. Each thread updates 16 rows x 4 columns of the block (a warp per row, lanes along K, so every
// access is coalesced), keeps the updated values as the forward reads them in registers, and the CTA reduces
// their amax (NaN-propagating); then the bytes go to q from registers and, through a shared-memory tile, to the
// transpose q_t. The element update is kernels/adamw.h's adamw_element and the quantize is quantize_block_kernel's
// (x * scale, a power of two, converted by cvt.rn.satfinite.e4m3), so the CPU reference
// kernels/cpu/adamw_fp8.cpp agrees bit for bit. Tests: tests/test_adamw_fp8.cpp.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/adamw_fp8.h"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/fp8.h"

namespace flowmoe {

namespace {

constexpr int kBlk = kFp8BlockSize;  // 128
constexpr int kThreads = 256, kWarps = kThreads / 32;
constexpr int kRowsPerThread = kBlk / kWarps;  // 16: warp w takes rows w, w + 8, ...
constexpr int kColsPerThread = kBlk / 32;      // 4: lane l takes columns l, l + 32, ...
constexpr int kBatchRows = 2;                  // rows whose loads are in flight together (16 per thread)

__device__ __forceinline__ float load_moment(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_moment(const uint16_t* p, int64_t i) { return bf16_bits_value(p[i]); }

// M: the moments' type (float, or uint16_t: bf16 bits). Block row r0 + blockIdx.y (r = b * nbn + bn): a range's
// (kernels/adamw_fp8.h), whose buffers in t start at element t.rounding.first_index.
template <class M>
__global__ void __launch_bounds__(kThreads, 2)
    adamw_fp8_kernel(const __grid_constant__ AdamWTensor t, const __grid_constant__ Fp8BlockCopy c, int64_t r0,
                     const StepScalars* __restrict__ control) {
  if (control && !control->apply) return;  // a skipped step: nothing moves, the copy stays the weights'
  const AdamWStep s = control ? scheduled_adamw_step(t.step, *control, t.lr_multiplier) : t.step;
  __shared__ uint8_t tile[kBlk][kBlk + 4];  // the block's bytes, [row][column]
  __shared__ float warp_amaxes[kWarps];
  constexpr bool kNarrow = sizeof(M) == 2;
  M* __restrict__ exp_avg = static_cast<M*>(t.exp_avg);
  M* __restrict__ exp_avg_sq = static_cast<M*>(t.exp_avg_sq);
  const uint64_t stream = kNarrow ? rounding_stream(t.rounding.key, s.update) : 0;
  const int64_t N = c.N, K = c.K, nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K);
  const int64_t r = r0 + blockIdx.y, bk = blockIdx.x, bn = r % nbn, b = r / nbn;
  const int64_t n0 = bn * kBlk, k0 = bk * kBlk, base = b * N * K, first = t.rounding.first_index;
  const int warp = int(threadIdx.x) >> 5, lane = int(threadIdx.x) & 31;
  float x[kRowsPerThread][kColsPerThread], amax = 0.f;
  // The loads of kBatchRows rows go out together before any store: the stores may alias the next loads as far as
  // the compiler knows, so element by element each update would wait a whole memory latency.
#pragma unroll
  for (int p0 = 0; p0 < kRowsPerThread; p0 += kBatchRows) {
    float w[kBatchRows][kColsPerThread], m[kBatchRows][kColsPerThread], v[kBatchRows][kColsPerThread],
        g[kBatchRows][kColsPerThread];
#pragma unroll
    for (int pp = 0; pp < kBatchRows; ++pp)
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        const int64_t n = n0 + warp + kWarps * (p0 + pp), k = k0 + lane + 32 * j;
        if (n < N && k < K) {
          const int64_t at = base + n * K + k - first;  // in t's buffers
          w[pp][j] = t.param[at];
          m[pp][j] = load_moment(exp_avg, at);
          v[pp][j] = load_moment(exp_avg_sq, at);
          g[pp][j] = t.grad[at];
        }
      }
#pragma unroll
    for (int pp = 0; pp < kBatchRows; ++pp)
#pragma unroll
      for (int j = 0; j < kColsPerThread; ++j) {
        const int64_t n = n0 + warp + kWarps * (p0 + pp), k = k0 + lane + 32 * j;
        float value = 0.f;  // outside the weight: zeros, which leave the amax as it is
        if (n < N && k < K) {
          const int64_t i = base + n * K + k, at = i - first;  // in the whole tensor; in t's buffers
          adamw_element(w[pp][j], m[pp][j], v[pp][j], g[pp][j], s);
          t.param[at] = w[pp][j];
          if constexpr (kNarrow) {
            round_moments_bf16(m[pp][j], v[pp][j], stream, i, &exp_avg[at], &exp_avg_sq[at]);
          } else {
            exp_avg[at] = m[pp][j];
            exp_avg_sq[at] = v[pp][j];
          }
          value = w[pp][j];
          if (t.copy.data && t.copy.dtype == DType::f32) static_cast<float*>(t.copy.data)[at] = value;
          if (t.copy.data && t.copy.dtype == DType::bf16) {
            const uint16_t bits = __bfloat16_as_ushort(__float2bfloat16_rn(value));
            static_cast<uint16_t*>(t.copy.data)[at] = bits;
            value = bf16_bits_value(bits);  // the forward reads the bf16 copy
          }
        }
        x[p0 + pp][j] = value;
        amax = fp8_amax_update(amax, value);
      }
  }
  for (int o = 16; o > 0; o >>= 1) amax = fp8_amax_update(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if (lane == 0) warp_amaxes[warp] = amax;
  __syncthreads();
  amax = 0.f;
  for (int i = 0; i < kWarps; ++i) amax = fp8_amax_update(amax, warp_amaxes[i]);
  const float s_inv = fp8_scale_inv(amax), scale = fp8_scale_from_inv(s_inv);
  if (threadIdx.x == 0) {
    c.scale_inv[(b * nbn + bn) * nbk + bk] = s_inv;
    if (c.scale_inv_t) c.scale_inv_t[(b * nbk + bk) * nbn + bn] = s_inv;
  }
#pragma unroll
  for (int p = 0; p < kRowsPerThread; ++p)
#pragma unroll
    for (int j = 0; j < kColsPerThread; ++j) {
      const int row = warp + kWarps * p, col = lane + 32 * j;
      const uint8_t byte = uint8_t(__nv_cvt_float_to_fp8(__fmul_rn(x[p][j], scale), __NV_SATFINITE, __NV_E4M3));
      if (n0 + row < N && k0 + col < K) c.q[base + (n0 + row) * K + k0 + col] = byte;
      tile[row][col] = byte;
    }
  if (!c.q_t) return;  // a range: the transpose is rebuilt once the copy is whole (fp8_block_transpose_cuda)
  __syncthreads();
  // q_t [B, K, N]: row k0 + kk holds the block's column kk; consecutive threads write consecutive n.
  for (int e = int(threadIdx.x); e < kBlk * kBlk; e += kThreads) {
    const int kk = e / kBlk, nn = e % kBlk;
    if (k0 + kk < K && n0 + nn < N) c.q_t[base + (k0 + kk) * N + n0 + nn] = tile[nn][kk];
  }
}

// One CTA per 128x128 block (grid: nbk, nbn, B): the block's bytes through a shared tile, read along k and written
// along n, as adamw_fp8_kernel's transpose; thread 0 moves the block's scale.
__global__ void fp8_block_transpose_kernel(const __grid_constant__ Fp8BlockCopy c) {
  __shared__ uint8_t tile[kBlk][kBlk + 4];
  const int64_t N = c.N, K = c.K, nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K);
  const int64_t bk = blockIdx.x, bn = blockIdx.y, b = blockIdx.z, n0 = bn * kBlk, k0 = bk * kBlk, base = b * N * K;
  if (threadIdx.x == 0) c.scale_inv_t[(b * nbk + bk) * nbn + bn] = c.scale_inv[(b * nbn + bn) * nbk + bk];
  for (int e = int(threadIdx.x); e < kBlk * kBlk; e += kThreads) {
    const int nn = e / kBlk, kk = e % kBlk;
    if (n0 + nn < N && k0 + kk < K) tile[nn][kk] = c.q[base + (n0 + nn) * K + k0 + kk];
  }
  __syncthreads();
  for (int e = int(threadIdx.x); e < kBlk * kBlk; e += kThreads) {
    const int kk = e / kBlk, nn = e % kBlk;
    if (k0 + kk < K && n0 + nn < N) c.q_t[base + (k0 + kk) * N + n0 + nn] = tile[nn][kk];
  }
}

}  // namespace

void fp8_block_transpose_cuda(const Fp8BlockCopy& c, cudaStream_t stream) {
  FLOWMOE_CHECK(c.B < 65536 && fp8_num_blocks(c.N) < 65536, ShapeError, "fp8_block_transpose_cuda: [", c.B, ", ", c.N,
                ", ", c.K, "] has too many matrices or row blocks for one launch");
  if (c.B * c.N * c.K == 0) return;
  const dim3 grid(unsigned(fp8_num_blocks(c.K)), unsigned(fp8_num_blocks(c.N)), unsigned(c.B));
  fp8_block_transpose_kernel<<<grid, kThreads, 0, stream>>>(c);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void adamw_fp8_cuda(const AdamWFp8Tensor* tensors, int64_t num_tensors, const StepScalars* control,
                    cudaStream_t stream) {
  const char* what = "adamw_fp8_cuda";
  check_adamw_fp8(tensors, num_tensors, what);
  for (int64_t i = 0; i < num_tensors; ++i) {
    const Fp8BlockCopy& c = tensors[i].fp8;
    FLOWMOE_CHECK(c.B * fp8_num_blocks(c.N) < 65536, ShapeError, what, ": tensor ", i, " [", c.B, ", ", c.N, ", ", c.K,
                  "] has too many row blocks for one launch");
  }
  for (int64_t i = 0; i < num_tensors; ++i) {
    const AdamWFp8Tensor& w = tensors[i];
    if (w.t.n == 0) continue;
    // The range's block rows (kernels/adamw_fp8.h; a whole tensor: all of them).
    const int64_t nbn = fp8_num_blocks(w.fp8.N), row = kFp8BlockSize * w.fp8.K;
    const bool whole = w.t.n == w.fp8.B * w.fp8.N * w.fp8.K;
    const int64_t r0 = whole ? 0 : w.t.rounding.first_index / row, rows = whole ? w.fp8.B * nbn : w.t.n / row;
    const dim3 grid(unsigned(fp8_num_blocks(w.fp8.K)), unsigned(rows), 1);
    if (w.t.moment_dtype == DType::bf16)
      adamw_fp8_kernel<uint16_t><<<grid, kThreads, 0, stream>>>(w.t, w.fp8, r0, control);
    else
      adamw_fp8_kernel<float><<<grid, kThreads, 0, stream>>>(w.t, w.fp8, r0, control);
    FLOWMOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace flowmoe
