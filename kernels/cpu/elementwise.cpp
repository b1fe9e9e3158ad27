// CPU reference for elementwise add / mul / scale (see kernels/elementwise.h).
#include "kernels/elementwise.h"

namespace flowmoe {

template <class T>
void binary_cpu(BinaryOp op, T* out, const T* a, const T* b, int64_t n) {
  if (op == BinaryOp::add)
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
  else
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

template <class T>
void scale_cpu(T* out, const T* a, double s, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = T(s * a[i]);
}

template void binary_cpu<float>(BinaryOp, float*, const float*, const float*, int64_t);
template void binary_cpu<double>(BinaryOp, double*, const double*, const double*, int64_t);
template void scale_cpu<float>(float*, const float*, double, int64_t);
template void scale_cpu<double>(double*, const double*, double, int64_t);

}  // namespace flowmoe
