// The expert-parallel exchange layout on the GPU (formulas, capacity: kernels/ep_layout.h): one CTA, since the
// tables hold n·L entries (a few hundred) and each is a short loop over the counts. It runs on the
// stream after the counts' all-gather, so no count ever reaches the host.
// CPU reference: kernels/cpu/ep_layout.cpp (the same loops). Tests: tests/test_ep_layout.cpp.
#include "kernels/common/cuda_check.h"
#include "kernels/ep_layout.h"

namespace flowmoe {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int64_t round_up(int64_t v, int a) { return (v + a - 1) / a * a; }

// counts [n, E] i32, E = n·L; smem: total [E], seg [E] (i64), then the need.
__global__ void ep_layout_kernel(EpLayoutDims d, const int32_t* __restrict__ counts, int32_t* __restrict__ out,
                                 int32_t* __restrict__ most_needed) {
  extern __shared__ int64_t smem[];
  const int n = d.num_ranks, L = d.num_local_experts, me = d.rank, E = n * L;
  int64_t* total = smem;
  int64_t* seg = smem + E;
  for (int g = threadIdx.x; g < E; g += blockDim.x) {
    int64_t s = 0;
    for (int p = 0; p < n; ++p) s += counts[int64_t(p) * E + g];
    total[g] = s;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < E; g += blockDim.x) {  // the owner's segment start: a scan within its L experts
    int64_t s = 0;
    for (int h = g - g % L; h < g; ++h) s += round_up(total[h], d.align_size);
    seg[g] = s;
  }
  __syncthreads();
  int64_t& need = smem[2 * E];  // the most padded rows any rank receives
  if (threadIdx.x == 0) {
    need = 0;
    for (int q = 0; q < n; ++q) {
      const int64_t rows = seg[q * L + L - 1] + round_up(total[q * L + L - 1], d.align_size);
      need = rows > need ? rows : need;
    }
  }
  __syncthreads();
  if (d.capacity > 0 && need > d.capacity) {  // every rank lays out the same empty exchange
    for (int64_t i = threadIdx.x; i < ep_layout_size(n, L); i += blockDim.x)
      out[i] = i == ep_layout_overflow_offset(n, L) ? int32_t(need) : 0;
    if (threadIdx.x == 0 && most_needed) atomicMax(most_needed, int32_t(need));
    return;
  }
  if (threadIdx.x == 0) out[ep_layout_overflow_offset(n, L)] = 0;
  auto sorted_start = [&](int p, int g) {
    int64_t s = 0;
    for (int h = 0; h < g; ++h) s += round_up(counts[int64_t(p) * E + h], d.sorted_align);
    return s;
  };
  for (int e = threadIdx.x; e < L; e += blockDim.x) {
    const int g = me * L + e;
    out[e] = int32_t(total[g]);
    out[ep_layout_padded_offset(n, L) + e] = int32_t(round_up(total[g], d.align_size));
    out[ep_layout_starts_offset(n, L) + e] = int32_t(seg[g]);
    if (e == L - 1) out[ep_layout_starts_offset(n, L) + L] = int32_t(seg[g] + round_up(total[g], d.align_size));
  }
  int32_t* to_experts = out + ep_layout_to_experts_offset(n, L);
  int32_t* to_tokens = out + ep_layout_to_tokens_offset(n, L);
  for (int i = threadIdx.x; i < E; i += blockDim.x) {
    {  // to_experts: i = q·L + e, q's expert e
      int64_t before = 0;
      for (int p = 0; p < me; ++p) before += counts[int64_t(p) * E + i];
      int32_t* t = to_experts + 3 * int64_t(i);
      t[0] = int32_t(sorted_start(me, i)), t[1] = int32_t(seg[i] + before), t[2] = counts[int64_t(me) * E + i];
    }
    {  // to_tokens: i = p·L + e, peer p, my expert e
      const int p = i / L, g = me * L + i % L;
      int64_t before = 0;
      for (int p2 = 0; p2 < p; ++p2) before += counts[int64_t(p2) * E + g];
      int32_t* t = to_tokens + 3 * int64_t(i);
      t[0] = int32_t(seg[g] + before), t[1] = int32_t(sorted_start(p, g)), t[2] = counts[int64_t(p) * E + g];
    }
  }
}

}  // namespace

void ep_layout_cuda(const EpLayoutDims& d, const int32_t* counts, int32_t* out, int32_t* most_needed,
                    cudaStream_t stream) {
  check_ep_layout_dims(d);
  FLOWMOE_CHECK(counts != nullptr && out != nullptr, ShapeError, "ep_layout_cuda: null counts or output");
  const size_t smem = (2 * size_t(d.num_ranks) * size_t(d.num_local_experts) + 1) * sizeof(int64_t);
  FLOWMOE_CHECK(smem <= 48 * 1024, ShapeError, "ep_layout_cuda: ", d.num_ranks, " ranks x ", d.num_local_experts,
                " experts need ", smem, " bytes of shared memory (at most 48 KiB: 3072 experts)");
  ep_layout_kernel<<<1, kThreads, smem, stream>>>(d, counts, out, most_needed);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
