// CPU reference for RMSNorm (see kernels/rmsnorm.h). Row sums and the d_weight sum run in double,
// so for f32 this is the accurate side of any comparison with the GPU.
#include "kernels/rmsnorm.h"

#include <cmath>
#include <vector>

namespace flowmoe {

template <class T>
void rmsnorm_forward_cpu(T* y, const T* x, const T* weight, int64_t rows, int64_t hidden, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * hidden;
    double sum_sq = 0;
    for (int64_t j = 0; j < hidden; ++j) sum_sq += double(xr[j]) * double(xr[j]);
    double rstd = 1.0 / std::sqrt(sum_sq / double(hidden) + eps);
    for (int64_t j = 0; j < hidden; ++j) y[r * hidden + j] = T(double(xr[j]) * rstd * double(weight[j]));
  }
}

template <class T>
void rmsnorm_backward_cpu(T* d_x, T* d_weight, const T* d_y, const T* x, const T* weight, int64_t rows, int64_t hidden,
                          double eps) {
  std::vector<double> d_w(size_t(hidden), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * hidden;
    const T* dyr = d_y + r * hidden;
    double sum_sq = 0, g = 0;
    for (int64_t j = 0; j < hidden; ++j) {
      sum_sq += double(xr[j]) * double(xr[j]);
      g += double(dyr[j]) * double(weight[j]) * double(xr[j]);
    }
    double rstd = 1.0 / std::sqrt(sum_sq / double(hidden) + eps);
    double coef = rstd * rstd * rstd * g / double(hidden);
    for (int64_t j = 0; j < hidden; ++j) {
      d_x[r * hidden + j] = T(rstd * double(dyr[j]) * double(weight[j]) - double(xr[j]) * coef);
      d_w[size_t(j)] += double(dyr[j]) * double(xr[j]) * rstd;
    }
  }
  for (int64_t j = 0; j < hidden; ++j) d_weight[j] = T(d_w[size_t(j)]);
}

template void rmsnorm_forward_cpu<float>(float*, const float*, const float*, int64_t, int64_t, double);
template void rmsnorm_forward_cpu<double>(double*, const double*, const double*, int64_t, int64_t, double);
template void rmsnorm_backward_cpu<float>(float*, float*, const float*, const float*, const float*, int64_t, int64_t,
                                          double);
template void rmsnorm_backward_cpu<double>(double*, double*, const double*, const double*, const double*, int64_t,
                                           int64_t, double);

}  // namespace flowmoe
