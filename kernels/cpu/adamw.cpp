// CPU reference for the AdamW update and the squared-norm reduction (see kernels/adamw.h).
#include <cmath>

#include "kernels/adamw.h"

namespace flowmoe {

void adamw_cpu(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamWStep& s) {
  for (int64_t i = 0; i < n; ++i) {
    float g = s.grad_scale * grad[i];
    float m = s.beta1 * exp_avg[i] + (1.0f - s.beta1) * g;
    float v = s.beta2 * exp_avg_sq[i] + (1.0f - s.beta2) * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    float update = (m / s.bias_correction1) / (std::sqrt(v / s.bias_correction2) + s.eps);
    param[i] -= s.lr * (update + s.weight_decay * param[i]);
  }
}

double sum_squares_cpu(const float* x, int64_t n) {
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += double(x[i]) * double(x[i]);
  return acc;
}

}  // namespace flowmoe
