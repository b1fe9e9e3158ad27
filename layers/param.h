// Creating named parameters with a seeded init, each with its ParamShard (parallel/param_shard.h), and casting
// master weights to the compute dtype.
// Values are drawn on the host from one Rng in creation order and copied to the device, so a seed
// gives the same weights on the CPU and the GPU, and on every rank: an expert-sharded parameter draws
// the full tensor and keeps this rank's rows, so its values do not depend on the expert-parallel size.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/fp8_weight.h"
#include "engine/ops/ops.h"
#include "engine/rng.h"
#include "parallel/param_shard.h"

namespace flowmoe {

class ParamFactory {
 public:
  ParamFactory(uint64_t seed, Device device) : rng_(seed), device_(device) {}
  // f32 leaf requiring grad, N(0, std^2).
  Variable normal(const std::string& name, const Shape& shape, double std) {
    return add(Variable(rng_.normal(shape, 0.0, std, DType::f32, device_), true, name), {false, 0, shape[0]});
  }
  // An expert weight [E, ...] of which this rank holds rows [offset, offset + rows): those rows of the
  // full tensor's draw, bit for bit (the Rng advances as for a whole one).
  Variable expert_normal(const std::string& name, const Shape& full_shape, double std, int64_t offset, int64_t rows) {
    Tensor mine = rng_.normal_rows(full_shape, offset, rows, 0.0, std, DType::f32, device_);
    return add(Variable(mine, true, name), {true, offset, full_shape[0]});
  }
  Variable ones(const std::string& name, const Shape& shape) {
    return add(Variable(Tensor::full(shape, 1.0, DType::f32, device_), true, name), {false, 0, shape[0]});
  }
  // Marks p, made by this factory, as read in f32 (ParamShard::reads_f32).
  void read_in_f32(const Variable& p) {
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].impl() == p.impl()) shards_[i].reads_f32 = true;
  }
  // Marks p as read through `cache`'s FP8 copy, made from its f32 values (reads_f32 too).
  void read_in_fp8(const Variable& p, const Fp8WeightCache& cache) {
    read_in_f32(p);
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].impl() == p.impl()) shards_[i].fp8 = cache.copy();
  }
  std::vector<Variable>& params() { return params_; }
  std::vector<ParamShard>& shards() { return shards_; }  // one per parameter, in the same order

 private:
  Rng rng_;
  Device device_;
  std::vector<Variable> params_;
  std::vector<ParamShard> shards_;
  Variable add(Variable v, ParamShard shard) {
    params_.push_back(v);
    shards_.push_back(shard);
    return v;
  }
};

// The master weight as the forward uses it: a cast (whose gradient returns to f32) when the
// compute dtype differs, the weight itself otherwise.
inline Variable compute_weight(const Variable& w, DType compute) { return w.dtype() == compute ? w : cast(w, compute); }

}  // namespace flowmoe
