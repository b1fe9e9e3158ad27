// The DeepSeek-style MoE block (DESIGN.md §2), BF16 recipe:
//   x [T,H] ─ router (fp32 logits, group-limited top-k on score + expert_bias) → topk_idx, topk_prob
//           ─ permute+pad (expert-major, segments aligned to align_size)
//           ─ fc1 GroupedLinear [M,H]→[M,2F] ─ SwiGLU → [M,F] ─ fc2 GroupedLinear → [M,H]
//           ─ unpermute+unpad, weighted by topk_prob (fp32 accumulate)          → y [T,H]
//           + shared experts: a dense SwiGLU MLP of width n_shared_experts·F on x.
// The layer reads the per-expert counts to the host once per forward (read_counts_once): cuBLASLt
// needs each expert's M. expert_bias is a buffer, not a parameter: after each optimizer step
// update_bias() moves it by ±bias_update_rate toward the mean load (aux-loss-free balancing).
// Parameters (HF names): <prefix>.gate.weight [E,H], <prefix>.experts.fc1.weight [E,2F,H] (gate rows
// first, then up), <prefix>.experts.fc2.weight [E,H,F], <prefix>.shared_experts.{gate,up,down}_proj.
#pragma once
#include <memory>
#include <string>

#include "engine/ops/router.h"
#include "engine/train/config.h"
#include "layers/mlp.h"

namespace flowmoe {

class MoeLayer {
 public:
  MoeLayer(ParamFactory& f, const ModelConfig& cfg, const std::string& prefix, int align_size, Device device);
  Variable forward(const Variable& x /*[..., H]*/, DType compute) const;  // -> [..., H]

  // The balance loss of the last forward (undefined when aux_loss_alpha == 0).
  const Variable& aux_loss() const { return aux_loss_; }
  // After an optimizer step: move expert_bias toward balance using the counts of every forward
  // since the last call, and return their load statistics (reads the counts: one host sync).
  LoadStats update_bias();
  // Named <prefix>.gate.e_score_correction_bias (as HF); no gradient, saved in checkpoints.
  const Variable& expert_bias() const { return expert_bias_; }

 private:
  RouterConfig router_;
  int64_t num_experts_, intermediate_;
  int align_size_;
  double bias_update_rate_;
  Variable gate_, fc1_, fc2_;
  std::unique_ptr<Mlp> shared_;
  Variable expert_bias_;                // [E] f32, on the layer's device; requires no grad
  mutable Tensor tokens_since_update_;  // [E] i32: counts summed over forwards since update_bias()
  mutable Variable aux_loss_;
};

// RouterConfig from the model config's HF keys.
RouterConfig router_config(const ModelConfig& cfg);

}  // namespace flowmoe
