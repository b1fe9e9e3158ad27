// CPU reference for the AdamW update and the squared-norm reduction (see kernels/adamw.h).
#include "kernels/adamw.h"
#include "kernels/common/error.h"

namespace flowmoe {

void adamw_cpu(float* param, const float* grad, void* exp_avg, void* exp_avg_sq, int64_t n, const AdamWStep& s,
               WeightCopy copy, DType moment_dtype, MomentRounding rounding) {
  FLOWMOE_CHECK(!copy.data || copy.dtype == DType::f32 || copy.dtype == DType::bf16, DTypeError,
                "adamw_cpu: a weight copy in ", dtype_name(copy.dtype), " (f32 or bf16)");
  FLOWMOE_CHECK(moment_dtype == DType::f32 || moment_dtype == DType::bf16, DTypeError, "adamw_cpu: moments in ",
                dtype_name(moment_dtype), " (f32 or bf16)");
  const bool narrow = moment_dtype == DType::bf16;
  const uint64_t stream = rounding_stream(rounding.key, s.update);
  float* m32 = static_cast<float*>(exp_avg);
  float* v32 = static_cast<float*>(exp_avg_sq);
  uint16_t* m16 = static_cast<uint16_t*>(exp_avg);
  uint16_t* v16 = static_cast<uint16_t*>(exp_avg_sq);
  for (int64_t i = 0; i < n; ++i) {
    float m = narrow ? bf16_bits_value(m16[i]) : m32[i];
    float v = narrow ? bf16_bits_value(v16[i]) : v32[i];
    adamw_element(param[i], m, v, grad[i], s);
    if (narrow) {
      round_moments_bf16(m, v, stream, rounding.first_index + i, &m16[i], &v16[i]);
    } else {
      m32[i] = m;
      v32[i] = v;
    }
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
    adamw_cpu(t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.n, s, t.copy, t.moment_dtype, t.rounding);
  }
}

double sum_squares_cpu(const float* x, int64_t n) {
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += double(x[i]) * double(x[i]);
  return acc;
}

}  // namespace flowmoe
