// permute_pad, step 2 on sm_90: the row move through the bulk-copy (TMA) engine. kernels/cuda/permute.cu
// includes this and uses it (PermuteRowKernel, kernels/permute.h) when the row length and both base
// addresses are multiples of 16 bytes; it writes exactly what permute_rows_kernel (permute_rows.cuh) writes.
// Each block owns tokens_per_block consecutive tokens, cut into items (token, chunk of at most kTmaChunkBytes);
// thread 0 moves them through shared-memory stages, warps 1..3 move the side payload and write the pad rows
// (permute_rows_tma_kernel has the detail).
// Tests: tests/test_permute.cpp (both implementations against the CPU reference, bit for bit).
#pragma once
#include <atomic>
#include <cstdint>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/permute_route.cuh"
#include "kernels/cuda/permute_rows.cuh"

namespace flowmoe {
namespace {

constexpr int kTmaThreads = 128;  // warp 0: the copy engine's issuer; warps 1..3: side, pad
constexpr int kTmaPadWarps = kTmaThreads / 32 - 1;
constexpr int64_t kTmaChunkBytes = 32 * 1024;   // longest bulk copy of one item
constexpr int64_t kTmaStageBudget = 32 * 1024;  // stage bytes per block: 6-7 blocks per SM fit
constexpr int kTmaMaxTokensPerBlock = 8;

struct TmaRowArgs {
  RowArgs a;              // as for the classic kernel, with nvec counting 16-byte vectors
  int64_t row_bytes;      // multiple of 16
  int64_t chunk_bytes;    // multiple of 16; the last chunk of a row may be shorter
  int64_t stage_stride;   // chunk_bytes rounded up to 128
  int64_t num_pad_warps;  // blocks * kTmaPadWarps
  int chunks_per_row, tokens_per_block, stages;
};

// Block geometry for rows of row_bytes (a multiple of 16): short rows are grouped so a block moves
// about kTmaStageBudget bytes, all loaded at once; rows longer than kTmaChunkBytes are cut into equal
// chunks that cycle through two stages.
inline void tma_geometry(TmaRowArgs& ta, int64_t row_bytes) {
  ta.row_bytes = row_bytes;
  const int64_t cpr = (row_bytes + kTmaChunkBytes - 1) / kTmaChunkBytes;
  ta.chunk_bytes = ((row_bytes + cpr - 1) / cpr + 15) / 16 * 16;
  ta.chunks_per_row = int((row_bytes + ta.chunk_bytes - 1) / ta.chunk_bytes);
  ta.stage_stride = (ta.chunk_bytes + 127) / 128 * 128;
  if (ta.chunks_per_row == 1) {
    const int64_t fit = kTmaStageBudget / ta.stage_stride;
    ta.tokens_per_block = int(fit < 1 ? 1 : fit > kTmaMaxTokensPerBlock ? kTmaMaxTokensPerBlock : fit);
    ta.stages = ta.tokens_per_block;
  } else {
    ta.tokens_per_block = 1;
    ta.stages = 2;  // a ring needs two: one stage is refilled while the other is stored
  }
}

// Dynamic shared memory: [stages, stage_stride] bytes, [stages] mbarriers, [tokens_per_block, k] destinations.
inline size_t tma_smem_bytes(const TmaRowArgs& ta) {
  return size_t(ta.stages) * size_t(ta.stage_stride) + size_t(ta.stages) * sizeof(uint64_t) +
         size_t(ta.tokens_per_block) * size_t(ta.a.top_k) * sizeof(int32_t);
}

// ---- bulk-copy primitives (PTX ISA 8.0, sm_90) --------------------------------------------------

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// Makes the initialised mbarriers visible to the async proxy (the copy engine) before it signals them.
__device__ __forceinline__ void fence_mbar_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// Arms `bar` for `bytes` and starts the global -> shared copy whose arrival completes them.
__device__ __forceinline__ void bulk_load(void* dst_smem, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_u32(dst_smem)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
}

__device__ __forceinline__ void bulk_store(void* dst, const void* src_smem, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem_u32(src_smem)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most N committed bulk groups still read shared memory (their global writes may be in
// flight: the grid's completion covers those).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// ---- the kernel ---------------------------------------------------------------------------------

// Thread 0 loads items into a ring of shared-memory stages (cp.async.bulk global -> shared, completion counted
// in bytes on an mbarrier) and stores each item to its token's k destination rows (cp.async.bulk shared ->
// global, one bulk group per item): the payload never passes through registers, and a row costs 1 + k
// instructions. The first `stages` items are loaded before wait_for_previous_kernel (x is an input, not an
// output of the routing map), so up to ~200 KiB of rows per SM arrive while the map finishes.
// Warps 1..3 copy the side payload of the block's tokens, then write pad items (fill_pad_item, as the
// classic kernel does) striding over all blocks' pad warps.
__global__ void __launch_bounds__(kTmaThreads) permute_rows_tma_kernel(const TmaRowArgs ta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const RowArgs& a = ta.a;
  extern __shared__ __align__(128) unsigned char s_raw[];
  unsigned char* s_stage = s_raw;                                                           // [stages, stride]
  auto* s_bar = reinterpret_cast<uint64_t*>(s_raw + int64_t(ta.stages) * ta.stage_stride);  // [stages]
  auto* s_dest = reinterpret_cast<int32_t*>(s_bar + ta.stages);                             // [tokens, k]
  const int64_t t0 = int64_t(blockIdx.x) * ta.tokens_per_block;
  const int64_t left = a.num_tokens - t0;
  const int num_tok = left <= 0 ? 0 : left < ta.tokens_per_block ? int(left) : ta.tokens_per_block;
  const int cpr = ta.chunks_per_row, num_items = num_tok * cpr;
  const int num_preload = num_items < ta.stages ? num_items : ta.stages;
  auto item_offset = [&](int i) { return int64_t(i % cpr) * ta.chunk_bytes; };
  auto item_bytes = [&](int i) {
    const int64_t rest = ta.row_bytes - item_offset(i);
    return uint32_t(rest < ta.chunk_bytes ? rest : ta.chunk_bytes);
  };
  auto load_item = [&](int i) {
    const int s = i % ta.stages;
    const auto* src = static_cast<const unsigned char*>(a.x) + (t0 + i / cpr) * ta.row_bytes + item_offset(i);
    bulk_load(s_stage + int64_t(s) * ta.stage_stride, src, item_bytes(i), &s_bar[s]);
  };
  if (threadIdx.x == 0 && num_items > 0) {
    for (int s = 0; s < num_preload; ++s) mbar_init(&s_bar[s], 1);
    fence_mbar_init();
    for (int i = 0; i < num_preload; ++i) load_item(i);  // x is an input: read while the map finishes
  }
  wait_for_previous_kernel();
  for (int i = threadIdx.x; i < num_tok * a.top_k; i += blockDim.x) {
    const int64_t entry = t0 * a.top_k + i;
    const int32_t r = a.row_map[entry];
    s_dest[i] = r;
    if (a.probs && r >= 0) a.probs[r] = a.topk_prob[entry];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t routed = 0;  // bit lt: local token lt has a destination here
    for (int lt = 0; lt < num_tok; ++lt)
      for (int j = 0; j < a.top_k; ++j)
        if (s_dest[lt * a.top_k + j] >= 0) routed |= 1u << lt;
    uint32_t phase = 0;  // bit s: parity of stage s's next completion
    for (int i = 0; i < num_items; ++i) {
      const int s = i % ta.stages, lt = i / cpr;
      // Items past the preload are loaded only for routed tokens (see the refill below).
      if (i < num_preload || (routed >> lt & 1u)) {
        mbar_wait(&s_bar[s], phase >> s & 1u);
        phase ^= 1u << s;
      }
      bool stored = false;
      if (routed >> lt & 1u) {
        const unsigned char* buf = s_stage + int64_t(s) * ta.stage_stride;
        const int64_t off = item_offset(i);
        const uint32_t bytes = item_bytes(i);
        for (int j = 0; j < a.top_k; ++j) {
          const int32_t r = s_dest[lt * a.top_k + j];
          if (r >= 0) bulk_store(static_cast<unsigned char*>(a.rows) + int64_t(r) * ta.row_bytes + off, buf, bytes);
        }
        bulk_commit();
        stored = true;
      }
      // Refill the stage of item i-1 (stages >= 2 whenever there are two items) once its stores have
      // read it; the stores of item i keep the copy engine busy meanwhile.
      const int next = i - 1 + ta.stages;
      if (i >= 1 && next < num_items && (routed >> (next / cpr) & 1u)) {
        if (stored)
          bulk_wait_read<1>();
        else
          bulk_wait_read<0>();
        load_item(next);
      }
    }
    bulk_wait_read<0>();  // the stages stay allocated until the copy engine has read them
  } else if (threadIdx.x >= 32) {
    const int helper = int(threadIdx.x) - 32, num_helpers = int(blockDim.x) - 32;
    if (a.side_rows) {
      const int n = num_tok * a.top_k * a.side_cols;
      for (int i = helper; i < n; i += num_helpers) {
        const int dj = i / a.side_cols, c = i - dj * a.side_cols;
        const int32_t r = s_dest[dj];
        if (r >= 0) a.side_rows[int64_t(r) * a.side_cols + c] = a.side[(t0 + dj / a.top_k) * a.side_cols + c];
      }
    }
    const int64_t first = int64_t(blockIdx.x) * kTmaPadWarps + (helper >> 5);
    for (int64_t p = first; p < a.num_pad_items; p += ta.num_pad_warps) fill_pad_item<16>(a, p);
  }
#else
  __trap();  // the launcher selects this kernel only where it was compiled for sm_90 or later
#endif
}

// ---- host side ----------------------------------------------------------------------------------

// The TMA row kernel runs only where the device is sm_90 or later and the kernel was built for it.
bool tma_rows_supported() {
  static std::atomic<int> cached[64] = {};  // 0 unknown, 1 no, 2 yes
  int dev = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
  int v = dev < 64 ? cached[dev].load(std::memory_order_relaxed) : 0;
  if (v == 0) {
    int major = 0;
    FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    cudaFuncAttributes attr{};
    FLOWMOE_CUDA_CHECK(cudaFuncGetAttributes(&attr, permute_rows_tma_kernel));
    v = major >= 9 && attr.binaryVersion >= 90 ? 2 : 1;
    if (dev < 64) cached[dev].store(v, std::memory_order_relaxed);
  }
  return v == 2;
}

}  // namespace
}  // namespace flowmoe
