// MoE token permutation: the routing map (counts, padded counts, segment starts, stable row_map) and
// the fused permute+pad that moves token rows into the expert-major buffer, plus its backward.
//
// Flat entry i = t*k + j of topk_idx [T,k] holds a global expert id in [0, E); its local expert is
// e = id - expert_offset when that lies in [0, L), otherwise the entry is not routed here (row_map -1).
// Expert e owns rows [segment_starts[e], segment_starts[e+1]): its tokens_per_expert[e] copies in
// ascending flat-index order (stable: CPU and GPU give the same buffer), then pad rows up to a
// multiple of align_size. Rows past segment_starts[L] (the tail of a worst-case sized buffer) are
// written like pad rows. Nothing is memset first: every output row is written exactly once.
// CPU reference: kernels/cpu/permute.cpp; CUDA: kernels/cuda/permute.cu; node: engine/ops/permute.cpp;
// tests: tests/test_permute.cpp; benchmark: bench/bench_permute.cpp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

struct RoutingDims {
  int64_t num_tokens = 0;     // T
  int top_k = 0;              // k
  int num_experts = 0;        // E: every id in topk_idx must lie in [0, E)
  int expert_offset = 0;      // first expert this rank owns
  int num_local_experts = 0;  // L
  int align_size = 16;        // 16, 32, 64 or 128
  int64_t num_rows = 0;       // rows of the permuted buffer; must hold the padded total
};

// T*k + min(L, T*k)*(align_size-1): no expert segment can need more (an expert with no token has 0 rows).
int64_t permute_worst_case_rows(int64_t num_tokens, int top_k, int num_local_experts, int align_size);
// Throws (naming the bad value) unless the dims are consistent and every row index fits in int32.
void check_routing_dims(const RoutingDims& d);

// ---- CPU reference ----------------------------------------------------------------------------

// Builds the routing map. Throws Error naming the token and value for an id outside [0, E), and
// ShapeError when the padded total exceeds d.num_rows.
void permute_map_cpu(const RoutingDims& d, const int32_t* topk_idx /*[T,k]*/, int32_t* row_map /*[T,k]*/,
                     int32_t* tokens_per_expert /*[L]*/, int32_t* padded_tokens_per_expert /*[L]*/,
                     int32_t* segment_starts /*[L+1]*/);
// dst[row_map[t,j]] = src[t] (rows of row_bytes bytes); every other row of dst is pad_row (zeros when null).
void permute_rows_cpu(const RoutingDims& d, const int32_t* row_map /*[T,k]*/, const void* src /*[T, row_bytes]*/,
                      size_t row_bytes, const void* pad_row /*[row_bytes] or null*/,
                      void* dst /*[num_rows, row_bytes]*/);
// probs[row_map[i]] = topk_prob[i]; every other row 0.
template <class P>
void permute_probs_cpu(const RoutingDims& d, const int32_t* row_map /*[T,k]*/, const P* topk_prob /*[T,k]*/,
                       P* probs /*[num_rows]*/);
// Backward: d_x[t] = sum over routed j (ascending) of d_rows[row_map[t,j]]; d_topk_prob[t,j] =
// d_probs[row_map[t,j]], 0 where not routed. Either output may be null (not wanted).
template <class T>
void permute_backward_cpu(const int32_t* row_map /*[T,k]*/, int64_t num_tokens, int top_k, int64_t hidden,
                          const T* d_rows /*[num_rows, hidden]*/, const T* d_probs /*[num_rows]*/,
                          T* d_x /*[T, hidden]*/, T* d_topk_prob /*[T,k]*/);

// ---- CUDA -------------------------------------------------------------------------------------

struct PermuteBuffers {               // device pointers of one permute_pad_cuda call
  const int32_t* topk_idx = nullptr;  // [T,k]
  const void* x = nullptr;            // [T, row_bytes]; any element type (rows are moved as bytes)
  size_t row_bytes = 0;
  const float* topk_prob = nullptr;  // [T,k], or null: no probs output
  const float* side = nullptr;       // [T, side_cols] per-row side payload (FP8 scale_inv), or null
  int side_cols = 0;
  float side_pad_value = 0.f;                   // what pad and tail rows of side_rows hold
  void* rows = nullptr;                         // [num_rows, row_bytes]
  float* probs = nullptr;                       // [num_rows]
  float* side_rows = nullptr;                   // [num_rows, side_cols]
  int32_t* row_map = nullptr;                   // [T,k]
  int32_t* tokens_per_expert = nullptr;         // [L]
  int32_t* padded_tokens_per_expert = nullptr;  // [L]
  int32_t* segment_starts = nullptr;            // [L+1]
  void* workspace = nullptr;                    // permute_workspace_bytes(d) bytes, no initialisation needed
};
size_t permute_workspace_bytes(const RoutingDims& d);
// Two launches in the usual case (the routing map: one cooperative kernel; then the row move, with
// programmatic dependent launch), four when the routing kernel's blocks cannot all be resident at once
// (very many tokens, or many local experts); no host synchronisation. A bad expert id, or a padded total
// above d.num_rows, prints the culprit and traps. Kernels: kernels/cuda/permute.cu.
// Which kernel moves the rows (permute_pad_cuda, permute_rows_cuda); outputs are bit-identical either way.
//   classic:   thread groups with vector loads and stores.
//   tma:       sm_90 bulk copies through shared memory, used only when row_bytes and both x and rows are
//              16-byte aligned (else classic).
//   automatic: tma for rows of kPermuteTmaMinRowBytes (14 KiB) and more, classic below. The engine's
//              permute op uses it; the others are for tests and bench/bench_permute.cpp.
enum class PermuteRowKernel : uint8_t { automatic, classic, tma };
// Where bulk copies pay: a row long enough that one copy per row amortizes its issue cost (hidden 7168
// in bf16). bench_permute's permute_impl lines compare the two kernels (docs/PERF.md has the figures).
constexpr size_t kPermuteTmaMinRowBytes = 14336;

void permute_pad_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream,
                      PermuteRowKernel row_kernel = PermuteRowKernel::automatic);
// The two halves of permute_pad_cuda, for timing them apart (bench/bench_permute.cpp): the routing map
// (row_map, counts, segment starts; the workspace), then the row move, which reads what the map left.
void permute_map_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream);
void permute_rows_cuda(const RoutingDims& d, const PermuteBuffers& b, cudaStream_t stream,
                       PermuteRowKernel row_kernel = PermuteRowKernel::automatic);

// Backward of permute_pad: dtype (of d_rows and d_x) f32 or bf16, fp32 accumulation, j ascending
// (d_x is unpermute_cuda's gather with weights 1), top_k at most 512. d_x and d_rows may be null
// together; d_topk_prob and d_probs (f32) likewise.
void permute_backward_cuda(DType dtype, const int32_t* row_map /*[T,k]*/, int64_t num_tokens, int top_k, int64_t hidden,
                           const void* d_rows /*[num_rows, hidden]*/, const float* d_probs /*[num_rows]*/,
                           void* d_x /*[T, hidden]*/, float* d_topk_prob /*[T,k]*/, cudaStream_t stream);

}  // namespace flowmoe
