// The training losses with multi-token prediction (Transformer::joint_losses, Transformer::mtp_loss), beside
// layers/transformer.cpp, which runs the main model.
#include "engine/profiler.h"
#include "layers/mtp.h"
#include "layers/transformer.h"

namespace flowmoe {

namespace {

// x [B,T] i32 moved k positions left along T, the last k filled with `pad`, on x's device: through the
// transpose, so that each copy is of whole rows (copy_ writes contiguous tensors only).
Tensor shift_left(const Tensor& x, int64_t k, int32_t pad) {
  const int64_t B = x.size(0), T = x.size(1);
  const Tensor xt = x.transpose(0, 1).contiguous();  // [T,B]
  Tensor out = Tensor::empty({T, B}, DType::i32, x.device());
  out.fill_(pad);
  if (k < T) out.slice(0, 0, T - k).copy_(xt.slice(0, k, T));
  return out.transpose(0, 1).contiguous();
}

}  // namespace

// The model and its MTP modules with one embedding op over [ids; ids shifted 1; ...; shifted D] and one head GEMM
// over every depth's normed rows: the embedding and the head then each get one gradient per backward, so that
// micro-batches accumulate them as ranks sum them (data parallelism repeats gradient accumulation bit for bit).
void Transformer::joint_losses(const Tensor& ids, const Tensor& targets, Losses& out) const {
  check_ids(ids);
  const int64_t B = ids.size(0), T = ids.size(1), D = int64_t(mtp_.size());
  const Tensor dev_ids = ids.contiguous().to(device_), dev_targets = targets.contiguous().to(device_);
  Tensor all_ids = Tensor::empty({(D + 1) * B, T}, DType::i32, device_);
  std::vector<int64_t> bounds = {0};
  for (int64_t k = 0; k <= D; ++k) {
    all_ids.slice(0, k * B, (k + 1) * B).copy_(k == 0 ? dev_ids : shift_left(dev_ids, k, 0));
    bounds.push_back((k + 1) * B);
  }
  stage(0);
  const std::vector<Variable> emb = split_rows(embed(all_ids), bounds);
  Residual x{emb[0], Variable()};
  for (size_t i = 0; i < layers_.size(); ++i) {
    stage(int64_t(i) + 1);
    x = layers_[i]->forward(x, compute_);
  }
  stage(cfg_.num_hidden_layers + 1);
  AddNormed h = head_norm(x, norm_);  // its stream, h^0 of the MTP modules, and the normed rows
  std::vector<Variable> normed = {h.n.y};
  for (int64_t k = 1; k <= D; ++k) {
    stage(cfg_.num_hidden_layers + 1 + k);
    h = head_norm(mtp_[size_t(k - 1)]->forward(h.h, emb[size_t(k)], compute_), mtp_[size_t(k - 1)]->head_norm());
    normed.push_back(h.n.y);
  }
  ProfileScope scope("head");
  const std::vector<Variable> logits =
      split_rows(linear(concat_rows(normed), compute_weight(lm_head_, compute_)), bounds);
  out.lm = lm_loss(logits[0], dev_targets);
  Variable sum;
  for (int64_t k = 1; k <= D; ++k) {
    const Variable ce = lm_loss(logits[size_t(k)], shift_left(dev_targets, k, -100));
    sum = sum.defined() ? add(sum, ce) : ce;
  }
  out.mtp = scale(sum, 1.0 / double(D));
  out.mtp_weight = mtp_weight_;
}

// Depth k's input at position i is the embedding of ids[i + k] and its target targets[i + k] (= t_{i+k+1});
// the last k positions have neither: their embedding input is token 0 and their target is ignored. Attention
// is causal, so those tail positions change no other position's output (an MoE block routes them too:
// they count in its expert loads and balance loss).
Variable Transformer::mtp_loss(const Variable& h0, const Tensor& ids, const Tensor& targets) const {
  const Tensor dev_ids = ids.contiguous().to(device_), dev_targets = targets.contiguous().to(device_);
  Variable h = h0, sum;
  for (size_t j = 0; j < mtp_.size(); ++j) {
    const int64_t k = int64_t(j) + 1;
    stage(cfg_.num_hidden_layers + 1 + k);
    const Variable emb = embed(shift_left(dev_ids, k, 0));
    const AddNormed hk = head_norm(mtp_[j]->forward(h, emb, compute_), mtp_[j]->head_norm());
    h = hk.h;
    const Variable ce = lm_loss(head(hk.n.y), shift_left(dev_targets, k, -100));
    sum = sum.defined() ? add(sum, ce) : ce;
  }
  return scale(sum, 1.0 / double(mtp_.size()));
}

}  // namespace flowmoe
