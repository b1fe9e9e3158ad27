// CPU reference for sum / mean over all elements (see kernels/reduce.h).
#include "kernels/reduce.h"

namespace flowmoe {

template <class T>
T reduce_cpu(ReduceOp op, const T* x, int64_t n) {
  double acc = 0;  // double keeps the f32 reference well below the GPU's error
  for (int64_t i = 0; i < n; ++i) acc += x[i];
  if (op == ReduceOp::mean) return n > 0 ? T(acc / double(n)) : T(0);
  return T(acc);
}

template <class T>
void reduce_backward_cpu(ReduceOp op, T* d_x, T d_out, int64_t n) {
  if (n == 0) return;
  T v = op == ReduceOp::mean ? d_out / T(n) : d_out;
  for (int64_t i = 0; i < n; ++i) d_x[i] = v;
}

template float reduce_cpu<float>(ReduceOp, const float*, int64_t);
template double reduce_cpu<double>(ReduceOp, const double*, int64_t);
template void reduce_backward_cpu<float>(ReduceOp, float*, float, int64_t);
template void reduce_backward_cpu<double>(ReduceOp, double*, double, int64_t);

}  // namespace flowmoe
