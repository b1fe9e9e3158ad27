// CPU reference for softmax over the last dim (see kernels/softmax.h).
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/softmax.h"

namespace flowmoe {

template <class T>
void softmax_forward_cpu(T* y, const T* x, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* yr = y + r * cols;
    T max = -std::numeric_limits<T>::infinity();
    for (int64_t c = 0; c < cols; ++c) max = std::max(max, xr[c]);
    double sum = 0;  // double accumulators keep the f32 reference well below the GPU's error
    for (int64_t c = 0; c < cols; ++c) sum += std::exp(xr[c] - max);
    T inv = T(1 / sum);
    for (int64_t c = 0; c < cols; ++c) yr[c] = std::exp(xr[c] - max) * inv;
  }
}

template <class T>
void softmax_backward_cpu(T* d_x, const T* d_y, const T* y, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* dyr = d_y + r * cols;
    const T* yr = y + r * cols;
    double dot = 0;
    for (int64_t c = 0; c < cols; ++c) dot += double(dyr[c]) * yr[c];
    for (int64_t c = 0; c < cols; ++c) d_x[r * cols + c] = yr[c] * (dyr[c] - T(dot));
  }
}

template void softmax_forward_cpu<float>(float*, const float*, int64_t, int64_t);
template void softmax_forward_cpu<double>(double*, const double*, int64_t, int64_t);
template void softmax_backward_cpu<float>(float*, const float*, const float*, int64_t, int64_t);
template void softmax_backward_cpu<double>(double*, const double*, const double*, int64_t, int64_t);

}  // namespace flowmoe
