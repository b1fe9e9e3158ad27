// CPU reference for the fused residual add + RMSNorm (+ quantize) (kernels/add_rmsnorm.h): the unfused
// composition, binary_cpu's add, then rmsnorm_forward_cpu or, with q, rmsnorm_quant_forward_cpu.
#include "kernels/add_rmsnorm.h"

#include "kernels/common/error.h"
#include "kernels/elementwise.h"
#include "kernels/rmsnorm.h"
#include "kernels/rmsnorm_quant.h"

namespace flowmoe {

template <class T>
void add_rmsnorm_forward_cpu(T* h, T* y, uint8_t* q, float* scale_inv, const T* x, const T* a, const T* weight,
                             int64_t rows, int64_t hidden, double eps) {
  FLOWMOE_CHECK(rows >= 0 && hidden >= 0, ShapeError, "add_rmsnorm_forward_cpu: bad shape rows ", rows, ", hidden ",
                hidden);
  // (an empty tensor's data is null: nothing to write then)
  FLOWMOE_CHECK(y != nullptr || q != nullptr || rows * hidden == 0, Error,
                "add_rmsnorm_forward_cpu: neither y nor q asked for");
  binary_cpu<T>(BinaryOp::add, h, x, a, rows * hidden);
  if (q != nullptr)
    rmsnorm_quant_forward_cpu<T>(y, q, scale_inv, h, weight, rows, hidden, eps);
  else
    rmsnorm_forward_cpu<T>(y, h, weight, rows, hidden, eps);
}

template void add_rmsnorm_forward_cpu<float>(float*, float*, uint8_t*, float*, const float*, const float*, const float*,
                                             int64_t, int64_t, double);
template void add_rmsnorm_forward_cpu<double>(double*, double*, uint8_t*, float*, const double*, const double*,
                                              const double*, int64_t, int64_t, double);

}  // namespace flowmoe
