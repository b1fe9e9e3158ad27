// CPU reference for SiLU (see kernels/silu.h).
#include "kernels/silu.h"

namespace flowmoe {

template <class T>
void silu_forward_cpu(T* y, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = silu_value(x[i]);
}

template <class T>
void silu_backward_cpu(T* d_x, const T* d_y, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d_x[i] = d_y[i] * silu_grad_value(x[i]);
}

template void silu_forward_cpu<float>(float*, const float*, int64_t);
template void silu_forward_cpu<double>(double*, const double*, int64_t);
template void silu_backward_cpu<float>(float*, const float*, const float*, int64_t);
template void silu_backward_cpu<double>(double*, const double*, const double*, int64_t);

}  // namespace flowmoe
