// Storing a fresh quantize into a weight's FP8 copy (see fp8_weight.h).
#include "engine/fp8_weight.h"

namespace flowmoe {

void store_fp8_weight(Fp8WeightCopy& copy, const QuantizedWeight& fresh) {
  QuantizedWeight& into = copy.wq;
  // Both absent (a copy without its transpose) fits too.
  const auto fits = [](const Tensor& a, const Tensor& b) {
    if (!a.defined() || !b.defined()) return a.defined() == b.defined();
    return a.shape() == b.shape() && a.device() == b.device() && a.fp8_scales() &&
           a.fp8_scales()->scale_inv.shape() == b.fp8_scales()->scale_inv.shape();
  };
  if (!copy.held || !into.q.defined() || !fits(into.q, fresh.q) || !fits(into.q_t, fresh.q_t)) {
    into = fresh;
    return;
  }
  for (const auto& [dst, src] : {std::pair{into.q, fresh.q}, std::pair{into.q_t, fresh.q_t}}) {
    if (!dst.defined()) continue;
    Tensor data = dst, scales = dst.fp8_scales()->scale_inv;  // handles on the stored buffers
    data.copy_(src);
    scales.copy_(src.fp8_scales()->scale_inv);
  }
}

}  // namespace flowmoe
