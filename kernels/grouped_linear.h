// GroupedLinear: one linear layer per local expert over the expert-major (padded) permuted buffer.
//   Expert e owns rows [off[e], off[e] + rows[e]) of x, off = exclusive prefix sum of rows.
//   forward  y[off_e:off_e+r_e]  = x[...] · w[e]ᵀ        x [M_total,K], w [E,N,K] -> y [M_total,N]
//   dgrad    dx[off_e:off_e+r_e] = dy[...] · w[e]                               -> dx [M_total,K]
//   wgrad    dw[e]               = dy[...]ᵀ · x[...]  (an empty sum, 0, when r_e = 0) -> dw [E,N,K]
// sum(rows) may be below M_total (a worst-case sized buffer): the tail rows of y and dx are written
// as zeros and the tail rows of x and dy are never read. The per-expert row counts are host values:
// the caller reads them from the device once per layer (read_counts_once, engine/ops/grouped_linear.h).
// CPU reference: kernels/cpu/grouped_linear.cpp (per-expert gemm_cpu). CUDA: kernels/cuda/grouped_linear.cu
// (per-expert gemm_cuda, i.e. cuBLASLt). Node: engine/ops/grouped_linear.cpp. Tests: tests/test_grouped_linear.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// Throws ShapeError unless every count is >= 0 and they sum to at most m_total (naming the values).
// Returns the sum.
int64_t check_grouped_rows(const int64_t* padded_tokens_per_expert /*[E] host*/, int64_t num_experts, int64_t m_total,
                           const char* what);

// ---- CPU reference ----------------------------------------------------------------------------

template <class T>
void grouped_linear_forward_cpu(const T* x /*[m_total,k]*/, const T* w /*[E,n,k]*/, T* y /*[m_total,n]*/,
                                const int64_t* padded_tokens_per_expert /*[E]*/, int64_t num_experts, int64_t m_total,
                                int64_t n, int64_t k);
template <class T>
void grouped_linear_dgrad_cpu(const T* dy /*[m_total,n]*/, const T* w /*[E,n,k]*/, T* dx /*[m_total,k]*/,
                              const int64_t* padded_tokens_per_expert /*[E]*/, int64_t num_experts, int64_t m_total,
                              int64_t n, int64_t k);
// accumulate: dw += (instead of =) the per-expert products; an expert with no rows then keeps dw[e].
template <class T>
void grouped_linear_wgrad_cpu(const T* x /*[m_total,k]*/, const T* dy /*[m_total,n]*/, T* dw /*[E,n,k]*/,
                              const int64_t* padded_tokens_per_expert /*[E]*/, int64_t num_experts, int64_t n,
                              int64_t k, bool accumulate);

// ---- CUDA launchers ---------------------------------------------------------------------------
// One gemm_cuda (cuBLASLt, fp32 compute) per expert with rows, in expert order on `stream`, no host
// synchronisation. dtype (x, w, y, dx, dy) is f32 or bf16; all pointers are packed row-major.

// How many streams the launchers spread the expert GEMMs over, round robin (process-wide, shared with
// the FP8 launchers of kernels/fp8_grouped_linear.h; kernels/cuda/stream_fan.cuh; 1, the
// default, keeps everything on `stream`; at most 8). Side streams wait for `stream` before their first
// GEMM and `stream` waits for them before the launcher returns, so callers see one stream's ordering.
// Each GEMM keeps its algorithm and gets its stream's own workspace, so results are unchanged (the
// tests check bit equality); each side stream costs a 32 MiB cuBLASLt workspace per device.
void set_grouped_linear_streams(int num_streams);
int grouped_linear_streams();

void grouped_linear_forward_cuda(DType dtype, const void* x /*[m_total,k]*/, const void* w /*[E,n,k]*/,
                                 void* y /*[m_total,n]*/, const int64_t* padded_tokens_per_expert /*[E] host*/,
                                 int64_t num_experts, int64_t m_total, int64_t n, int64_t k, cudaStream_t stream);
void grouped_linear_dgrad_cuda(DType dtype, const void* dy /*[m_total,n]*/, const void* w /*[E,n,k]*/,
                               void* dx /*[m_total,k]*/, const int64_t* padded_tokens_per_expert /*[E] host*/,
                               int64_t num_experts, int64_t m_total, int64_t n, int64_t k, cudaStream_t stream);
// dw is always fp32 (bf16 operands, fp32 output): with accumulate it adds into an existing fp32 main
// grad (cuBLASLt beta = 1), otherwise it overwrites (and zero-fills the experts with no rows).
void grouped_linear_wgrad_cuda(DType dtype, const void* x /*[m_total,k]*/, const void* dy /*[m_total,n]*/,
                               float* dw /*[E,n,k]*/, const int64_t* padded_tokens_per_expert /*[E] host*/,
                               int64_t num_experts, int64_t m_total, int64_t n, int64_t k, bool accumulate,
                               cudaStream_t stream);

}  // namespace flowmoe
