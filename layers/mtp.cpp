#include "layers/mtp.h"

namespace flowmoe {

MtpModule::MtpModule(ParamFactory& f, const ModelConfig& c, int64_t k, const MoeOptions& moe, Device device)
    : eps_(c.rms_norm_eps) {
  const int64_t idx = mtp_layer_index(c, k);
  const std::string prefix = "model.layers." + std::to_string(idx);
  enorm_ = f.ones(prefix + ".enorm.weight", {c.hidden_size});
  hnorm_ = f.ones(prefix + ".hnorm.weight", {c.hidden_size});
  eh_proj_ = f.normal(prefix + ".eh_proj.weight", {c.hidden_size, 2 * c.hidden_size}, c.initializer_range);
  block_ = std::make_unique<TransformerBlock>(f, c, idx, moe, device);
  head_norm_ = f.ones(prefix + ".shared_head.norm.weight", {c.hidden_size});
}

// DeepSeek-V3's order: the embedding's half first (enorm), then the hidden state's (hnorm).
Residual MtpModule::forward(const Variable& h_prev, const Variable& emb_ahead, DType compute) const {
  const Variable e = rmsnorm(emb_ahead, compute_weight(enorm_, compute), eps_);
  const Variable h = rmsnorm(h_prev, compute_weight(hnorm_, compute), eps_);
  return block_->forward({linear(concat_last(e, h), compute_weight(eh_proj_, compute)), Variable()}, compute);
}

}  // namespace flowmoe
