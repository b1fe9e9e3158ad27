// Fused MoE permute + pad on the GPU (layout in kernels/permute.h), three launches, no host sync:
//   route_count:  per chunk of 2048 flat entries, a shared-memory histogram of local experts and each
//                 entry's stable rank inside the chunk (warp match + per-warp running counts)
//   route_scan:   one block: per-expert totals, each chunk's offset inside its expert, padded counts,
//                 segment starts
//   permute_rows: one thread group per token loads its row once (16-byte vectors) and stores it to
//                 its k destinations; the remaining groups write the pad rows and the tail. No memset.
// route_scan and permute_rows use programmatic dependent launch, so each starts (and permute_rows
// reads its first slice of x) while the previous kernel drains.
// Backward: one group per token gathers and sums its k row gradients (fp32, j ascending).
// CPU reference: kernels/cpu/permute.cpp. Tests: tests/test_permute.cpp. Bench: bench/bench_permute.cpp.
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "engine/cuda/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/permute.h"

namespace flowmoe {

namespace {

constexpr int kCountThreads = 256, kCountWarps = kCountThreads / 32, kCountRounds = 8;
constexpr int kChunk = kCountThreads * kCountRounds;  // flat entries per route_count block
constexpr int kScanThreads = 1024;
constexpr int kRowThreads = 256;  // blocks of the row kernels hold 256 / group thread groups
constexpr int kUnroll = 4;        // vectors per thread in flight per pass
constexpr int kMaxLocalExperts = 4096;  // route_count keeps [8][L] ints in shared memory
constexpr int kMaxTopk = 1024;          // permute_rows keeps [groups][k] ints in shared memory

template <int VB>
struct VecOf;
template <>
struct VecOf<16> { using type = uint4; };
template <>
struct VecOf<8> { using type = uint2; };
template <>
struct VecOf<4> { using type = unsigned int; };
template <>
struct VecOf<2> { using type = unsigned short; };
template <>
struct VecOf<1> { using type = unsigned char; };

// VB bytes of T, loaded and stored as one vector (llm.c's Packed128); get/set convert through fp32.
template <class T, int VB>
struct Packed {
  static constexpr int n = VB / int(sizeof(T));
  T v[n];
  __device__ static Packed load(const T* p) {
    auto raw = __ldg(reinterpret_cast<const typename VecOf<VB>::type*>(p));
    Packed out;
    memcpy(&out, &raw, VB);
    return out;
  }
  __device__ void store(T* p) const {
    typename VecOf<VB>::type raw;
    memcpy(&raw, this, VB);
    *reinterpret_cast<typename VecOf<VB>::type*>(p) = raw;
  }
  __device__ float get(int e) const { return to_float(v[e]); }
  __device__ void set(int e, float x) { v[e] = from_float<T>(x); }
};

// Eight bf16 kept as four 32-bit words (not eight 16-bit registers): widening is a shift, exact.
template <>
struct Packed<__nv_bfloat16, 16> {
  static constexpr int n = 8;
  uint4 raw;
  __device__ static Packed load(const __nv_bfloat16* p) { return {__ldg(reinterpret_cast<const uint4*>(p))}; }
  __device__ void store(__nv_bfloat16* p) const { *reinterpret_cast<uint4*>(p) = raw; }
  __device__ unsigned& word(int i) { return i == 0 ? raw.x : i == 1 ? raw.y : i == 2 ? raw.z : raw.w; }
  __device__ unsigned word(int i) const { return i == 0 ? raw.x : i == 1 ? raw.y : i == 2 ? raw.z : raw.w; }
  __device__ float get(int e) const {
    const unsigned w = word(e >> 1);
    return __uint_as_float((e & 1) ? (w & 0xffff0000u) : (w << 16));
  }
  __device__ void set(int e, float x) {
    const unsigned b = __bfloat16_as_ushort(__float2bfloat16_rn(x));
    unsigned& w = word(e >> 1);
    w = (e & 1) ? ((w & 0x0000ffffu) | (b << 16)) : ((w & 0xffff0000u) | b);
  }
};

__device__ __forceinline__ int warp_inclusive_scan(int v) {
  const int lane = threadIdx.x & 31;
  for (int o = 1; o < 32; o <<= 1) {
    int u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Inclusive scan over the block (blockDim.x a multiple of 32); scratch holds 32 ints.
__device__ __forceinline__ int block_inclusive_scan(int v, int* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
  v = warp_inclusive_scan(v);
  if (lane == 31) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    int w = lane < num_warps ? scratch[lane] : 0;
    w = warp_inclusive_scan(w);
    if (lane < num_warps) scratch[lane] = w;
  }
  __syncthreads();
  return warp > 0 ? v + scratch[warp - 1] : v;
}

// Programmatic dependent launch (sm_90): a kernel launched with launch_dependent may start while the
// previous kernel in the stream drains; it waits here before reading that kernel's outputs. Launched
// normally, this is a no-op.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ---- kernels ----------------------------------------------------------------------------------

// Warp w of a chunk owns its entries [w*R*32, (w+1)*R*32) and walks them in R rounds of 32, keeping a
// running count per expert in s_hist[w]; afterwards s_hist is turned into exclusive offsets over warps.
// row_map gets each routed entry's rank inside the chunk (permute_rows finalises it), -1 elsewhere.
__global__ void __launch_bounds__(kCountThreads)
    route_count_kernel(const int32_t* __restrict__ topk_idx /*[n]*/, int64_t n, int topk, int num_experts,
                       int expert_offset, int num_local, int num_chunks, int32_t* __restrict__ row_map /*[n]*/,
                       int32_t* __restrict__ chunk_counts /*[L, num_chunks]*/) {
  extern __shared__ int32_t s_hist[];  // [kCountWarps, L]
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t base = int64_t(blockIdx.x) * kChunk + int64_t(warp) * kCountRounds * 32;
  int id[kCountRounds];
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) {  // all loads first, so they are in flight together
    const int64_t i = base + r * 32 + lane;
    id[r] = i < n ? __ldg(topk_idx + i) : 0;
  }
  for (int i = threadIdx.x; i < kCountWarps * num_local; i += blockDim.x) s_hist[i] = 0;
  __syncthreads();
  int32_t* my_hist = s_hist + warp * num_local;
  const unsigned lanes_below = (1u << lane) - 1;
  int expert[kCountRounds], rank[kCountRounds];
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) {
    const int64_t i = base + r * 32 + lane;
    int e = -1;
    if (i < n) {
      if (id[r] < 0 || id[r] >= num_experts) {
        printf("permute_pad: topk_idx[%lld, %d] = %d (token %lld) is not an expert id in [0, %d)\n",
               (long long)(i / topk), int(i % topk), id[r], (long long)(i / topk), num_experts);
        __trap();
      }
      e = id[r] - expert_offset;
      if (e < 0 || e >= num_local) e = -1;  // an expert of another rank
    }
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    const int before = e >= 0 ? my_hist[e] : 0;  // copies of e in this warp's earlier rounds
    __syncwarp();
    if (e >= 0 && (peers & lanes_below) == 0) my_hist[e] = before + __popc(peers);  // first lane of the group
    __syncwarp();
    expert[r] = e;
    rank[r] = before + __popc(peers & lanes_below);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_local; e += blockDim.x) {
    int run = 0;
    for (int w = 0; w < kCountWarps; ++w) {
      const int c = s_hist[w * num_local + e];
      s_hist[w * num_local + e] = run;
      run += c;
    }
    chunk_counts[int64_t(e) * num_chunks + blockIdx.x] = run;
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kCountRounds; ++r) {
    const int64_t i = base + r * 32 + lane;
    if (i < n) row_map[i] = expert[r] >= 0 ? my_hist[expert[r]] + rank[r] : -1;
  }
}

// One block. Warp per expert: lanes own contiguous runs of chunks, so a warp scan gives each chunk's
// offset inside its expert (written over the counts). Then the padded counts are scanned.
__global__ void __launch_bounds__(kScanThreads)
    route_scan_kernel(int32_t* __restrict__ chunk_counts /*[L, num_chunks]*/, int num_chunks, int num_local,
                      int align, int64_t num_rows, int32_t* __restrict__ tokens_per_expert /*[L]*/,
                      int32_t* __restrict__ padded_tokens_per_expert /*[L]*/,
                      int32_t* __restrict__ segment_starts /*[L+1]*/) {
  extern __shared__ int32_t s_padded[];  // [L]
  __shared__ int32_t s_scratch[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, num_warps = blockDim.x >> 5;
  const int per_lane = (num_chunks + 31) / 32;
  wait_for_previous_kernel();  // chunk_counts come from route_count
  for (int e = warp; e < num_local; e += num_warps) {
    int32_t* counts = chunk_counts + int64_t(e) * num_chunks;
    const int c0 = min(lane * per_lane, num_chunks), c1 = min(c0 + per_lane, num_chunks);
    int sum = 0;
    for (int c = c0; c < c1; ++c) sum += counts[c];
    const int inclusive = warp_inclusive_scan(sum);
    int run = inclusive - sum;
    for (int c = c0; c < c1; ++c) {
      const int v = counts[c];
      counts[c] = run;
      run += v;
    }
    const int total = __shfl_sync(0xffffffffu, inclusive, 31);
    if (lane == 0) {
      const int padded = (total + align - 1) / align * align;
      tokens_per_expert[e] = total;
      padded_tokens_per_expert[e] = padded;
      s_padded[e] = padded;
    }
  }
  __syncthreads();
  const int per_thread = (num_local + blockDim.x - 1) / blockDim.x;
  const int e0 = min(int(threadIdx.x) * per_thread, num_local), e1 = min(e0 + per_thread, num_local);
  int sum = 0;
  for (int e = e0; e < e1; ++e) sum += s_padded[e];
  const int inclusive = block_inclusive_scan(sum, s_scratch);
  int run = inclusive - sum;
  for (int e = e0; e < e1; ++e) {
    segment_starts[e] = run;
    run += s_padded[e];
  }
  if (threadIdx.x == blockDim.x - 1) {
    segment_starts[num_local] = inclusive;
    if (inclusive > num_rows) {
      printf("permute_pad: the padded experts need %d rows but the buffer has %lld\n", inclusive,
             (long long)num_rows);
      __trap();
    }
  }
}

struct RowArgs {
  const int32_t* topk_idx;       // [T,k]
  const void* x;                 // [T, nvec] vectors
  const float* topk_prob;        // [T,k] or null
  const float* side;             // [T, side_cols] or null
  const int32_t* chunk_offsets;  // [L, num_chunks]
  const int32_t* tokens;         // [L]
  const int32_t* seg;            // [L+1]
  void* rows;                    // [num_rows, nvec] vectors
  float* probs;                  // [num_rows] or null
  float* side_rows;              // [num_rows, side_cols] or null
  int32_t* row_map;              // [T,k]: in: rank inside the chunk, out: destination row
  int64_t num_tokens, nvec, num_rows, token_blocks, num_pad_items;
  int topk, expert_offset, num_local, align, num_chunks, group, side_cols;
  float side_pad_value;
};

// Blocks [0, token_blocks) hold 256 / group tokens each. The blocks after them hold 8 pad warps each:
// pad warp p writes pad slot (e, q) = divmod(p, align-1) when that row exists, then strides over
// the tail rows [seg[L], num_rows). A warp per pad row keeps those blocks few and busy.
template <int VB>
__global__ void __launch_bounds__(kRowThreads) permute_rows_kernel(const RowArgs a) {
  using Vec = typename VecOf<VB>::type;
  extern __shared__ int32_t s_dest[];  // [groups per block, k]
  Vec* rows = static_cast<Vec*>(a.rows);
  if (blockIdx.x >= a.token_blocks) {
    wait_for_previous_kernel();
    const int lane = threadIdx.x & 31;
    const int64_t p = (int64_t(blockIdx.x) - a.token_blocks) * (kRowThreads / 32) + (threadIdx.x >> 5);
    if (p >= a.num_pad_items) return;
    auto fill_row = [&](int64_t r) {
      const Vec zero{};
      Vec* out = rows + r * a.nvec;
      for (int64_t v = lane; v < a.nvec; v += 32) out[v] = zero;
      if (a.probs && lane == 0) a.probs[r] = 0.f;
      if (a.side_rows)
        for (int c = lane; c < a.side_cols; c += 32) a.side_rows[r * a.side_cols + c] = a.side_pad_value;
    };
    const int slots = a.align - 1;  // an expert has at most align-1 pad rows
    if (p < int64_t(a.num_local) * slots) {
      const int e = int(p / slots), q = int(p % slots);
      const int64_t r = int64_t(a.seg[e]) + a.tokens[e] + q;
      if (r < a.seg[e + 1]) fill_row(r);
    }
    for (int64_t r = a.seg[a.num_local] + p; r < a.num_rows; r += a.num_pad_items) fill_row(r);
    return;
  }
  const int g = threadIdx.x / a.group, lane = threadIdx.x % a.group;
  const int64_t item = int64_t(blockIdx.x) * (blockDim.x / a.group) + g;
  const bool is_token = item < a.num_tokens;
  const int64_t step = int64_t(a.group) * kUnroll;
  const Vec* src = static_cast<const Vec*>(a.x) + (is_token ? item : 0) * a.nvec;
  Vec buf[kUnroll];
  auto load_pass = [&](int64_t v0) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * a.group + lane;
      if (v < a.nvec) buf[u] = __ldg(src + v);
    }
  };
  // x was written before route_count ran, so its first pass is read while route_scan finishes.
  if (is_token) load_pass(0);
  wait_for_previous_kernel();
  int32_t* dest = s_dest + g * a.topk;
  if (is_token) {
    for (int j = lane; j < a.topk; j += a.group) {
      const int64_t i = item * a.topk + j;
      const int e = a.topk_idx[i] - a.expert_offset;
      int32_t r = -1;
      if (e >= 0 && e < a.num_local)
        r = a.seg[e] + a.chunk_offsets[int64_t(e) * a.num_chunks + i / kChunk] + a.row_map[i];
      a.row_map[i] = r;
      dest[j] = r;
      if (a.probs && r >= 0) a.probs[r] = a.topk_prob[i];
    }
  }
  __syncthreads();
  if (!is_token) return;
  bool routed = false;
  for (int j = 0; j < a.topk; ++j) routed |= dest[j] >= 0;
  if (!routed) return;
  for (int64_t v0 = 0;;) {
    for (int j = 0; j < a.topk; ++j) {
      const int32_t r = dest[j];
      if (r < 0) continue;
      Vec* out = rows + int64_t(r) * a.nvec;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * a.group + lane;
        if (v < a.nvec) out[v] = buf[u];
      }
    }
    v0 += step;
    if (v0 >= a.nvec) break;
    load_pass(v0);
  }
  if (a.side)
    for (int j = 0; j < a.topk; ++j)
      if (dest[j] >= 0)
        for (int c = lane; c < a.side_cols; c += a.group)
          a.side_rows[int64_t(dest[j]) * a.side_cols + c] = a.side[item * a.side_cols + c];
}

// d_x[t] = sum_j d_rows[row_map[t,j]] in fp32, j ascending; d_topk_prob[t,j] = d_probs[row_map[t,j]].
template <class T, int VB>
__global__ void __launch_bounds__(kRowThreads)
    permute_backward_kernel(const int32_t* __restrict__ row_map /*[T,k]*/, int64_t num_tokens, int topk,
                            int64_t nvec, int group, const T* __restrict__ d_rows /*[num_rows, nvec*n]*/,
                            const float* __restrict__ d_probs /*[num_rows]*/, T* __restrict__ d_x /*[T, nvec*n]*/,
                            float* __restrict__ d_topk_prob /*[T,k]*/) {
  using P = Packed<T, VB>;
  const int lane = threadIdx.x % group;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  if (t >= num_tokens) return;
  const int32_t* dest = row_map + t * topk;
  if (d_topk_prob)
    for (int j = lane; j < topk; j += group) d_topk_prob[t * topk + j] = dest[j] >= 0 ? d_probs[dest[j]] : 0.f;
  if (!d_x) return;
  for (int64_t v0 = 0; v0 < nvec; v0 += int64_t(group) * kUnroll) {
    float acc[kUnroll][P::n] = {};
    for (int j = 0; j < topk; ++j) {
      const int32_t r = __ldg(dest + j);
      if (r < 0) continue;
      const T* src = d_rows + int64_t(r) * nvec * P::n;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + u * group + lane;
        if (v < nvec) {
          const P in = P::load(src + v * P::n);
#pragma unroll
          for (int k = 0; k < P::n; ++k) acc[u][k] += in.get(k);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * group + lane;
      if (v < nvec) {
        P out{};
#pragma unroll
        for (int k = 0; k < P::n; ++k) out.set(k, acc[u][k]);
        out.store(d_x + (t * nvec + v) * P::n);
      }
    }
  }
}

// Threads per item: enough that one pass of kUnroll vectors per thread covers a row when it can.
int group_for(int64_t nvec) {
  if (nvec <= 32 * kUnroll) return 32;
  if (nvec <= 64 * kUnroll) return 64;
  if (nvec <= 128 * kUnroll) return 128;
  return 256;
}

bool aligned_to(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) == 0; }

// Widest vector (16, 8, 4, 2 or 1 bytes) that divides the row and both base addresses.
int vector_bytes(size_t row_bytes, const void* a, const void* b) {
  for (int vb = 16; vb > 1; vb /= 2)
    if (row_bytes % size_t(vb) == 0 && aligned_to(a, vb) && aligned_to(b, vb)) return vb;
  return 1;
}

// Launches with programmatic stream serialization (see wait_for_previous_kernel).
template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), unsigned blocks, int threads, size_t smem, cudaStream_t stream,
                      Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

template <int VB>
void launch_permute_rows(const RowArgs& a, cudaStream_t stream) {
  const int64_t pad_blocks = (a.num_pad_items + kRowThreads / 32 - 1) / (kRowThreads / 32);
  const size_t smem = size_t(kRowThreads / a.group) * a.topk * sizeof(int32_t);
  launch_dependent(permute_rows_kernel<VB>, unsigned(a.token_blocks + pad_blocks), kRowThreads, smem, stream, a);
}

}  // namespace

// ---- launchers --------------------------------------------------------------------------------

size_t permute_workspace_bytes(const RoutingDims& d) {
  const int64_t chunks = (d.num_tokens * d.topk + kChunk - 1) / kChunk;
  return size_t(chunks) * size_t(d.num_local_experts) * sizeof(int32_t);
}

void permute_pad_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream) {
  check_routing_dims(d);
  const int num_local = d.num_local_experts;
  FLOWMOE_CHECK(num_local <= kMaxLocalExperts, Error, "permute_pad_cuda: at most ", kMaxLocalExperts,
                " local experts, got ", num_local);
  FLOWMOE_CHECK(d.topk <= kMaxTopk, Error, "permute_pad_cuda: topk at most ", kMaxTopk, ", got ", d.topk);
  FLOWMOE_CHECK(b.row_bytes == 0 || (b.x && b.rows) || (d.num_tokens == 0 && d.num_rows == 0), Error,
                "permute_pad_cuda: null x or rows");
  FLOWMOE_CHECK(!b.side || b.side_rows, Error, "permute_pad_cuda: a side payload needs side_rows");
  const int64_t n = d.num_tokens * d.topk;
  const int num_chunks = int((n + kChunk - 1) / kChunk);
  auto* chunk_counts = static_cast<int32_t*>(b.workspace);

  if (n > 0) {
    const size_t smem = size_t(kCountWarps) * num_local * sizeof(int32_t);
    if (smem > 48 * 1024)
      MOE_CUDA_CHECK(cudaFuncSetAttribute(route_count_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    route_count_kernel<<<num_chunks, kCountThreads, smem, stream>>>(b.topk_idx, n, d.topk, d.num_experts,
                                                                     d.expert_offset, num_local, num_chunks,
                                                                     b.row_map, chunk_counts);
    MOE_CUDA_CHECK_LAUNCH();
  }
  launch_dependent(route_scan_kernel, 1, kScanThreads, size_t(num_local) * sizeof(int32_t), stream, chunk_counts,
                   num_chunks, num_local, d.align_size, d.num_rows, b.tokens_per_expert, b.padded_tokens_per_expert,
                   b.segment_starts);
  if (d.num_tokens == 0 && d.num_rows == 0) return;

  RowArgs a{};
  a.topk_idx = b.topk_idx, a.x = b.x, a.topk_prob = b.topk_prob, a.side = b.side;
  a.chunk_offsets = chunk_counts, a.tokens = b.tokens_per_expert, a.seg = b.segment_starts;
  a.rows = b.rows, a.probs = b.topk_prob ? b.probs : nullptr, a.side_rows = b.side ? b.side_rows : nullptr;
  a.row_map = b.row_map;
  a.num_tokens = d.num_tokens, a.num_rows = d.num_rows, a.topk = d.topk, a.expert_offset = d.expert_offset;
  a.num_local = num_local, a.align = d.align_size, a.num_chunks = num_chunks;
  a.side_cols = b.side ? b.side_cols : 0, a.side_pad_value = b.side_pad_value;
  // Pad warps: one per possible pad slot, and at least enough to stride over a large tail.
  a.num_pad_items = std::max<int64_t>(int64_t(num_local) * (d.align_size - 1), std::min<int64_t>(d.num_rows, 1024));
  const int vb = vector_bytes(b.row_bytes, b.x, b.rows);
  a.nvec = int64_t(b.row_bytes) / vb;
  a.group = group_for(a.nvec);
  const int groups = kRowThreads / a.group;
  a.token_blocks = (d.num_tokens + groups - 1) / groups;
  switch (vb) {
    case 16: launch_permute_rows<16>(a, stream); break;
    case 8: launch_permute_rows<8>(a, stream); break;
    case 4: launch_permute_rows<4>(a, stream); break;
    case 2: launch_permute_rows<2>(a, stream); break;
    default: launch_permute_rows<1>(a, stream); break;
  }
}

void permute_backward_cuda(DType dtype, const int32_t* row_map, int64_t num_tokens, int topk, int64_t hidden,
                           const void* d_rows, const float* d_probs, void* d_x, float* d_topk_prob,
                           cudaStream_t stream) {
  FLOWMOE_CHECK(bool(d_x) == bool(d_rows) && bool(d_topk_prob) == bool(d_probs), Error,
                "permute_backward_cuda: d_x and d_rows (and d_topk_prob and d_probs) go together");
  if (num_tokens == 0 || (!d_x && !d_topk_prob)) return;
  dispatch_cuda_float(dtype, "permute_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const bool wide = !d_x || (hidden * int64_t(sizeof(T)) % 16 == 0 && aligned_to(d_x, 16) && aligned_to(d_rows, 16));
    auto launch = [&](auto kernel, int elems_per_vec) {
      const int64_t nvec = hidden / elems_per_vec;
      const int group = group_for(nvec), groups = kRowThreads / group;
      const unsigned blocks = unsigned((num_tokens + groups - 1) / groups);
      kernel<<<blocks, kRowThreads, 0, stream>>>(row_map, num_tokens, topk, nvec, group, static_cast<const T*>(d_rows),
                                                 d_probs, static_cast<T*>(d_x), d_topk_prob);
    };
    if (wide)
      launch(permute_backward_kernel<T, 16>, 16 / int(sizeof(T)));
    else
      launch(permute_backward_kernel<T, int(sizeof(T))>, 1);
  });
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
