// Where a parameter's rows sit in the full tensor, and how the forward reads it: what the data-parallel reductions
// (grad_reducer.h, data_parallel.h) and the checkpoint's gather of expert shards (expert_parallel.h) need to know of
// each parameter. layers/param.h's ParamFactory makes one per parameter.
#pragma once
#include <cstdint>
#include <memory>

#include "engine/autograd.h"
#include "engine/fp8_weight.h"

namespace flowmoe {

// Expert weights are sharded along dim 0 (the expert) over the expert-parallel group; every other parameter is
// whole on every rank.
struct ParamShard {
  bool expert = false;    // an expert weight: its gradient is reduced over the expert-data-parallel group
  int64_t offset = 0;     // the full tensor's dim-0 row this rank's row 0 is
  int64_t full_rows = 0;  // the full tensor's dim 0 (== the local dim 0 when not sharded)
  // The forward reads the f32 values themselves, not a compute-dtype copy (a router's gate, which routes in
  // f32; FP8 expert weights, quantized from f32): training keeps these weights in f32 where it stores the others
  // in bf16 (precision.param_dtype).
  bool reads_f32 = false;
  // The FP8 copy the forward reads in place of the weight (engine/fp8_weight.h), which the optimizer writes; null
  // where the forward reads the weight itself.
  std::shared_ptr<Fp8WeightCopy> fp8 = nullptr;
  bool sharded(const Variable& p) const { return full_rows != p.size(0); }
};

}  // namespace flowmoe
