// The FP8 copies of the weights the FP8 GEMMs read (128x128 blocks and their exact transpose, DESIGN.md §3), one per
// parameter version. AdamW writes them (kernels/adamw_fp8.h) from the weights it updates, in the same kernel, once
// per optimizer step, and marks them current for the version it moves the weight to; the forward then reads them as
// they are. Otherwise (the first forward, a checkpoint load, a sharded optimizer whose all-gather moves the weights)
// the version has moved without a copy, and the next forward quantizes once (a weight_quantize). The routed
// experts' fc1 and fc2 (fp8_blockwise, fp8_flow, fp8_full) and, under fp8_full, every attention projection, dense
// MLP and shared expert weight (fp8_linear) keep one each; ParamShard::fp8 hands it to the optimizer.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "engine/ops/fp8_linear.h"
#include "engine/ops/ops.h"
#include "engine/ops/quantize.h"

namespace flowmoe {

// The FP8 copy of one weight and the weight and version it holds, shared by the layer that reads it and the
// optimizer that writes it.
struct Fp8WeightCopy {
  QuantizedWeight wq;
  uint64_t version = 0;
  const VariableImpl* of = nullptr;  // the weight wq was made from (compared, never read)
  // Its buffers are written in place by others (AdamW's update, a sharded all-gather), whose pointers (and a
  // captured step's) must stay valid: a forward's quantize is stored into them. Otherwise it takes their place.
  bool held = false;
  // Whether wq keeps the exact transpose dgrad reads (precision.fp8_weight_transpose: stored); without it wq.q_t
  // is undefined and the backward rebuilds it (weight_transpose). Set before the first quantize.
  bool keeps_transpose = true;

  bool current_for(const Variable& w) const { return wq.q.defined() && version == w.version() && of == w.impl(); }
  void mark_current(const Variable& w) {
    version = w.version();
    of = w.impl();
  }
};

// A fresh quantize of a weight into its copy: written into the copy's buffers where they are held (and fit), so
// the buffers a captured step (train.cuda_graph) reads and AdamW writes stay where they are; else it replaces them,
// which costs no copy.
void store_fp8_weight(Fp8WeightCopy& copy, const QuantizedWeight& fresh);

class Fp8WeightCache {
 public:
  // w [E, N, K] (routed experts, quantize_weight) or [N, K] (a dense linear, as one group:
  // quantize_linear_weight). Counted as a weight_quantize at w's name when it quantizes.
  const QuantizedWeight& get(const Variable& w) const {
    // set_data and in-place updates bump the version; another weight (a cache handed the wrong one) is stale too.
    if (!copy_->current_for(w)) {
      const bool t = copy_->keeps_transpose;
      store_fp8_weight(*copy_, w.data().dim() == 2 ? quantize_linear_weight(w.data(), w.name(), t)
                                                   : quantize_weight(w.data(), w.name(), t));
      copy_->mark_current(w);
    }
    return copy_->wq;
  }
  const std::shared_ptr<Fp8WeightCopy>& copy() const { return copy_; }

 private:
  std::shared_ptr<Fp8WeightCopy> copy_ = std::make_shared<Fp8WeightCopy>();
};

// A dense FP8 linear, weight w [N, K] with its cache: y [M, N] = xq · wᵀ (fp8_linear) in the compute dtype
// (the GEMM writes bf16 on a GPU; a GPU model computing in f32 gets a cast).
inline Variable cached_fp8_linear(const Variable& xq, const Variable& w, const Fp8WeightCache& cache,
                                  const std::string& site, DType compute) {
  const Variable y = fp8_linear(xq, w, cache.get(w), site);
  return y.dtype() == compute ? y : cast(y, compute);
}

}  // namespace flowmoe
