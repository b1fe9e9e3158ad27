// CPU reference for SwiGLU (see kernels/swiglu.h): the silu reference followed by a product.
#include "kernels/swiglu.h"

#include "kernels/silu.h"

namespace flowmoe {

template <class T>
void swiglu_forward_cpu(T* out, const T* gate_up, int64_t rows, int64_t F) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * F;
    const T* up = gate + F;
    for (int64_t j = 0; j < F; ++j) {
      T act = silu_value(gate[j]);  // rounded to T first, as silu() then mul() would
      out[r * F + j] = act * up[j];
    }
  }
}

template <class T>
void swiglu_backward_cpu(T* d_gate_up, const T* d_out, const T* gate_up, int64_t rows, int64_t F) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * F;
    const T* up = gate + F;
    T* d_gate = d_gate_up + r * 2 * F;
    T* d_up = d_gate + F;
    for (int64_t j = 0; j < F; ++j) {
      T dy = d_out[r * F + j];
      d_gate[j] = dy * up[j] * silu_grad_value(gate[j]);
      d_up[j] = dy * silu_value(gate[j]);
    }
  }
}

template void swiglu_forward_cpu<float>(float*, const float*, int64_t, int64_t);
template void swiglu_forward_cpu<double>(double*, const double*, int64_t, int64_t);
template void swiglu_backward_cpu<float>(float*, const float*, const float*, int64_t, int64_t);
template void swiglu_backward_cpu<double>(double*, const double*, const double*, int64_t, int64_t);

}  // namespace flowmoe
