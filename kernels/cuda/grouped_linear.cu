// GroupedLinear on the GPU: one cuBLASLt GEMM per expert (gemm_cuda, fp32 compute), issued in expert
// order; experts with no rows issue nothing (wgrad zero-fills them unless accumulating).
//   forward  y_e  = x_e · w_eᵀ     gemm(trans_b)   m = rows_e, n = N, k = K
//   dgrad    dx_e = dy_e · w_e     gemm            m = rows_e, n = K, k = N
//   wgrad    dw_e = dy_eᵀ · x_e    gemm(trans_a)   m = N, n = K, k = rows_e   (fp32 output, beta 0 or 1)
// Tail rows past sum(rows) are zeroed with cudaMemsetAsync (no kernel of our own is needed).
// The counts are host values read once per layer by the caller; nothing here synchronises.
// Host cost per expert is gemm_cuda's plan lookup + cublasLtMatmul; a new per-expert count reuses its
// bucket's algorithm (kernels/cuda/linear.cu), so changing counts cost no heuristic queries.
// Optionally (set_grouped_linear_streams) the expert GEMMs are spread over a few side streams.
// CPU reference: kernels/cpu/grouped_linear.cpp. Tests: tests/test_grouped_linear.cpp.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/stream_fan.cuh"
#include "kernels/grouped_linear.h"
#include "kernels/linear.h"

namespace flowmoe {

namespace {

void check_args(DType dtype, int64_t num_experts, int64_t m_total, int64_t n, int64_t k, const char* what) {
  FLOWMOE_CHECK(dtype == DType::f32 || dtype == DType::bf16, DTypeError, what, " supports f32 and bf16, got ",
                dtype_name(dtype));
  FLOWMOE_CHECK(num_experts >= 0 && m_total >= 0 && n >= 0 && k >= 0, ShapeError, what,
                ": negative size E=", num_experts, " M_total=", m_total, " N=", n, " K=", k);
}

const char* at_row(const void* base, int64_t row, int64_t cols, size_t elem) {
  return static_cast<const char*>(base) + size_t(row) * size_t(cols) * elem;
}
char* at_row(void* base, int64_t row, int64_t cols, size_t elem) {
  return static_cast<char*>(base) + size_t(row) * size_t(cols) * elem;
}

// Rows [first_row, m_total) of out [m_total, cols] become zeros (0 has all-zero bits in f32 and bf16).
void zero_tail(void* out, int64_t first_row, int64_t m_total, int64_t cols, size_t elem, cudaStream_t stream) {
  if (first_row >= m_total || cols == 0) return;
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(at_row(out, first_row, cols, elem), 0,
                                     size_t(m_total - first_row) * size_t(cols) * elem, stream));
}

// ---- side streams: kernels/cuda/stream_fan.cuh ---------------------------------------------------

constexpr int kMaxStreams = 8;
std::atomic<int> g_num_streams{1};

// Calls gemm(e, first row, rows, stream) for each expert with rows, in expert order, on the streams of a
// fan out of `stream` (one GEMM per expert, several in flight), then joins them back into it.
template <class Gemm>
void for_each_expert(const int64_t* padded_tokens_per_expert, int64_t num_experts, cudaStream_t stream, Gemm&& gemm) {
  StreamFan fan(stream, experts_with_rows(padded_tokens_per_expert, num_experts));
  int64_t off = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = padded_tokens_per_expert[e];
    if (rows > 0) gemm(e, off, rows, fan.next());
    off += rows;
  }
  fan.join();
}

}  // namespace

void set_grouped_linear_streams(int num_streams) {
  FLOWMOE_CHECK(num_streams >= 1 && num_streams <= kMaxStreams, Error, "set_grouped_linear_streams: ", num_streams,
                " is outside [1, ", kMaxStreams, "]");
  g_num_streams.store(num_streams, std::memory_order_relaxed);
}
int grouped_linear_streams() { return g_num_streams.load(std::memory_order_relaxed); }

// ---- launchers --------------------------------------------------------------------------------

void grouped_linear_forward_cuda(DType dtype, const void* x, const void* w, void* y,
                                 const int64_t* padded_tokens_per_expert, int64_t num_experts, int64_t m_total,
                                 int64_t n, int64_t k, cudaStream_t stream) {
  check_args(dtype, num_experts, m_total, n, k, "grouped_linear_forward_cuda");
  int64_t total = check_grouped_rows(padded_tokens_per_expert, num_experts, m_total, "grouped_linear_forward_cuda");
  const size_t es = dtype_size(dtype);
  zero_tail(y, total, m_total, n, es, stream);
  if (n == 0) return;
  for_each_expert(
      padded_tokens_per_expert, num_experts, stream, [&](int64_t e, int64_t off, int64_t rows, cudaStream_t s) {
        gemm_cuda(false, true, rows, n, k, dtype, at_row(x, off, k, es), std::max<int64_t>(1, k),
                  at_row(w, e * n, k, es), std::max<int64_t>(1, k), dtype, at_row(y, off, n, es), n, nullptr, false, s);
      });
}

void grouped_linear_dgrad_cuda(DType dtype, const void* dy, const void* w, void* dx,
                               const int64_t* padded_tokens_per_expert, int64_t num_experts, int64_t m_total, int64_t n,
                               int64_t k, cudaStream_t stream) {
  check_args(dtype, num_experts, m_total, n, k, "grouped_linear_dgrad_cuda");
  int64_t total = check_grouped_rows(padded_tokens_per_expert, num_experts, m_total, "grouped_linear_dgrad_cuda");
  const size_t es = dtype_size(dtype);
  zero_tail(dx, total, m_total, k, es, stream);
  if (k == 0) return;
  for_each_expert(padded_tokens_per_expert, num_experts, stream,
                  [&](int64_t e, int64_t off, int64_t rows, cudaStream_t s) {
                    gemm_cuda(false, false, rows, k, n, dtype, at_row(dy, off, n, es), std::max<int64_t>(1, n),
                              at_row(w, e * n, k, es), k, dtype, at_row(dx, off, k, es), k, nullptr, false, s);
                  });
}

void grouped_linear_wgrad_cuda(DType dtype, const void* x, const void* dy, float* dw,
                               const int64_t* padded_tokens_per_expert, int64_t num_experts, int64_t m_total, int64_t n,
                               int64_t k, bool accumulate, cudaStream_t stream) {
  check_args(dtype, num_experts, m_total, n, k, "grouped_linear_wgrad_cuda");
  check_grouped_rows(padded_tokens_per_expert, num_experts, m_total, "grouped_linear_wgrad_cuda");
  const size_t es = dtype_size(dtype), expert_bytes = size_t(n) * size_t(k) * sizeof(float);
  if (expert_bytes == 0) return;
  for (int64_t e = 0; e < num_experts; ++e)  // no tokens: the gradient is an empty sum
    if (padded_tokens_per_expert[e] == 0 && !accumulate)
      FLOWMOE_CUDA_CHECK(cudaMemsetAsync(dw + e * n * k, 0, expert_bytes, stream));
  for_each_expert(padded_tokens_per_expert, num_experts, stream,
                  [&](int64_t e, int64_t off, int64_t rows, cudaStream_t s) {
                    gemm_cuda(true, false, n, k, rows, dtype, at_row(dy, off, n, es), n, at_row(x, off, k, es), k,
                              DType::f32, dw + e * n * k, k, nullptr, accumulate, s);
                  });
}

}  // namespace flowmoe
