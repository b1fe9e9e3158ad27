// DeepSeek-V3's multi-token prediction modules (DeepSeek-V3 technical report §2.2), model.num_nextn_predict_layers
// of them after the main model. Module k (k = 1..D) reads the previous depth's hidden states h^{k-1} (h^0 the
// main model's last block's output, before the final norm) and the embeddings of the tokens k positions ahead:
//   h'_i = eh_proj [hnorm(h^{k-1}_i); enorm(Emb(t_{i+k}))]     (eh_proj [H, 2H])
//   h^k  = TRM_k(h')                                            (one block, the kind of the model's last block)
//   logits^k = shared_head.norm(h^k) · W_headᵀ                  (the embedding and the head shared with the model)
// and position i of depth k predicts t_{i+k+1}. Names as DeepSeek-V3's checkpoints give them: module k is
// model.layers.{num_hidden_layers + k - 1}, with enorm, hnorm, eh_proj, shared_head.norm and the block's own
// names (self_attn, mlp, input_layernorm, post_attention_layernorm). DeepSeek-V3's inference code gives each
// module its own shared_head.norm and shares embed_tokens and shared_head.head with the main model; so here.
#pragma once
#include <memory>

#include "layers/transformer.h"

namespace flowmoe {

class MtpModule {
 public:
  // depth k in [1, num_nextn_predict_layers]; parameters are created in this order: enorm, hnorm, eh_proj,
  // the block, shared_head.norm.
  MtpModule(ParamFactory& f, const ModelConfig& cfg, int64_t depth, const MoeOptions& moe, Device device);
  // h^k from h^{k-1} [B,T,H] and the embeddings of the tokens k ahead [B,T,H] (compute dtype), its block's last
  // residual add pending (Residual: the head norm does it).
  Residual forward(const Variable& h_prev, const Variable& emb_ahead, DType compute) const;
  const Variable& head_norm() const { return head_norm_; }  // shared_head.norm.weight
  TransformerBlock& block() const { return *block_; }

 private:
  double eps_;
  Variable enorm_, hnorm_, eh_proj_, head_norm_;
  std::unique_ptr<TransformerBlock> block_;
};

}  // namespace flowmoe
