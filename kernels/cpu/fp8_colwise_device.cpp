// CPU references of the device-count colwise FP8 kernels (kernels/fp8_transpose.h: fp8_transpose_device_*,
// kernels/quantize.h: quantize_colwise_device_*): the host-count reference with the counts as its segments,
// then the worst-case layout's rows of scale_inv past the real blocks set to 1.0f (the columns of the data
// past the segments are zero already). Bit-identical to kernels/cuda/fp8_transpose.cu and
// kernels/cuda/quantize.cu. Tests: tests/test_fp8_colwise_device.cpp.
#include <algorithm>
#include <vector>

#include "kernels/common/error.h"
#include "kernels/fp8.h"
#include "kernels/fp8_transpose.h"
#include "kernels/grouped_gemm_device.h"
#include "kernels/quantize.h"

namespace flowmoe {

namespace {

// The counts as host segments, checked as the device checks them (a ShapeError naming the value where the
// GPU traps).
std::vector<int64_t> segments_of(const char* what, const int32_t* counts, int64_t num_experts, int64_t M, int64_t K) {
  FLOWMOE_CHECK(M >= 0 && K >= 0, ShapeError, what, ": bad shape [", M, ", ", K, "]");
  FLOWMOE_CHECK(num_experts >= 0 && num_experts <= kGroupedGemmMaxExperts, ShapeError, what, ": E=", num_experts,
                " experts (device counts take 0 to ", kGroupedGemmMaxExperts, ")");
  FLOWMOE_CHECK(num_experts == 0 || counts != nullptr, Error, what, ": ", num_experts, " experts but no counts");
  std::vector<int64_t> rows(counts, counts + num_experts);
  int64_t total = 0;
  for (int64_t e = 0; e < num_experts; ++e) {
    FLOWMOE_CHECK(rows[size_t(e)] >= 0, ShapeError, what, ": expert ", e, " has ", rows[size_t(e)], " rows");
    total += rows[size_t(e)];
  }
  FLOWMOE_CHECK(total <= M, ShapeError, what, ": the ", num_experts, " experts' counts sum to ", total,
                " rows, beyond M = ", M);
  return rows;
}

// Rows [num_blocks, max_blocks) of a worst-case sized colwise scale_inv [max_blocks, K].
void fill_unused_scale_rows(float* scale_inv, const std::vector<int64_t>& rows, int64_t M, int64_t K) {
  const int64_t used = colwise_num_blocks(rows.data(), int64_t(rows.size()));
  const int64_t max_blocks = fp8_colwise_max_blocks(M, int64_t(rows.size()));
  std::fill(scale_inv + used * K, scale_inv + max_blocks * K, 1.f);
}

}  // namespace

void fp8_transpose_device_cpu(const uint8_t* q, const float* scale_inv, int64_t M, int64_t K, const int32_t* counts,
                              int64_t num_experts, uint8_t* q_t, float* scale_inv_t) {
  const std::vector<int64_t> rows = segments_of("fp8_transpose_device_cpu", counts, num_experts, M, K);
  fp8_transpose_cpu(q, scale_inv, M, K, rows.data(), num_experts, q_t, scale_inv_t);
  fill_unused_scale_rows(scale_inv_t, rows, M, K);
}

void quantize_colwise_device_cpu(DType dtype, const void* x, int64_t M, int64_t K, const int32_t* counts,
                                 int64_t num_experts, uint8_t* q, float* scale_inv) {
  const std::vector<int64_t> rows = segments_of("quantize_colwise_device_cpu", counts, num_experts, M, K);
  quantize_colwise_cpu(dtype, x, M, K, rows.data(), num_experts, q, scale_inv);
  fill_unused_scale_rows(scale_inv, rows, M, K);
}

}  // namespace flowmoe
