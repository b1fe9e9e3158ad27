// CPU reference for the fused cross-entropy (see kernels/cross_entropy.h). It is softmax's
// reference (kernels/cpu/softmax.cpp) folded into the loss: -log softmax(row)[t] = lse - row[t].
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/common/error.h"
#include "kernels/cross_entropy.h"

namespace flowmoe {

template <class T>
void cross_entropy_forward_cpu(T* loss, T* lse, const T* logits, const int32_t* targets, int64_t N, int64_t V,
                               int ignore_index) {
  double total = 0;  // double accumulators keep the f32 reference well below the GPU's error
  int64_t count = 0;
  for (int64_t r = 0; r < N; ++r) {
    const T* row = logits + r * V;
    int32_t t = targets[r];
    if (t == ignore_index) {
      lse[r] = 0;
      continue;
    }
    FLOWMOE_CHECK(t >= 0 && t < V, Error, "cross_entropy: target ", t, " of row ", r, " is outside [0, ", V,
                  ") and is not ignore_index (", ignore_index, ")");
    T max = -std::numeric_limits<T>::infinity();
    for (int64_t c = 0; c < V; ++c) max = std::max(max, row[c]);
    double sum = 0;
    for (int64_t c = 0; c < V; ++c) sum += std::exp(row[c] - max);
    lse[r] = max + T(std::log(sum));
    total += double(lse[r]) - row[t];
    ++count;
  }
  *loss = count > 0 ? T(total / double(count)) : T(0);
}

template <class T>
void cross_entropy_backward_cpu(T* d_logits, T d_loss, const T* logits, const T* lse, const int32_t* targets, int64_t N,
                                int64_t V, int ignore_index) {
  int64_t count = 0;
  for (int64_t r = 0; r < N; ++r) count += targets[r] != ignore_index;
  T scale = count > 0 ? d_loss * (T(1) / T(count)) : T(0);
  for (int64_t r = 0; r < N; ++r) {
    const T* row = logits + r * V;
    T* d_row = d_logits + r * V;
    int32_t t = targets[r];
    for (int64_t c = 0; c < V; ++c)
      d_row[c] = t == ignore_index ? T(0) : (std::exp(row[c] - lse[r]) - T(c == t ? 1 : 0)) * scale;
  }
}

template void cross_entropy_forward_cpu<float>(float*, float*, const float*, const int32_t*, int64_t, int64_t, int);
template void cross_entropy_forward_cpu<double>(double*, double*, const double*, const int32_t*, int64_t, int64_t, int);
template void cross_entropy_backward_cpu<float>(float*, float, const float*, const float*, const int32_t*, int64_t,
                                                int64_t, int);
template void cross_entropy_backward_cpu<double>(double*, double, const double*, const double*, const int32_t*, int64_t,
                                                 int64_t, int);

}  // namespace flowmoe
