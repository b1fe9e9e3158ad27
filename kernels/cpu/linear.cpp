// CPU reference for the row-major GEMM and linear's bias add / bias gradient (see kernels/linear.h).
// Eigen maps the packed buffers in place, so the reference is also fast enough to train on.
#include "kernels/linear.h"

#include <Eigen/Core>

namespace flowmoe {

namespace {
template <class T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using RowVec = Eigen::Matrix<T, 1, Eigen::Dynamic>;
}  // namespace

template <class T>
void gemm_cpu(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const T* a, const T* b, T* c,
              bool accumulate) {
  Eigen::Map<const RowMajor<T>> A(a, trans_a ? k : m, trans_a ? m : k);
  Eigen::Map<const RowMajor<T>> B(b, trans_b ? n : k, trans_b ? k : n);
  Eigen::Map<RowMajor<T>> C(c, m, n);
  auto run = [&](const auto& op_a, const auto& op_b) {
    if (accumulate)
      C.noalias() += op_a * op_b;
    else
      C.noalias() = op_a * op_b;  // Eigen writes zeros when k == 0
  };
  if (!trans_a && !trans_b)
    run(A, B);
  else if (!trans_a)
    run(A, B.transpose());
  else if (!trans_b)
    run(A.transpose(), B);
  else
    run(A.transpose(), B.transpose());
}

template <class T>
void add_bias_cpu(T* c, const T* bias, int64_t m, int64_t n) {
  Eigen::Map<RowMajor<T>> C(c, m, n);
  Eigen::Map<const RowVec<T>> b(bias, n);
  C.rowwise() += b;
}

template <class T>
void bias_grad_cpu(T* d_bias, const T* dy, int64_t m, int64_t n) {
  Eigen::Map<const RowMajor<T>> D(dy, m, n);
  Eigen::Map<RowVec<T>> out(d_bias, n);
  out = D.colwise().sum();  // an empty column sums to 0
}

template void gemm_cpu<float>(bool, bool, int64_t, int64_t, int64_t, const float*, const float*, float*, bool);
template void gemm_cpu<double>(bool, bool, int64_t, int64_t, int64_t, const double*, const double*, double*, bool);
template void add_bias_cpu<float>(float*, const float*, int64_t, int64_t);
template void add_bias_cpu<double>(double*, const double*, int64_t, int64_t);
template void bias_grad_cpu<float>(float*, const float*, int64_t, int64_t);
template void bias_grad_cpu<double>(double*, const double*, int64_t, int64_t);

}  // namespace flowmoe
