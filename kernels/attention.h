// Causal self-attention per (batch, head): o_i = sum_{j<=i} P_ij v_j, P_i = softmax_j(q_i·k_j / sqrt(hd)).
// q, k, v, o are [batch, seq_len, num_heads, head_dim]; v and o may have their own v_head_dim (MLA's value head,
// layers/mla.h): the CPU takes any, the CUDA kernels the shapes of attention_value_width_cuda, to which the caller
// pads v with zero columns (engine/ops/attention.cpp).
// Backward, with dS_ij = P_ij (dO_i·v_j - dO_i·o_i):
//   dv_j = sum_i P_ij dO_i,   dq_i = sum_j dS_ij k_j / sqrt(hd),   dk_j = sum_i dS_ij q_i / sqrt(hd).
// CPU reference: kernels/cpu/attention.cpp (f32, f64; naive O(T^2) with explicit probabilities).
// CUDA: two kernel families (AttentionKernel) sharing one contract (a saved natural-log logsumexp, a delta
// scratch): flash (kernels/cuda/flash_attention.cu, flash_attention_backward.cu) and simt (kernels/cuda/attention.cu).
// Node: engine/ops/attention.cpp. Tests: tests/test_attention.cpp (the op), tests/test_flash_attention.cpp (the
// CUDA kernels called directly). Benchmark: bench/bench_attention.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

template <class T>
void attention_forward_cpu(T* out /*[batch, seq_len, num_heads, v_head_dim]*/, const T* q /*[.., head_dim]*/,
                           const T* k /*[.., head_dim]*/, const T* v /*[.., v_head_dim]*/, int64_t batch,
                           int64_t seq_len, int64_t num_heads, int64_t head_dim, int64_t v_head_dim);
// Recomputes the probabilities from q and k; every gradient is written (no accumulation into them).
template <class T>
void attention_backward_cpu(T* d_q /*[batch, seq_len, num_heads, head_dim]*/, T* d_k /*[same]*/,
                            T* d_v /*[.., v_head_dim]*/, const T* d_out /*[.., v_head_dim]*/,
                            const T* q /*[.., head_dim]*/, const T* k /*[.., head_dim]*/,
                            const T* v /*[.., v_head_dim]*/, int64_t batch, int64_t seq_len, int64_t num_heads,
                            int64_t head_dim, int64_t v_head_dim);

// The CUDA kernels' head widths: both families take q, k and v heads of one width up to kAttentionMaxHeadDimCuda;
// flash alone takes the wide heads, query/key heads up to kAttentionMaxWideHeadDimCuda (DeepSeek-V3's 128 + 64)
// with value heads no wider than kAttentionMaxHeadDimCuda.
constexpr int64_t kAttentionMaxHeadDimCuda = 128;
constexpr int64_t kAttentionMaxWideHeadDimCuda = 192;

// The wide heads (bf16 on the flash kernels only): kAttentionMaxHeadDimCuda < head_dim <=
// kAttentionMaxWideHeadDimCuda and 0 < v_head_dim <= kAttentionMaxHeadDimCuda, both multiples of 8.
constexpr bool attention_wide_head_cuda(int64_t head_dim, int64_t v_head_dim) {
  return head_dim > kAttentionMaxHeadDimCuda && head_dim <= kAttentionMaxWideHeadDimCuda && head_dim % 8 == 0 &&
         v_head_dim > 0 && v_head_dim <= kAttentionMaxHeadDimCuda && v_head_dim % 8 == 0;
}

// The value head width attention_*_cuda run query/key heads of head_dim and value heads of v_head_dim at (the caller
// pads v with zero columns to it, and keeps o's first v_head_dim): head_dim for heads up to kAttentionMaxHeadDimCuda
// with v no wider; v_head_dim rounded up to 8 for wide heads (head_dim a multiple of 8); 0 for any other shape.
constexpr int64_t attention_value_width_cuda(int64_t head_dim, int64_t v_head_dim) {
  if (head_dim <= kAttentionMaxHeadDimCuda) return v_head_dim <= head_dim ? head_dim : 0;
  const int64_t width = (v_head_dim + 7) / 8 * 8;
  return attention_wide_head_cuda(head_dim, width) ? width : 0;
}

// Which CUDA family runs (attention_*_cuda's `kernel`); the lse of either forward feeds either backward.
//   flash: kernels/cuda/flash_attention.cu (forward) and flash_attention_backward.cu, bf16 on tensor cores
//          (mma.sync, FlashAttention-2 style; P and dS are rounded to bf16 before their products).
//   simt:  kernels/cuda/attention.cu, fp32 math on CUDA cores; the GPU reference of flash, and the f32 path.
// automatic picks flash for bf16 when head_dim % 8 == 0 and every pointer is 16-byte aligned, else simt; wide
// heads always flash. flash insists: a dtype other than bf16 is a DTypeError, a head_dim not a multiple of 8 or
// a shape other than one width up to 128 or the wide heads a ShapeError, and a tensor pointer not 16-byte aligned
// an Error. simt takes f32 or bf16 and any head_dim = v_head_dim <= 128.
enum class AttentionKernel : uint8_t { automatic, flash, simt };

// dtype f32 or bf16; v_head_dim = head_dim <= 128, or wide heads (bf16). lse receives the natural-log softmax
// normaliser of every query row, log(sum_{j<=i} exp(q_i·k_j / sqrt(hd))), which the backward needs.
void attention_forward_cuda(DType dtype, void* out /*[batch, seq_len, num_heads, v_head_dim]*/,
                            float* lse /*[batch, num_heads, seq_len]*/,
                            const void* q /*[batch, seq_len, num_heads, head_dim]*/, const void* k /*[same]*/,
                            const void* v /*[.., v_head_dim]*/, int64_t batch, int64_t seq_len, int64_t num_heads,
                            int64_t head_dim, int64_t v_head_dim, cudaStream_t stream,
                            AttentionKernel kernel = AttentionKernel::automatic);
// delta is scratch for dO_i·o_i. Deterministic: dq and dk/dv come from two kernels (one per query tile,
// one per key tile) that each own their output rows, so no atomics.
void attention_backward_cuda(DType dtype, void* d_q /*[batch, seq_len, num_heads, head_dim]*/, void* d_k /*[same]*/,
                             void* d_v /*[.., v_head_dim]*/, float* delta /*[batch, num_heads, seq_len] scratch*/,
                             const void* d_out /*[.., v_head_dim]*/, const void* q /*[.., head_dim]*/,
                             const void* k /*[.., head_dim]*/, const void* v /*[.., v_head_dim]*/,
                             const void* out /*[.., v_head_dim]*/, const float* lse /*[batch, num_heads, seq_len]*/,
                             int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim, int64_t v_head_dim,
                             cudaStream_t stream, AttentionKernel kernel = AttentionKernel::automatic);

}  // namespace flowmoe
