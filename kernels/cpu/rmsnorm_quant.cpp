// CPU reference for the fused RMSNorm + rowwise FP8 quantize (kernels/rmsnorm_quant.h): the unfused
// composition, row by row, rmsnorm_forward_cpu then quantize_rowwise_cpu on the f32 values of y.
#include "kernels/rmsnorm_quant.h"

#include <vector>

#include "kernels/common/error.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"
#include "kernels/rmsnorm.h"

namespace flowmoe {

template <class T>
void rmsnorm_quant_forward_cpu(T* y, uint8_t* q, float* scale_inv, const T* x, const T* weight, int64_t rows,
                               int64_t hidden, double eps) {
  FLOWMOE_CHECK(rows >= 0 && hidden >= 0, ShapeError, "rmsnorm_quant_forward_cpu: bad shape rows ", rows, ", hidden ",
                hidden);
  const int64_t nb = fp8_num_blocks(hidden);
  std::vector<T> y_row(static_cast<size_t>(hidden));
  std::vector<float> y_f32(static_cast<size_t>(hidden));
  for (int64_t r = 0; r < rows; ++r) {
    T* yr = y ? y + r * hidden : y_row.data();
    rmsnorm_forward_cpu<T>(yr, x + r * hidden, weight, 1, hidden, eps);
    for (int64_t j = 0; j < hidden; ++j) y_f32[size_t(j)] = float(yr[j]);
    quantize_rowwise_cpu(DType::f32, y_f32.data(), 1, hidden, q + r * hidden, scale_inv + r * nb);
  }
}

template void rmsnorm_quant_forward_cpu<float>(float*, uint8_t*, float*, const float*, const float*, int64_t, int64_t,
                                               double);
template void rmsnorm_quant_forward_cpu<double>(double*, uint8_t*, float*, const double*, const double*, int64_t,
                                                int64_t, double);

}  // namespace flowmoe
