// Fused SwiGLU (x prob) + rowwise 1x128 FP8 quantize on the GPU (math in kernels/swiglu_quant.h):
//   forward  h [M,2F] -> q [M,F] e4m3 + scale_inv [M, ceil(F/128)]: a group of 128/N lanes per
//            (row, 128-column block), N = 16 bytes of h per lane, the block amax a shuffle reduction.
//   backward d_a [M,F], h [M,2F] -> d_h [M,2F] (FP8 + scales, or dtype) and d_prob [M]. F % 128 == 0 (the
//            FP8 expert case): a warp per row makes each d_g and d_u block in registers. Otherwise one CTA per
//            row stages [d_g | d_u] in shared memory (its 1x128 blocks may straddle the gate/up seam) and a
//            warp per block quantizes it. d_prob is a fixed-order reduction either way (no atomics).
// Counted rows (kernels/common/counted_rows.h) bound M on the device; the grids are sized for every row.
// silu / silu' come from kernels/cuda/silu.cuh; products use __fmul_rn in the reference's order.
// The quantize building blocks (chunk loads, amax, e4m3 stores) come from kernels/cuda/quantize_rows.cuh.
// CPU reference: kernels/cpu/swiglu_quant.cpp. Tests: tests/test_swiglu_quant.cpp. The unfused baseline
// bench/bench_swiglu_quant.cpp measures against lives in bench/baselines/swiglu_quant_baseline.cu.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/packed.cuh"
#include "kernels/cuda/quantize_rows.cuh"
#include "kernels/cuda/silu.cuh"
#include "kernels/fp8.h"
#include "kernels/swiglu_quant.h"

namespace flowmoe {

namespace {

constexpr int kThreads = 256;

// ---- kernels ----------------------------------------------------------------------------------

// SwiGLU backward of N columns (math in kernels/swiglu_quant.h), adding the d_prob terms to dot in
// column order; shared by both backward kernels so their products round alike.
template <int N>
__device__ __forceinline__ void swiglu_grad_chunk(const float (&g)[N], const float (&u)[N], const float (&da)[N],
                                                  float p, float& dot, float (&dg)[N], float (&du)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    const float s = silu_f32(g[e]), dy = __fmul_rn(da[e], p);
    dot = __fadd_rn(dot, __fmul_rn(da[e], __fmul_rn(s, u[e])));
    dg[e] = __fmul_rn(__fmul_rn(dy, u[e]), silu_grad_f32(g[e]));
    du[e] = __fmul_rn(dy, s);
  }
}

template <class T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_quant_forward_kernel(const T* __restrict__ h, const float* __restrict__ prob, int64_t M, int64_t F,
                                uint8_t* __restrict__ q, float* __restrict__ scale_inv, CountedRows counted) {
  constexpr int N = vec_elems<T>();
  quantize_rows<N, kVec>(counted_rows(M, counted), F, q, scale_inv, [&](int64_t r, int64_t j0, float(&a)[N]) {
    const T* gate = h + r * 2 * F;
    float g[N], u[N];
    load_chunk<T, kVec>(gate, j0, F, g);
    load_chunk<T, kVec>(gate + F, j0, F, u);
    const float p = prob ? prob[r] : 1.f;
#pragma unroll
    for (int e = 0; e < N; ++e) a[e] = __fmul_rn(__fmul_rn(silu_f32(g[e]), u[e]), p);
  });
}

// One CTA per row (grid-stride). Phase 1: each thread takes chunks of N columns j, writes d_g[j] and
// d_u[j] (fp32) to shared memory and adds its d_prob terms in a fixed order. Phase 2: a warp per
// 128-column block of the 2F-wide row quantizes (or converts) it.
template <class T, bool kVec>
__global__ void __launch_bounds__(1024)
    swiglu_quant_backward_kernel(const T* __restrict__ d_a, const T* __restrict__ h, const float* __restrict__ prob,
                                 int64_t all_rows, int64_t F, uint8_t* __restrict__ d_h_q,
                                 float* __restrict__ d_h_scale_inv, T* __restrict__ d_h, float* __restrict__ d_prob,
                                 CountedRows counted) {
  constexpr int N = vec_elems<T>();
  const int64_t M = counted_rows(all_rows, counted);
  extern __shared__ float4 smem_f4[];
  float* row_grad = reinterpret_cast<float*>(smem_f4);  // [2F]: [d_g | d_u] of the current row
  __shared__ float scratch[32];
  const bool want_h = d_h_q != nullptr || d_h != nullptr;
  const int64_t K = 2 * F, nb = fp8_num_blocks(K), num_chunks = (F + N - 1) / N;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  for (int64_t r = blockIdx.x; r < M; r += gridDim.x) {
    const T* gate = h + r * K;
    const float p = prob ? prob[r] : 1.f;
    float dot = 0.f;
    for (int64_t c = threadIdx.x; c < num_chunks; c += blockDim.x) {
      const int64_t j0 = c * N;
      float g[N], u[N], da[N], dg[N], du[N];
      load_chunk<T, kVec>(gate, j0, F, g);
      load_chunk<T, kVec>(gate + F, j0, F, u);
      load_chunk<T, kVec>(d_a + r * F, j0, F, da);
      swiglu_grad_chunk(g, u, da, p, dot, dg, du);
      if (!want_h) continue;
      if constexpr (kVec) {
#pragma unroll
        for (int k = 0; k < N; k += 4) {
          *reinterpret_cast<float4*>(row_grad + j0 + k) = make_float4(dg[k], dg[k + 1], dg[k + 2], dg[k + 3]);
          *reinterpret_cast<float4*>(row_grad + F + j0 + k) = make_float4(du[k], du[k + 1], du[k + 2], du[k + 3]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e)
          if (j0 + e < F) row_grad[j0 + e] = dg[e], row_grad[F + j0 + e] = du[e];
      }
    }
    if (d_prob) {
      dot = block_sum(dot, scratch);  // fixed shuffle tree: deterministic
      if (threadIdx.x == 0) d_prob[r] = dot;
    }
    if (!want_h) continue;
    __syncthreads();  // row_grad complete
    for (int64_t b = warp; b < nb; b += num_warps) {
      const int64_t c0 = b * kFp8BlockSize + lane * 4;
      float v[4];
      if (kVec && c0 < K) {
        const float4 x = *reinterpret_cast<const float4*>(row_grad + c0);
        v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = c0 + e < K ? row_grad[c0 + e] : 0.f;
      }
      if (d_h_q) {
        float amax = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) amax = fp8_amax_update(amax, v[e]);
        amax = group_amax<32>(amax);
        const float s_inv = fp8_scale_inv(amax);
        if (lane == 0) d_h_scale_inv[r * nb + b] = s_inv;
        if (c0 < K) store_e4m3<kVec>(d_h_q + r * K + c0, v, fp8_scale_from_inv(s_inv), c0, K);
      }
      if (d_h && c0 < K) {
        Packed<T, 4 * sizeof(T)> out;
#pragma unroll
        for (int e = 0; e < 4; ++e) out.set(e, v[e]);
        if (kVec) {
          out.store(d_h + r * K + c0);
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (c0 + e < K) d_h[r * K + c0 + e] = out.v[e];
        }
      }
    }
    __syncthreads();  // the next row overwrites row_grad
  }
}

// F a multiple of 128 (every FP8 expert width): no 1x128 block of d_h straddles the gate/up seam, so a
// lane group computes the d_g block and the d_u block of the same 128 columns straight from registers,
// without staging the row in shared memory. One warp per row (grid-stride): groups of L = 128/N lanes
// take one block each, and d_prob is the warp's fixed-order shuffle sum (deterministic, no atomics).
template <class T>
__global__ void __launch_bounds__(kThreads)
    swiglu_quant_backward_aligned_kernel(const T* __restrict__ d_a, const T* __restrict__ h,
                                         const float* __restrict__ prob, int64_t all_rows, int64_t F,
                                         uint8_t* __restrict__ d_h_q, float* __restrict__ d_h_scale_inv,
                                         T* __restrict__ d_h, float* __restrict__ d_prob, CountedRows counted) {
  constexpr int N = vec_elems<T>(), L = kFp8BlockSize / N, kGroupsPerWarp = 32 / L;
  const int64_t M = counted_rows(all_rows, counted);
  const int64_t K = 2 * F, nb_f = F / kFp8BlockSize, nb = 2 * nb_f;
  const int lane = threadIdx.x & 31, sub = lane % L, group = lane / L;
  const int64_t num_warps = (int64_t(gridDim.x) * blockDim.x) >> 5;
  for (int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5; r < M; r += num_warps) {
    const T* gate = h + r * K;
    const float p = prob ? prob[r] : 1.f;
    float dot = 0.f;
    for (int64_t b0 = 0; b0 < nb_f; b0 += kGroupsPerWarp) {  // warp-uniform trip count: shuffles see all lanes
      const int64_t b = b0 + group, j0 = b * kFp8BlockSize + sub * N;
      const bool valid = b < nb_f;
      float g[N], u[N], da[N], dg[N], du[N];
      if (valid) {
        load_chunk<T, true>(gate, j0, F, g);
        load_chunk<T, true>(gate + F, j0, F, u);
        load_chunk<T, true>(d_a + r * F, j0, F, da);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) g[e] = u[e] = da[e] = 0.f;
      }
      swiglu_grad_chunk(g, u, da, p, dot, dg, du);
      if (d_h_q) {
        float amax_g = 0.f, amax_u = 0.f;
#pragma unroll
        for (int e = 0; e < N; ++e) amax_g = fp8_amax_update(amax_g, dg[e]), amax_u = fp8_amax_update(amax_u, du[e]);
        amax_g = group_amax<L>(amax_g);
        amax_u = group_amax<L>(amax_u);
        if (valid) {
          const float s_g = fp8_scale_inv(amax_g), s_u = fp8_scale_inv(amax_u);
          if (sub == 0) d_h_scale_inv[r * nb + b] = s_g, d_h_scale_inv[r * nb + nb_f + b] = s_u;
          store_e4m3<true>(d_h_q + r * K + j0, dg, fp8_scale_from_inv(s_g), j0, K);
          store_e4m3<true>(d_h_q + r * K + F + j0, du, fp8_scale_from_inv(s_u), j0, K);
        }
      }
      if (d_h && valid) {
        Packed<T, 16> out_g, out_u;
#pragma unroll
        for (int e = 0; e < N; ++e) out_g.set(e, dg[e]), out_u.set(e, du[e]);
        out_g.store(d_h + r * K + j0);
        out_u.store(d_h + r * K + F + j0);
      }
    }
    if (d_prob) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) dot = __fadd_rn(dot, __shfl_xor_sync(0xffffffffu, dot, o));
      if (lane == 0) d_prob[r] = dot;
    }
  }
}

// Blocks for the forward/quantize grid: one group of 128/N lanes per (row, block), grid-stride beyond.
unsigned quantize_grid(int64_t M, int64_t K, int N) {
  return grid_size(M * fp8_num_blocks(K) * (kFp8BlockSize / N), kThreads);
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void swiglu_quant_forward_cuda(DType dtype, const void* h, const float* prob, int64_t M, int64_t F, uint8_t* q,
                               float* scale_inv, cudaStream_t stream, CountedRows counted) {
  FLOWMOE_CHECK(M >= 0 && F >= 0, ShapeError, "swiglu_quant_forward_cuda: bad shape M ", M, ", F ", F);
  if (M == 0 || F == 0) return;
  FLOWMOE_CHECK(h && q && scale_inv, Error, "swiglu_quant_forward_cuda: null h, q or scale_inv (M ", M, ", F ", F, ")");
  dispatch_cuda_float(dtype, "swiglu_quant_forward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int N = vec_elems<T>();
    const bool vec = F % N == 0 && aligned_to(h, 16) && aligned_to(q, N);
    auto kernel = vec ? swiglu_quant_forward_kernel<T, true> : swiglu_quant_forward_kernel<T, false>;
    kernel<<<quantize_grid(M, F, N), kThreads, 0, stream>>>(static_cast<const T*>(h), prob, M, F, q, scale_inv,
                                                            counted);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void swiglu_quant_backward_cuda(DType dtype, const void* d_a, const void* h, const float* prob, int64_t M, int64_t F,
                                uint8_t* d_h_q, float* d_h_scale_inv, void* d_h, float* d_prob, cudaStream_t stream,
                                CountedRows counted) {
  FLOWMOE_CHECK(M >= 0 && F >= 0, ShapeError, "swiglu_quant_backward_cuda: bad shape M ", M, ", F ", F);
  FLOWMOE_CHECK(!d_h_q == !d_h_scale_inv, Error,
                "swiglu_quant_backward_cuda: d_h_q and d_h_scale_inv come together (one of them is null)");
  if (M == 0) return;
  if (F == 0) {  // no columns: d_prob is an empty sum
    if (d_prob) FLOWMOE_CUDA_CHECK(cudaMemsetAsync(d_prob, 0, size_t(M) * sizeof(float), stream));
    return;
  }
  FLOWMOE_CHECK(d_a && h, Error, "swiglu_quant_backward_cuda: null d_a or h (M ", M, ", F ", F, ")");
  const bool want_h = d_h_q || d_h;
  const size_t smem = want_h ? size_t(2 * F) * sizeof(float) : 0;
  const bool big_smem = smem + 32 * sizeof(float) > 48 * 1024;  // past the default: opt in (F > ~6000)
  if (big_smem) {
    int dev = 0, smem_optin = 0;
    FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
    FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    FLOWMOE_CHECK(smem + 32 * sizeof(float) <= size_t(smem_optin), ShapeError, "swiglu_quant_backward_cuda: F ", F,
                  " needs ", smem, " bytes of shared memory for a row of d_h, the device allows ", smem_optin);
  }
  dispatch_cuda_float(dtype, "swiglu_quant_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    constexpr int N = vec_elems<T>();
    const bool vec =
        F % N == 0 && aligned_to(h, 16) && aligned_to(d_a, 16) && aligned_to(d_h_q, 4) && aligned_to(d_h, 16);
    if (vec && F % kFp8BlockSize == 0 && aligned_to(d_h_q, N)) {  // the FP8 expert case: no seam, no shared memory
      const unsigned grid = grid_size(M * 32, kThreads);
      swiglu_quant_backward_aligned_kernel<T>
          <<<grid, kThreads, 0, stream>>>(static_cast<const T*>(d_a), static_cast<const T*>(h), prob, M, F, d_h_q,
                                          d_h_scale_inv, static_cast<T*>(d_h), d_prob, counted);
      return;
    }
    auto kernel = vec ? swiglu_quant_backward_kernel<T, true> : swiglu_quant_backward_kernel<T, false>;
    if (big_smem) allow_smem(kernel, smem);
    const int64_t chunks = (F + N - 1) / N;
    const int threads = int(chunks < 64 ? 64 : (chunks > 1024 ? 1024 : (chunks + 31) / 32 * 32));
    const unsigned grid = unsigned(M < (int64_t(1) << 30) ? M : (int64_t(1) << 30));
    kernel<<<grid, threads, smem, stream>>>(static_cast<const T*>(d_a), static_cast<const T*>(h), prob, M, F, d_h_q,
                                            d_h_scale_inv, static_cast<T*>(d_h), d_prob, counted);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
