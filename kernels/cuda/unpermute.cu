// MoE unpermute + unpad with merging probs on the GPU (math in kernels/unpermute.h).
//   forward:  one thread group per token gathers its routed rows (16-byte vectors, four vectors of
//             four rows in flight per thread) and accumulates prob * row with fmaf in fp32, j
//             ascending (bit-identical to the CPU reference)
//   backward: one group per token loads dy once, stores prob * dy to each of its rows and reduces
//             rows . dy per slot (per-warp partials in shared memory: deterministic); the other
//             groups zero the pad and tail rows of d_rows. Nothing is memset first.
// CPU reference: kernels/cpu/unpermute.cpp. Tests: tests/test_unpermute.cpp. Bench: bench/bench_permute.cpp.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstring>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/packed.cuh"
#include "kernels/cuda/pad_rows.cuh"
#include "kernels/unpermute.h"

namespace flowmoe {

namespace {

constexpr int kThreads = 256;  // blocks hold 256 / group thread groups
constexpr int kWarps = kThreads / 32;
constexpr int kUnroll = 4;                   // backward: vectors per thread per pass
constexpr int kForwardUnroll = 4;            // forward: vectors per thread per pass
constexpr int kForwardRows = 4;              // forward: routed rows loaded before accumulating (16 vectors in flight)
constexpr int kMaxTopk = kUnpermuteMaxTopk;  // kernels/unpermute.h

// ---- kernels ----------------------------------------------------------------------------------

// Each thread keeps kForwardUnroll vectors of fp32 sums and loads kForwardRows routed rows before
// adding them. Loads in flight per SM set the bandwidth: on an H200 this runs at 0.93-0.99 of copy
// where two vectors of two rows reached 0.85-0.92 (bench/bench_permute.cpp, docs/PERF.md).
template <class T, int VB>
__global__ void __launch_bounds__(kThreads)
    unpermute_kernel(const int32_t* __restrict__ row_map /*[T,k]*/, int64_t num_tokens, int top_k, int64_t nvec,
                     int group, const T* __restrict__ rows /*[num_rows, nvec*n]*/,
                     const float* __restrict__ topk_prob /*[T,k]*/, T* __restrict__ y /*[T, nvec*n]*/) {
  using P = Packed<T, VB>;
  constexpr int U = kForwardUnroll;
  extern __shared__ unsigned char s_raw[];
  __shared__ int s_count[kWarps];  // routed slots per group
  const int groups = blockDim.x / group, g = threadIdx.x / group, lane = threadIdx.x % group;
  int32_t* s_row = reinterpret_cast<int32_t*>(s_raw) + g * top_k;                   // [groups, k]
  float* s_prob = reinterpret_cast<float*>(s_raw) + (groups + g) * int64_t(top_k);  // [groups, k]
  const int64_t t = int64_t(blockIdx.x) * groups + g;
  if (t < num_tokens)
    for (int j = lane; j < top_k; j += group) {
      s_row[j] = row_map[t * top_k + j];
      s_prob[j] = topk_prob ? topk_prob[t * top_k + j] : 1.f;
    }
  __syncthreads();
  if (t < num_tokens && lane == 0) {  // routed slots first, j ascending: the loop below needs no branch
    int count = 0;
    for (int j = 0; j < top_k; ++j)
      if (s_row[j] >= 0) {
        s_row[count] = s_row[j];
        s_prob[count] = s_prob[j];
        ++count;
      }
    s_count[g] = count;
  }
  __syncthreads();
  if (t >= num_tokens) return;
  const int count = s_count[g];
  constexpr int R = kForwardRows;
  for (int64_t v0 = 0; v0 < nvec; v0 += int64_t(group) * U) {
    float acc[U][P::n] = {};
#pragma unroll 1
    for (int j0 = 0; j0 < count; j0 += R) {
      P in[R][U];  // all loads of R rows first, then the fmas in j order
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (j0 + r >= count) continue;
        const T* src = rows + int64_t(s_row[j0 + r]) * nvec * P::n;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int64_t v = v0 + u * group + lane;
          if (v < nvec) in[r][u] = P::load(src + v * P::n);
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (j0 + r >= count) continue;
        const float p = s_prob[j0 + r];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int e = 0; e < P::n; ++e) acc[u][e] = fmaf(p, in[r][u].get(e), acc[u][e]);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t v = v0 + u * group + lane;
      if (v < nvec) {
        P out{};
#pragma unroll
        for (int e = 0; e < P::n; ++e) out.set(e, acc[u][e]);
        out.store(y + (t * nvec + v) * P::n);
      }
    }
  }
}

struct BackwardArgs {
  const int32_t* row_map;  // [T,k]
  const int32_t* tokens;   // [L]
  const int32_t* seg;      // [L+1]
  const float* topk_prob;  // [T,k] or null (weights 1)
  float* d_topk_prob;      // [T,k] or null
  int64_t num_tokens, nvec, num_rows, token_blocks, num_pad_items;
  int top_k, num_local, align, group;
};

// Blocks [0, token_blocks) hold 256 / group tokens each. The blocks after them hold 8 pad warps each:
// pad warp p zeroes the pad and tail rows of d_rows of pad item p (kernels/cuda/pad_rows.cuh).
template <class T, int VB>
__global__ void __launch_bounds__(kThreads)
    unpermute_backward_kernel(const BackwardArgs a, const T* __restrict__ rows /*[num_rows, nvec*n]*/,
                              const T* __restrict__ dy /*[T, nvec*n]*/, T* __restrict__ d_rows /*[num_rows, nvec*n]*/) {
  using P = Packed<T, VB>;
  extern __shared__ unsigned char s_raw[];
  if (blockIdx.x >= a.token_blocks) {
    const int lane = threadIdx.x & 31;
    const int64_t p = (int64_t(blockIdx.x) - a.token_blocks) * kWarps + (threadIdx.x >> 5);
    if (p >= a.num_pad_items) return;
    auto zero_row = [&](int64_t r) {
      P zero{};
#pragma unroll
      for (int e = 0; e < P::n; ++e) zero.set(e, 0.f);
      for (int64_t v = lane; v < a.nvec; v += 32) zero.store(d_rows + (r * a.nvec + v) * P::n);
    };
    for_each_pad_row(p, a.num_pad_items, a.seg, a.tokens, a.num_local, a.align, a.num_rows, zero_row);
    return;
  }
  const int groups = blockDim.x / a.group, g = threadIdx.x / a.group, lane = threadIdx.x % a.group;
  const int warp = threadIdx.x >> 5, warps_per_group = a.group >> 5;
  int32_t* s_row = reinterpret_cast<int32_t*>(s_raw) + g * a.top_k;                   // [groups, k]
  float* s_prob = reinterpret_cast<float*>(s_raw) + (groups + g) * int64_t(a.top_k);  // [groups, k]
  float* s_dot = reinterpret_cast<float*>(s_raw) + 2 * groups * int64_t(a.top_k);     // [warps, k]
  const int64_t item = int64_t(blockIdx.x) * groups + g;
  const bool is_token = item < a.num_tokens;
  if (is_token)
    for (int j = lane; j < a.top_k; j += a.group) {
      s_row[j] = a.row_map[item * a.top_k + j];
      s_prob[j] = a.topk_prob ? a.topk_prob[item * a.top_k + j] : 1.f;
    }
  for (int i = threadIdx.x; i < kWarps * a.top_k; i += blockDim.x) s_dot[i] = 0.f;
  __syncthreads();

  if (is_token) {
    for (int64_t v0 = 0; v0 < a.nvec; v0 += int64_t(a.group) * kUnroll) {
      float g_in[kUnroll][P::n] = {};
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * a.group + lane;
        if (v < a.nvec) {
          const P in = P::load(dy + (item * a.nvec + v) * P::n);
#pragma unroll
          for (int e = 0; e < P::n; ++e) g_in[u][e] = in.get(e);
        }
      }
      for (int j = 0; j < a.top_k; ++j) {
        const int32_t r = s_row[j];
        if (r < 0) continue;
        if (d_rows) {
          const float p = s_prob[j];
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + u * a.group + lane;
            if (v < a.nvec) {
              P out{};
#pragma unroll
              for (int e = 0; e < P::n; ++e) out.set(e, p * g_in[u][e]);
              out.store(d_rows + (int64_t(r) * a.nvec + v) * P::n);
            }
          }
        }
        if (a.d_topk_prob) {
          float part = 0.f;
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            const int64_t v = v0 + u * a.group + lane;
            if (v < a.nvec) {
              const P in = P::load(rows + (int64_t(r) * a.nvec + v) * P::n);
#pragma unroll
              for (int e = 0; e < P::n; ++e) part = fmaf(in.get(e), g_in[u][e], part);
            }
          }
          part = warp_sum(part);  // the whole warp is in this group and takes the same branch
          if ((threadIdx.x & 31) == 0) s_dot[warp * a.top_k + j] += part;
        }
      }
    }
  }

  if (!a.d_topk_prob) return;
  __syncthreads();
  if (is_token)
    for (int j = lane; j < a.top_k; j += a.group) {
      float dot = 0.f;  // the group's warps in order: a fixed reduction tree
      for (int w = g * warps_per_group; w < (g + 1) * warps_per_group; ++w) dot += s_dot[w * a.top_k + j];
      a.d_topk_prob[item * a.top_k + j] = s_row[j] >= 0 ? dot : 0.f;
    }
}

// Threads per token: enough that one pass of `unroll` vectors per thread covers a row when it can.
int group_for(int64_t nvec, int unroll) {
  if (nvec <= 32 * unroll) return 32;
  if (nvec <= 64 * unroll) return 64;
  if (nvec <= 128 * unroll) return 128;
  return 256;
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

void unpermute_cuda(DType dtype, const int32_t* row_map, int64_t num_tokens, int top_k, int64_t hidden,
                    const void* rows, const float* topk_prob, void* y, cudaStream_t stream) {
  FLOWMOE_CHECK(top_k >= 1 && top_k <= kMaxTopk, Error, "unpermute_cuda: top_k must be in [1, ", kMaxTopk, "], got ",
                top_k);
  if (num_tokens == 0 || hidden == 0) return;
  dispatch_cuda_float(dtype, "unpermute_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool wide = hidden * int64_t(sizeof(T)) % 16 == 0 && aligned_to(rows, 16) && aligned_to(y, 16);
    auto launch = [&](auto kernel, int elems_per_vec) {
      const int64_t nvec = hidden / elems_per_vec;
      const int group = group_for(nvec, kForwardUnroll), groups = kThreads / group;
      const unsigned blocks = unsigned((num_tokens + groups - 1) / groups);
      const size_t smem = size_t(2 * groups) * top_k * 4;
      kernel<<<blocks, kThreads, smem, stream>>>(row_map, num_tokens, top_k, nvec, group, static_cast<const T*>(rows),
                                                 topk_prob, static_cast<T*>(y));
    };
    if (wide)
      launch(unpermute_kernel<T, 16>, 16 / int(sizeof(T)));
    else
      launch(unpermute_kernel<T, int(sizeof(T))>, 1);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void unpermute_backward_cuda(DType dtype, const UnpermuteBackwardArgs& in, cudaStream_t stream) {
  FLOWMOE_CHECK(in.top_k >= 1 && in.top_k <= kMaxTopk, Error, "unpermute_backward_cuda: top_k must be in [1, ",
                kMaxTopk, "], got ", in.top_k);
  FLOWMOE_CHECK(in.num_local_experts >= 1 &&
                    (in.align_size == 16 || in.align_size == 32 || in.align_size == 64 || in.align_size == 128),
                Error, "unpermute_backward_cuda: need >= 1 local expert and align_size 16/32/64/128, got ",
                in.num_local_experts, " and ", in.align_size);
  FLOWMOE_CHECK(!in.d_topk_prob || in.rows, Error, "unpermute_backward_cuda: d_topk_prob needs rows");
  if (!in.d_rows && !in.d_topk_prob) return;
  BackwardArgs a{};
  a.row_map = in.row_map, a.tokens = in.tokens_per_expert, a.seg = in.segment_starts, a.topk_prob = in.topk_prob;
  a.d_topk_prob = in.d_topk_prob;
  a.num_tokens = in.num_tokens, a.num_rows = in.num_rows, a.top_k = in.top_k, a.num_local = in.num_local_experts;
  a.align = in.align_size;
  a.num_pad_items = in.d_rows ? pad_item_count(a.num_local, a.align, a.num_rows) : 0;
  if (a.num_tokens == 0 && a.num_pad_items == 0) return;
  dispatch_cuda_float(dtype, "unpermute_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool wide = in.hidden * int64_t(sizeof(T)) % 16 == 0 && aligned_to(in.rows, 16) && aligned_to(in.dy, 16) &&
                      aligned_to(in.d_rows, 16);
    auto launch = [&](auto kernel, int elems_per_vec) {
      a.nvec = in.hidden / elems_per_vec;
      a.group = group_for(a.nvec, kUnroll);
      const int groups = kThreads / a.group;
      a.token_blocks = (a.num_tokens + groups - 1) / groups;
      const unsigned blocks = unsigned(a.token_blocks + (a.num_pad_items + kWarps - 1) / kWarps);
      const size_t smem = size_t(2 * groups + kWarps) * a.top_k * 4;
      kernel<<<blocks, kThreads, smem, stream>>>(a, static_cast<const T*>(in.rows), static_cast<const T*>(in.dy),
                                                 static_cast<T*>(in.d_rows));
    };
    if (wide)
      launch(unpermute_backward_kernel<T, 16>, 16 / int(sizeof(T)));
    else
      launch(unpermute_backward_kernel<T, int(sizeof(T))>, 1);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
