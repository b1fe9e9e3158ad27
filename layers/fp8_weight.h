// The FP8 copies of the weights the FP8 GEMMs read (128x128 blocks and their exact transpose, DESIGN.md §3),
// made once per parameter version: the optimizer, a checkpoint load and a replayed CUDA graph move the version
// (Variable::bump_version), so a forward after them quantizes again and every other forward reuses the copy.
// The routed experts' fc1 and fc2 (fp8_blockwise, fp8_flow, fp8_full) and, under fp8_full, every attention
// projection, dense MLP and shared expert weight (fp8_linear) keep one each.
#pragma once
#include <cstdint>
#include <string>

#include "engine/ops/fp8_linear.h"
#include "engine/ops/ops.h"
#include "engine/ops/quantize.h"

namespace flowmoe {

class Fp8WeightCache {
 public:
  // w [E, N, K] (routed experts, quantize_weight) or [N, K] (a dense linear, as one group:
  // quantize_linear_weight). Counted as a weight_quantize at w's name when it quantizes.
  const QuantizedWeight& get(const Variable& w) const {
    // set_data and in-place updates bump the version; another weight (a cache handed the wrong one) is stale too.
    if (!wq_.q.defined() || version_ != w.version() || of_ != w.impl()) {
      wq_ = w.data().dim() == 2 ? quantize_linear_weight(w.data(), w.name()) : quantize_weight(w.data(), w.name());
      version_ = w.version();
      of_ = w.impl();
    }
    return wq_;
  }

 private:
  mutable QuantizedWeight wq_;
  mutable uint64_t version_ = 0;
  mutable const VariableImpl* of_ = nullptr;  // the weight wq_ was quantized from (compared, never read)
};

// A dense FP8 linear, weight w [N, K] with its cache: y [M, N] = xq · wᵀ (fp8_linear) in the compute dtype
// (the GEMM writes bf16 on a GPU; a GPU model computing in f32 gets a cast).
inline Variable cached_fp8_linear(const Variable& xq, const Variable& w, const Fp8WeightCache& cache,
                                  const std::string& site, DType compute) {
  const Variable y = fp8_linear(xq, w, cache.get(w), site);
  return y.dtype() == compute ? y : cast(y, compute);
}

}  // namespace flowmoe
