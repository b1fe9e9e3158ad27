// Creating named parameters with a seeded init, and casting master weights to the compute dtype.
// Values are drawn on the host from one Rng in creation order and copied to the device, so a seed
// gives the same weights on the CPU and the GPU.
#pragma once
#include <string>
#include <vector>

#include "engine/ops/ops.h"
#include "engine/rng.h"

namespace flowmoe {

class ParamFactory {
 public:
  ParamFactory(uint64_t seed, Device device) : rng_(seed), device_(device) {}
  // f32 leaf requiring grad, N(0, std^2).
  Variable normal(const std::string& name, const Shape& shape, double std) {
    return add(Variable(rng_.normal(shape, 0.0, std, DType::f32, device_), true, name));
  }
  Variable ones(const std::string& name, const Shape& shape) {
    return add(Variable(Tensor::full(shape, 1.0, DType::f32, device_), true, name));
  }
  std::vector<Variable>& params() { return params_; }

 private:
  Rng rng_;
  Device device_;
  std::vector<Variable> params_;
  Variable add(Variable v) {
    params_.push_back(v);
    return v;
  }
};

// The master weight as the forward uses it: a cast (whose gradient returns to f32) when the
// compute dtype differs, the weight itself otherwise.
inline Variable compute_weight(const Variable& w, DType compute) { return w.dtype() == compute ? w : cast(w, compute); }

}  // namespace flowmoe
