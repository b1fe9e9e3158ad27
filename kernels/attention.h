// Causal self-attention per (batch, head): o_i = sum_{j<=i} P_ij v_j, P_i = softmax_j(q_i·k_j / sqrt(hd)).
// q, k, v, o are [batch, seq_len, num_heads, head_dim]; on the CPU v and o may have their own v_head_dim (MLA's
// value head, layers/mla.h), which the CUDA callers reach by padding v to head_dim (engine/ops/attention.cpp).
// Backward, with dS_ij = P_ij (dO_i·v_j - dO_i·o_i):
//   dv_j = sum_i P_ij dO_i,   dq_i = sum_j dS_ij k_j / sqrt(hd),   dk_j = sum_i dS_ij q_i / sqrt(hd).
// CPU reference: kernels/cpu/attention.cpp (f32, f64; naive O(T^2) with explicit probabilities).
// CUDA: two kernel families (AttentionKernel) sharing one contract (a saved natural-log logsumexp, a delta
// scratch): flash (kernels/cuda/flash_attention.cu, flash_attention_backward.cu) and simt (kernels/cuda/attention.cu).
// Node: engine/ops/attention.cpp. Tests: tests/test_attention.cpp. Benchmark: bench/bench_attention.cpp.
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

constexpr int64_t kAttentionMaxHeadDimCuda = 128;

// Which CUDA family runs (attention_*_cuda's `kernel`); the lse of either forward feeds either backward.
//   flash: kernels/cuda/flash_attention.cu (forward) and flash_attention_backward.cu, bf16 on tensor cores
//          (mma.sync, FlashAttention-2 style; P and dS are rounded to bf16 before their products).
//   simt:  kernels/cuda/attention.cu, fp32 math on CUDA cores; the GPU reference of flash, and the f32 path.
// automatic picks flash for bf16 when head_dim % 8 == 0 and every pointer is 16-byte aligned, else simt.
// flash insists: a dtype other than bf16 is a DTypeError, a head_dim not a multiple of 8 a ShapeError, and a
// tensor pointer not 16-byte aligned an Error. simt takes f32 or bf16 and any head_dim <= 128.
enum class AttentionKernel : uint8_t { automatic, flash, simt };

// dtype f32 or bf16; 1 <= head_dim <= 128. lse receives the natural-log softmax normaliser of every
// query row, log(sum_{j<=i} exp(q_i·k_j / sqrt(hd))), which the backward needs.
void attention_forward_cuda(DType dtype, void* out /*[batch, seq_len, num_heads, head_dim]*/,
                            float* lse /*[batch, num_heads, seq_len]*/,
                            const void* q /*[batch, seq_len, num_heads, head_dim]*/, const void* k /*[same]*/,
                            const void* v /*[same]*/, int64_t batch, int64_t seq_len, int64_t num_heads,
                            int64_t head_dim, cudaStream_t stream, AttentionKernel kernel = AttentionKernel::automatic);
// delta is scratch for dO_i·o_i. Deterministic: dq and dk/dv come from two kernels (one per query tile,
// one per key tile) that each own their output rows, so no atomics.
void attention_backward_cuda(DType dtype, void* d_q /*[batch, seq_len, num_heads, head_dim]*/, void* d_k /*[same]*/,
                             void* d_v /*[same]*/, float* delta /*[batch, num_heads, seq_len] scratch*/,
                             const void* d_out /*[batch, seq_len, num_heads, head_dim]*/, const void* q /*[same]*/,
                             const void* k /*[same]*/, const void* v /*[same]*/, const void* out /*[same]*/,
                             const float* lse /*[batch, num_heads, seq_len]*/, int64_t batch, int64_t seq_len,
                             int64_t num_heads, int64_t head_dim, cudaStream_t stream,
                             AttentionKernel kernel = AttentionKernel::automatic);

}  // namespace flowmoe
