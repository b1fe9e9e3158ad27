// CPU reference for GroupedLinear (see kernels/grouped_linear.h): a loop over experts, each one a
// row-major GEMM from the linear reference (gemm_cpu), so every expert equals linear() on its rows.
#include "kernels/grouped_linear.h"

#include <algorithm>

#include "kernels/common/error.h"
#include "kernels/linear.h"

namespace flowmoe {

int64_t check_grouped_rows(const int64_t* padded_tokens_per_expert, int64_t num_experts, int64_t m_total,
                           const char* what) {
  int64_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    FLOWMOE_CHECK(padded_tokens_per_expert[e] >= 0, ShapeError, what, ": expert ", e, " has a negative row count ",
                  padded_tokens_per_expert[e]);
    total += padded_tokens_per_expert[e];
  }
  FLOWMOE_CHECK(total <= m_total, ShapeError, what, ": padded_tokens_per_expert of ", num_experts, " experts sum to ",
                total, " rows, beyond the ", m_total, " rows of the input (M_total)");
  return total;
}

// Calls gemm(e, first row, rows) for each expert with rows, in expert order; returns the rows covered.
template <class Gemm>
int64_t for_each_expert(const int64_t* padded_tokens_per_expert, int64_t num_experts, Gemm&& gemm) {
  int64_t off = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    const int64_t rows = padded_tokens_per_expert[e];
    if (rows > 0) gemm(e, off, rows);
    off += rows;
  }
  return off;
}

template <class T>
void grouped_linear_forward_cpu(const T* x, const T* w, T* y, const int64_t* padded_tokens_per_expert,
                                int64_t num_experts, int64_t m_total, int64_t n, int64_t k) {
  const int64_t end = for_each_expert(padded_tokens_per_expert, num_experts, [&](int64_t e, int64_t off, int64_t rows) {
    gemm_cpu<T>(false, true, rows, n, k, x + off * k, w + e * n * k, y + off * n, false);
  });
  std::fill(y + end * n, y + m_total * n, T(0));  // tail rows past the last segment
}

template <class T>
void grouped_linear_dgrad_cpu(const T* dy, const T* w, T* dx, const int64_t* padded_tokens_per_expert,
                              int64_t num_experts, int64_t m_total, int64_t n, int64_t k) {
  const int64_t end = for_each_expert(padded_tokens_per_expert, num_experts, [&](int64_t e, int64_t off, int64_t rows) {
    gemm_cpu<T>(false, false, rows, k, n, dy + off * n, w + e * n * k, dx + off * k, false);
  });
  std::fill(dx + end * k, dx + m_total * k, T(0));
}

template <class T>
void grouped_linear_wgrad_cpu(const T* x, const T* dy, T* dw, const int64_t* padded_tokens_per_expert,
                              int64_t num_experts, int64_t n, int64_t k, bool accumulate) {
  if (!accumulate)  // an expert without tokens has an empty sum
    for (int64_t e = 0; e < num_experts; ++e)
      if (padded_tokens_per_expert[e] == 0) std::fill(dw + e * n * k, dw + (e + 1) * n * k, T(0));
  for_each_expert(padded_tokens_per_expert, num_experts, [&](int64_t e, int64_t off, int64_t rows) {
    gemm_cpu<T>(true, false, n, k, rows, dy + off * n, x + off * k, dw + e * n * k, accumulate);
  });
}

#define INSTANTIATE(T)                                                                                           \
  template void grouped_linear_forward_cpu<T>(const T*, const T*, T*, const int64_t*, int64_t, int64_t, int64_t, \
                                              int64_t);                                                          \
  template void grouped_linear_dgrad_cpu<T>(const T*, const T*, T*, const int64_t*, int64_t, int64_t, int64_t,   \
                                            int64_t);                                                            \
  template void grouped_linear_wgrad_cpu<T>(const T*, const T*, T*, const int64_t*, int64_t, int64_t, int64_t, bool);
INSTANTIATE(float)
INSTANTIATE(double)
#undef INSTANTIATE

}  // namespace flowmoe
