// CPU reference for the AdamW update and the squared-norm reduction (see kernels/adamw.h).
#include <cmath>

#include "kernels/adamw.h"
#include "kernels/common/error.h"

namespace flowmoe {

void adamw_cpu(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n, const AdamWStep& s,
               WeightCopy copy) {
  FLOWMOE_CHECK(!copy.data || copy.dtype == DType::f32 || copy.dtype == DType::bf16, DTypeError,
                "adamw_cpu: a weight copy in ", dtype_name(copy.dtype), " (f32 or bf16)");
  for (int64_t i = 0; i < n; ++i) {
    float g = s.grad_scale * grad[i];
    float m = s.beta1 * exp_avg[i] + (1.0f - s.beta1) * g;
    float v = s.beta2 * exp_avg_sq[i] + (1.0f - s.beta2) * g * g;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    float update = (m / s.bias_correction1) / (std::sqrt(v / s.bias_correction2) + s.eps);
    param[i] -= s.lr * (update + s.weight_decay * param[i]);
    if (copy.data && copy.dtype == DType::f32) static_cast<float*>(copy.data)[i] = param[i];
    if (copy.data && copy.dtype == DType::bf16) static_cast<bf16*>(copy.data)[i] = to_bf16(param[i]);
  }
}

void adamw_multi_cpu(const AdamWTensor* tensors, int64_t num_tensors, const StepScalars* control) {
  FLOWMOE_CHECK(num_tensors >= 0 && (tensors || num_tensors == 0), Error, "adamw_multi_cpu: ", num_tensors, " tensors");
  if (control && !control->apply) return;  // a skipped step: parameters and moments stay as they are
  for (int64_t i = 0; i < num_tensors; ++i) {
    const AdamWTensor& t = tensors[i];
    const AdamWStep s = control ? scheduled_adamw_step(t.step, *control, t.lr_multiplier) : t.step;
    adamw_cpu(t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.n, s, t.copy);
  }
}

double sum_squares_cpu(const float* x, int64_t n) {
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += double(x[i]) * double(x[i]);
  return acc;
}

}  // namespace flowmoe
