// Fused MoE permute + pad on the GPU (layout in kernels/permute.h), no host sync:
//   the routing map (kernels/cuda/permute_route.cuh): route_count + route_scan, or one cooperative
//                   route_map; stable ranks per chunk of 2048 entries, per-expert totals, segment starts
//   the row move (kernels/cuda/permute_rows.cuh): one thread group per token loads its row once
//                   (16-byte vectors) and stores it to its k destinations; the remaining groups write
//                   the pad rows and the tail. No memset.
//   or both in one cooperative kernel (kernels/cuda/permute_mono.cuh).
// The kernels after the first use programmatic dependent launch, so each starts (and the row kernel
// reads its first slice of x) while the previous kernel drains. Which of the variants in
// kernels/permute.h runs is chosen per call (permute_variant()); all give the same bytes. Once the
// benchmark has picked one, the others and their flags can go.
// Backward: one group per token gathers and sums its k row gradients (fp32, j ascending).
// CPU reference: kernels/cpu/permute.cpp. Tests: tests/test_permute.cpp. Bench: bench/bench_permute.cpp.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "engine/cuda/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/cuda/permute_mono.cuh"
#include "kernels/cuda/permute_route.cuh"
#include "kernels/cuda/permute_rows.cuh"
#include "kernels/permute.h"

namespace flowmoe {

namespace {

constexpr int kUnroll = 4;  // backward: vectors per thread in flight per pass

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

// ---- kernels ----------------------------------------------------------------------------------

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

// ---- launch helpers ---------------------------------------------------------------------------

// Threads per item: enough that one pass of `unroll` vectors per thread covers a row when it can.
int group_for(int64_t nvec, int unroll = kUnroll) {
  if (nvec <= 32 * unroll) return 32;
  if (nvec <= 64 * unroll) return 64;
  if (nvec <= 128 * unroll) return 128;
  return 256;
}

bool aligned_to(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % uintptr_t(bytes) == 0; }

// Widest vector (16, 8, 4, 2 or 1 bytes) that divides the row and both base addresses.
int vector_bytes(size_t row_bytes, const void* a, const void* b) {
  for (int vb = 16; vb > 1; vb /= 2)
    if (row_bytes % size_t(vb) == 0 && aligned_to(a, vb) && aligned_to(b, vb)) return vb;
  return 1;
}

// dependent: programmatic stream serialization (see wait_for_previous_kernel); cooperative: all blocks
// resident at once, so cooperative_groups' grid barrier works.
template <class... Params, class... Args>
void launch_ex(void (*kernel)(Params...), unsigned blocks, int threads, size_t smem, cudaStream_t stream,
               bool dependent, bool cooperative, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int num_attrs = 0;
  if (dependent) {
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cooperative) {
    attr[num_attrs].id = cudaLaunchAttributeCooperative;
    attr[num_attrs++].val.cooperative = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = unsigned(num_attrs);
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), unsigned blocks, int threads, size_t smem, cudaStream_t stream,
                      Args... args) {
  launch_ex(kernel, blocks, threads, smem, stream, true, false, args...);
}

// SMs of the current device, queried once per device (the launchers run on every step).
int sm_count() {
  static std::atomic<int> cached[64] = {};
  int dev = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  int n = dev < 64 ? cached[dev].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    MOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    if (dev < 64) cached[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

void allow_smem(const void* kernel, size_t smem) {
  if (smem > 48 * 1024)
    MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
}

// ---- variants ---------------------------------------------------------------------------------

constexpr const char* kFlagNames[] = {"trigger", "fused", "nocoop", "stream", "u8", "persist", "mono"};  // bit order
std::atomic<int> g_variant{-1};  // -1: not read from the environment yet

unsigned normalize_variant(unsigned flags) {
  if (flags & kPermuteMono) flags |= kPermutePersist;  // its halves, for permute_map_cuda / permute_rows_cuda
  if (flags & (kPermuteNoCoop | kPermutePersist)) flags |= kPermuteFused;  // these need the final row_map
  return flags;
}

// Occupancy of a kernel at a dynamic shared-memory size, remembered for the last size asked (the
// launchers run on every step; a layer asks with the same L each time).
struct OccupancyCache {
  std::atomic<int64_t> packed{-1};  // smem << 16 | blocks per SM
  template <class K>
  int get(K kernel, size_t smem) {
    const int64_t p = packed.load(std::memory_order_relaxed);
    if (p >= 0 && (p >> 16) == int64_t(smem)) return int(p & 0xffff);
    int n = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kRowThreads, smem));
    packed.store(int64_t(smem) << 16 | n, std::memory_order_relaxed);
    return n;
  }
};

// ---- launchers (internal) ---------------------------------------------------------------------

int num_chunks_of(const RoutingDims& d) { return int((d.num_tokens * d.topk + kChunk - 1) / kChunk); }

void check_permute_args(const RoutingDims& d, const PermuteBuffers& b) {
  check_routing_dims(d);
  FLOWMOE_CHECK(d.num_local_experts <= kMaxLocalExperts, Error, "permute_pad_cuda: at most ", kMaxLocalExperts,
                " local experts, got ", d.num_local_experts);
  FLOWMOE_CHECK(d.topk <= kMaxTopk, Error, "permute_pad_cuda: topk at most ", kMaxTopk, ", got ", d.topk);
  FLOWMOE_CHECK(b.row_bytes == 0 || (b.x && b.rows) || (d.num_tokens == 0 && d.num_rows == 0), Error,
                "permute_pad_cuda: null x or rows");
  FLOWMOE_CHECK(!b.side || b.side_rows, Error, "permute_pad_cuda: a side payload needs side_rows");
}

// route_map needs every chunk resident at once: one block per SM always fits; beyond that ask.
bool route_map_fits(int num_chunks, int num_local, size_t smem) {
  if (int64_t(num_chunks) * num_local >= INT32_MAX) return false;
  if (num_chunks <= sm_count()) return true;
  int per_sm = 0;
  MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, route_map_kernel, kCountThreads, smem));
  return int64_t(per_sm) * sm_count() >= num_chunks;
}

// Base: route_count, route_scan (row_map keeps chunk ranks; the row kernel finalises them). Fused:
// route_map, or route_count, route_scan, route_finalize when route_map cannot be resident.
void launch_map(const RoutingDims& d, const PermuteBuffers& b, unsigned flags, cudaStream_t stream) {
  const int num_local = d.num_local_experts;
  const int64_t n = d.num_tokens * d.topk;
  const int num_chunks = num_chunks_of(d);
  const bool trigger = flags & kPermuteTrigger, final_map = flags & kPermuteFused;
  auto* chunk_counts = static_cast<int32_t*>(b.workspace);
  if (final_map && n > 0 && !(flags & kPermuteNoCoop)) {
    const size_t smem = size_t(kCountWarps + 2) * num_local * sizeof(int32_t);
    allow_smem(reinterpret_cast<const void*>(route_map_kernel), smem);
    if (route_map_fits(num_chunks, num_local, smem)) {
      launch_ex(route_map_kernel, unsigned(num_chunks), kCountThreads, smem, stream, false, true, b.topk_idx, n,
                d.topk, d.num_experts, d.expert_offset, num_local, num_chunks, d.align_size, d.num_rows, trigger,
                b.row_map, chunk_counts, b.tokens_per_expert, b.padded_tokens_per_expert, b.segment_starts);
      return;
    }
  }
  if (n > 0) {
    const size_t smem = size_t(kCountWarps) * num_local * sizeof(int32_t);
    allow_smem(reinterpret_cast<const void*>(route_count_kernel), smem);
    route_count_kernel<<<num_chunks, kCountThreads, smem, stream>>>(b.topk_idx, n, d.topk, d.num_experts,
                                                                     d.expert_offset, num_local, num_chunks, trigger,
                                                                     b.row_map, chunk_counts);
    MOE_CUDA_CHECK_LAUNCH();
  }
  launch_dependent(route_scan_kernel, 1, kScanThreads, size_t(num_local) * sizeof(int32_t), stream, chunk_counts,
                   num_chunks, num_local, d.align_size, d.num_rows, trigger, b.tokens_per_expert,
                   b.padded_tokens_per_expert, b.segment_starts);
  if (final_map && n > 0)
    launch_dependent(route_finalize_kernel, unsigned((n + kFinalizeThreads - 1) / kFinalizeThreads),
                     kFinalizeThreads, 0, stream, b.topk_idx, n, d.expert_offset, num_local, num_chunks, trigger,
                     static_cast<const int32_t*>(chunk_counts), static_cast<const int32_t*>(b.segment_starts),
                     b.row_map);
}

template <int VB, int U, bool kStream, bool kFinalMap>
void launch_group_rows(const RowArgs& a, cudaStream_t stream) {
  const int64_t pad_blocks = (a.num_pad_items + kRowThreads / 32 - 1) / (kRowThreads / 32);
  const size_t smem = size_t(kRowThreads / a.group) * a.topk * sizeof(int32_t);
  launch_dependent(permute_rows_kernel<VB, U, kStream, kFinalMap>, unsigned(a.token_blocks + pad_blocks), kRowThreads,
                   smem, stream, a);
}

template <int VB, int U, bool kStream>
void launch_group_rows(const RowArgs& a, bool final_map, cudaStream_t stream) {
  if (final_map)
    launch_group_rows<VB, U, kStream, true>(a, stream);
  else
    launch_group_rows<VB, U, kStream, false>(a, stream);
}

// As many blocks as fit at once (occupancy queried once per instantiation), fewer if there is less work.
template <int VB, bool kStream>
void launch_persistent_rows(const RowArgs& a, cudaStream_t stream) {
  static const int per_sm = [] {
    int n = 0;
    MOE_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, permute_rows_persistent_kernel<VB, kStream>,
                                                                 kRowThreads, 0));
    return std::max(n, 1);
  }();
  const int64_t pad_blocks = (a.num_pad_items + kRowThreads / 32 - 1) / (kRowThreads / 32);
  const int64_t work_blocks = std::max<int64_t>({a.token_blocks, pad_blocks, 1});
  const int64_t blocks = std::min<int64_t>(work_blocks, int64_t(per_sm) * sm_count());
  launch_dependent(permute_rows_persistent_kernel<VB, kStream>, unsigned(blocks), kRowThreads, 0, stream, a);
}

RowArgs row_args(const RoutingDims& d, const PermuteBuffers& b, int unroll) {
  RowArgs a{};
  a.topk_idx = b.topk_idx, a.x = b.x, a.topk_prob = b.topk_prob, a.side = b.side;
  a.chunk_offsets = static_cast<const int32_t*>(b.workspace), a.tokens = b.tokens_per_expert;
  a.seg = b.segment_starts;
  a.rows = b.rows, a.probs = b.topk_prob ? b.probs : nullptr, a.side_rows = b.side ? b.side_rows : nullptr;
  a.row_map = b.row_map;
  a.num_tokens = d.num_tokens, a.num_rows = d.num_rows, a.topk = d.topk, a.expert_offset = d.expert_offset;
  a.num_local = d.num_local_experts, a.align = d.align_size, a.num_chunks = num_chunks_of(d);
  a.side_cols = b.side ? b.side_cols : 0, a.side_pad_value = b.side_pad_value;
  // Pad warps: one per possible pad slot, and at least enough to stride over a large tail.
  a.num_pad_items =
      std::max<int64_t>(int64_t(a.num_local) * (d.align_size - 1), std::min<int64_t>(d.num_rows, 1024));
  a.nvec = int64_t(b.row_bytes) / vector_bytes(b.row_bytes, b.x, b.rows);
  a.group = group_for(a.nvec, unroll);
  const int groups = kRowThreads / a.group;
  a.token_blocks = (d.num_tokens + groups - 1) / groups;
  return a;
}

void launch_rows(const RoutingDims& d, const PermuteBuffers& b, unsigned flags, cudaStream_t stream) {
  if (d.num_tokens == 0 && d.num_rows == 0) return;
  const int vb = vector_bytes(b.row_bytes, b.x, b.rows);
  const bool final_map = flags & kPermuteFused, stream_hint = (flags & kPermuteStream) && vb == 16;
  const bool persist = flags & kPermutePersist;
  const int unroll = (flags & kPermuteU8) && vb == 16 && !persist ? 8 : kUnroll;
  const RowArgs a = row_args(d, b, unroll);
  if (persist) {
    switch (vb) {
      case 16:
        stream_hint ? launch_persistent_rows<16, true>(a, stream) : launch_persistent_rows<16, false>(a, stream);
        break;
      case 8: launch_persistent_rows<8, false>(a, stream); break;
      case 4: launch_persistent_rows<4, false>(a, stream); break;
      case 2: launch_persistent_rows<2, false>(a, stream); break;
      default: launch_persistent_rows<1, false>(a, stream); break;
    }
    return;
  }
  switch (vb) {
    case 16:
      if (unroll == 8)
        stream_hint ? launch_group_rows<16, 8, true>(a, final_map, stream)
                    : launch_group_rows<16, 8, false>(a, final_map, stream);
      else
        stream_hint ? launch_group_rows<16, 4, true>(a, final_map, stream)
                    : launch_group_rows<16, 4, false>(a, final_map, stream);
      break;
    case 8: launch_group_rows<8, 4, false>(a, final_map, stream); break;
    case 4: launch_group_rows<4, 4, false>(a, final_map, stream); break;
    case 2: launch_group_rows<2, 4, false>(a, final_map, stream); break;
    default: launch_group_rows<1, 4, false>(a, final_map, stream); break;
  }
}

// One cooperative launch of every block that fits (fewer when there is less work). Returns false, having
// launched nothing, when it cannot run (no routed entries, or not one block fits per SM).
template <int VB, bool kStream>
bool launch_mono_vb(const RowArgs& a, const MonoArgs& m, cudaStream_t stream) {
  static OccupancyCache occupancy;
  const size_t smem = size_t(kCountWarps + 2) * a.num_local * sizeof(int32_t);
  allow_smem(reinterpret_cast<const void*>(permute_mono_kernel<VB, kStream>), smem);
  const int per_sm = occupancy.get(permute_mono_kernel<VB, kStream>, smem);
  if (per_sm == 0 || int64_t(a.num_chunks) * a.num_local >= INT32_MAX) return false;
  const int64_t pad_blocks = (a.num_pad_items + kRowThreads / 32 - 1) / (kRowThreads / 32);
  const int64_t work_blocks = std::max<int64_t>({a.token_blocks, pad_blocks, int64_t(a.num_chunks), 1});
  const int64_t blocks = std::min<int64_t>(work_blocks, int64_t(per_sm) * sm_count());
  launch_ex(permute_mono_kernel<VB, kStream>, unsigned(blocks), kRowThreads, smem, stream, false, true, a, m);
  return true;
}

bool launch_mono(const RoutingDims& d, const PermuteBuffers& b, unsigned flags, cudaStream_t stream) {
  const int64_t n = d.num_tokens * d.topk;
  if (n == 0) return false;
  const int vb = vector_bytes(b.row_bytes, b.x, b.rows);
  const RowArgs a = row_args(d, b, kPersistUnroll);
  const MonoArgs m{n, d.num_experts, static_cast<int32_t*>(b.workspace), b.tokens_per_expert,
                   b.padded_tokens_per_expert, b.segment_starts};
  switch (vb) {
    case 16:
      return (flags & kPermuteStream) ? launch_mono_vb<16, true>(a, m, stream)
                                      : launch_mono_vb<16, false>(a, m, stream);
    case 8: return launch_mono_vb<8, false>(a, m, stream);
    case 4: return launch_mono_vb<4, false>(a, m, stream);
    case 2: return launch_mono_vb<2, false>(a, m, stream);
    default: return launch_mono_vb<1, false>(a, m, stream);
  }
}

}  // namespace

// ---- variants ---------------------------------------------------------------------------------

unsigned parse_permute_variant(const std::string& name) {
  if (name == "base" || name.empty()) return 0;
  unsigned flags = 0;
  size_t pos = 0;
  while (pos <= name.size()) {
    const size_t end = std::min(name.find('+', pos), name.size());
    const std::string flag = name.substr(pos, end - pos);
    bool known = false;
    for (unsigned bit = 0; bit < std::size(kFlagNames); ++bit)
      if (flag == kFlagNames[bit]) flags |= 1u << bit, known = true;
    FLOWMOE_CHECK(known, Error, "permute variant '", name, "': unknown flag '", flag,
                  "' (known: base, trigger, fused, nocoop, stream, u8, persist, mono, joined by '+')");
    pos = end + 1;
  }
  return normalize_variant(flags);
}

std::string permute_variant_name(unsigned flags) {
  std::string name;
  for (unsigned bit = 0; bit < std::size(kFlagNames); ++bit)
    if (flags & (1u << bit)) {
      if (!name.empty()) name += '+';
      name += kFlagNames[bit];
    }
  return name.empty() ? "base" : name;
}

unsigned permute_variant() {
  int v = g_variant.load(std::memory_order_relaxed);
  if (v < 0) {
    const char* env = std::getenv("FLOWMOE_PERMUTE_VARIANT");
    v = int(env ? parse_permute_variant(env) : 0u);
    g_variant.store(v, std::memory_order_relaxed);
  }
  return unsigned(v);
}

void set_permute_variant(unsigned flags) { g_variant.store(int(normalize_variant(flags)), std::memory_order_relaxed); }

std::vector<unsigned> permute_candidate_variants() {
  const unsigned T = kPermuteTrigger, F = kPermuteFused, S = kPermuteStream, U8 = kPermuteU8;
  const unsigned P = kPermutePersist, M = normalize_variant(kPermuteMono);
  return {0u,        T,          T | S,          T | U8, F, T | F, T | F | kPermuteNoCoop, T | F | S,
          T | F | U8, T | F | S | U8, T | F | P, T | F | S | P, M, M | S};
}

// ---- launchers --------------------------------------------------------------------------------

size_t permute_workspace_bytes(const RoutingDims& d) {
  const int64_t chunks = (d.num_tokens * d.topk + kChunk - 1) / kChunk;
  return size_t(chunks) * size_t(d.num_local_experts) * sizeof(int32_t);
}

void permute_map_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream) {
  check_permute_args(d, b);
  launch_map(d, b, permute_variant(), stream);
}

void permute_rows_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream) {
  check_permute_args(d, b);
  launch_rows(d, b, permute_variant(), stream);
}

void permute_pad_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream) {
  check_permute_args(d, b);
  const unsigned flags = permute_variant();
  if ((flags & kPermuteMono) && launch_mono(d, b, flags, stream)) return;
  launch_map(d, b, flags, stream);
  launch_rows(d, b, flags, stream);
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
