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

template <class T>
void grouped_linear_forward_cpu(const T* x, const T* w, T* y, const int64_t* padded_tokens_per_expert,
                                int64_t num_experts, int64_t m_total, int64_t n, int64_t k) {
  int64_t off = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t rows = padded_tokens_per_expert[e];
    if (rows > 0) gemm_cpu<T>(false, true, rows, n, k, x + off * k, w + e * n * k, y + off * n, false);
    off += rows;
  }
  std::fill(y + off * n, y + m_total * n, T(0));  // tail rows past the last segment
}

template <class T>
void grouped_linear_dgrad_cpu(const T* dy, const T* w, T* dx, const int64_t* padded_tokens_per_expert,
                              int64_t num_experts, int64_t m_total, int64_t n, int64_t k) {
  int64_t off = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t rows = padded_tokens_per_expert[e];
    if (rows > 0) gemm_cpu<T>(false, false, rows, k, n, dy + off * n, w + e * n * k, dx + off * k, false);
    off += rows;
  }
  std::fill(dx + off * k, dx + m_total * k, T(0));
}

template <class T>
void grouped_linear_wgrad_cpu(const T* x, const T* dy, T* dw, const int64_t* padded_tokens_per_expert,
                              int64_t num_experts, int64_t n, int64_t k, bool accumulate) {
  int64_t off = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t rows = padded_tokens_per_expert[e];
    T* dw_e = dw + e * n * k;
    if (rows > 0)
      gemm_cpu<T>(true, false, n, k, rows, dy + off * n, x + off * k, dw_e, accumulate);
    else if (!accumulate)
      std::fill(dw_e, dw_e + n * k, T(0));  // no tokens: an empty sum
    off += rows;
  }
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
