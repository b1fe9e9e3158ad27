// MoE unpermute + unpad with merging probs (the inverse of kernels/permute.h):
//   y[t] = sum over routed j (ascending) of prob[t,j] * rows[row_map[t,j]], fp32 accumulation
//   (one fma per term, as the GPU does); pad rows are never read. A null topk_prob means weights 1
//   (for when SwiGLU already multiplied the rows by their probs).
// Backward: d_rows[row_map[t,j]] = prob[t,j] * dy[t], every other row (pad, tail) 0, written by the
// kernel; d_prob[t,j] = sum_h rows[row_map[t,j], h] * dy[t,h], 0 where not routed.
// CPU reference: kernels/cpu/unpermute.cpp; CUDA: kernels/cuda/unpermute.cu; node:
// engine/ops/unpermute.cpp; tests: tests/test_unpermute.cpp; benchmark: bench/bench_permute.cpp.
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

// ---- CPU reference (T = float or double; prob has the rows' type) -------------------------------

template <class T>
void unpermute_cpu(const int32_t* row_map /*[T,k]*/, int64_t num_tokens, int top_k, int64_t hidden,
                   const T* rows /*[num_rows, hidden]*/, const T* topk_prob /*[T,k]*/, T* y /*[T, hidden]*/);
// Either output may be null (not wanted); rows is only read for d_topk_prob.
template <class T>
void unpermute_backward_cpu(const int32_t* row_map /*[T,k]*/, int64_t num_tokens, int top_k, int64_t hidden,
                            int64_t num_rows, const T* rows /*[num_rows, hidden]*/, const T* topk_prob /*[T,k]*/,
                            const T* dy /*[T, hidden]*/, T* d_rows /*[num_rows, hidden]*/, T* d_topk_prob /*[T,k]*/);

// ---- CUDA: dtype (rows, y, dy, d_rows) f32 or bf16; probs f32; fp32 math ------------------------

// Largest top_k the CUDA kernels take: shared memory holds [groups, k] rows and probs and [8 warps, k]
// partials. permute's CUDA path takes the same bound, since its backward runs unpermute_cuda.
constexpr int kUnpermuteMaxTopk = 512;

void unpermute_cuda(DType dtype, const int32_t* row_map /*[T,k]*/, int64_t num_tokens, int top_k, int64_t hidden,
                    const void* rows /*[num_rows, hidden]*/, const float* topk_prob /*[T,k]*/, void* y /*[T, hidden]*/,
                    cudaStream_t stream);

struct UnpermuteBackwardArgs {                 // device pointers and dims of one unpermute_backward_cuda call
  const int32_t* row_map = nullptr;            // [T,k]
  const int32_t* tokens_per_expert = nullptr;  // [L]   (from permute_pad: finds the pad rows)
  const int32_t* segment_starts = nullptr;     // [L+1]
  const void* rows = nullptr;                  // [num_rows, hidden]; only read for d_topk_prob
  const float* topk_prob = nullptr;            // [T,k], or null (weights 1)
  const void* dy = nullptr;                    // [T, hidden]
  void* d_rows = nullptr;                      // [num_rows, hidden], or null: not wanted
  float* d_topk_prob = nullptr;                // [T,k], or null: not wanted
  int64_t num_tokens = 0, hidden = 0, num_rows = 0;
  int top_k = 0, num_local_experts = 0, align_size = 16;
};
// One launch: token groups scatter prob*dy and reduce the dot products; the other groups zero the
// pad and tail rows of d_rows (nothing is memset first).
void unpermute_backward_cuda(DType dtype, const UnpermuteBackwardArgs& a, cudaStream_t stream);

}  // namespace flowmoe
