// The decoder-only transformer (DeepSeek-V3 layout; model.attention picks plain MHA or MLA, layers/mla.h):
//   h = embed(ids);  per block: h += attn(rmsnorm(h)); h += mlp(rmsnorm(h))  (the first += and the norm after it
//   one kernel, add_rmsnorm);
//   logits = rmsnorm(h) · W_headᵀ   (W_head = the embedding when tie_word_embeddings).
// Each residual add runs in the kernel of the norm that next reads h (add_rmsnorm): the first += with the block's
// post-attention norm, the second with the next block's input norm or, after the last block, the final norm (so a
// block hands on h and its MLP's output, Residual, and the add waits for that norm).
// Parameters are created as f32 weights named as Hugging Face does ("model.layers.0.self_attn.q_proj.weight").
// The forward computes in `compute` dtype: f32 on the CPU; bf16 on the GPU, where each f32 weight is cast per
// use (a bf16 one, which training may store, is read as it is) and its gradient returns to f32. Init is seeded
// and identical on every device. The MoE options' recipe also sets the other linears' precision: fp8_full runs
// the attention projections and dense MLPs in FP8 (MoeFlow::fp8_linears), their input norms writing the FP8
// inputs; the embedding, the norms' arithmetic and the head stay.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/ops/add_rmsnorm.h"
#include "layers/attention.h"
#include "layers/kv_cache.h"
#include "layers/mlp.h"
#include "layers/model_config.h"
#include "layers/moe.h"
#include "layers/moe_schedule.h"

namespace flowmoe {

class MtpModule;  // layers/mtp.h

// The residual stream between blocks, h + pending: a block leaves its last residual add pending so that the norm
// that reads the stream next does it in its own kernel. pending is undefined where nothing is pending (the embedding's
// output).
struct Residual {
  Variable h, pending;
  Variable sum() const;  // h + pending in a plain add, for a reader that is no norm (h alone if nothing is pending)
};

// The stream x normed by weight, as AddNormed: .h = x.sum(), .n = its norm (add_rmsnorm's arguments site and keep_y;
// rmsnorm, or rmsnorm_quantize with a site, where nothing is pending).
AddNormed norm_residual(const Residual& x, const Variable& weight, double eps, const std::string& site = "",
                        bool keep_y = true);

class TransformerBlock {
 public:
  // Layers from first_k_dense_replace on use an MoE block when n_routed_experts > 0.
  TransformerBlock(ParamFactory& f, const ModelConfig& cfg, int64_t layer_idx, const MoeOptions& moe, Device device);
  // x: the stream [B,T,H] with the previous block's add pending; -> this block's h and its MLP's (MoE layer's)
  // output, to add.
  Residual forward(const Residual& x, DType compute) const;
  // forward for one sequence with this layer's K/V cache at positions [pos, pos + T) (Attention::forward_cached).
  Residual forward_cached(const Residual& x /*[1,T,H]*/, DType compute, const Tensor& keys, const Tensor& values,
                          int64_t pos) const;
  MoeLayer* moe() const { return moe_.get(); }  // null for a dense block
  // forward in parts, for an MoE block whose caller interleaves two micro-batches (Transformer, dual_microbatch):
  // a = attention_half(x): a.h = x + attn(rmsnorm(x)) and a.n its post-attention norm; then moe_begin(a),
  // moe_experts and moe_finish(a.h): a.h and the MoE layer's output (moe_begin, moe_run_experts, moe_finish of
  // layers/moe_schedule.h).
  AddNormed attention_half(const Residual& x, DType compute) const;
  MoeInFlight moe_begin(const AddNormed& a, DType compute) const;
  void moe_experts(MoeInFlight& p) const;
  Residual moe_finish(const Variable& h, MoeInFlight& p) const;
  // train.recompute attention: attn(rmsnorm(x)) runs under checkpoint(), which keeps only x (the stream, added up
  // before it) and runs it again in backward (the same code, so the same bits).
  void set_recompute_attention(bool on) { recompute_attention_ = on; }
  // Off: the block adds its MLP's output itself and hands on nothing pending, the unfused arithmetic that the fused
  // one repeats bit for bit (the reference tests/test_fused_residual.cpp compares against). On by default.
  void set_fused_residual(bool on) { fused_residual_ = on; }

 private:
  AddNormed input_norm(const Residual& x, DType compute) const;         // x.sum() and rmsnorm(x.sum())
  Variable attention_branch(const AddNormed& in, DType compute) const;  // attn(in.n), in the input norm
  Residual hand_on(const Variable& h, const Variable& out) const;       // h + out, pending where fused

  double eps_;
  // fp8_full: a norm whose output feeds FP8 linears emits their FP8 input in its own kernel (rmsnorm_quantize),
  // counting the cast at the site where the layer would have quantized it.
  bool fp8_norms_ = false;
  bool recompute_attention_ = false;
  bool fused_residual_ = true;
  std::string scope_;  // "layers.<i>", the profiler's name for the block
  Variable input_layernorm_, post_attention_layernorm_;
  std::unique_ptr<AttentionLayer> self_attn_;  // Attention (mha) or LatentAttention (mla)
  std::unique_ptr<Mlp> mlp_;
  std::unique_ptr<MoeLayer> moe_;
};

class Transformer {
 public:
  // moe: the MoE layers' recipe, segment alignment and recompute (precision.*, train.recompute); an int
  // means the bf16 recipe with that align_size.
  Transformer(const ModelConfig& cfg, Device device, DType compute, uint64_t seed, const MoeOptions& moe = {});

  Variable forward(const Tensor& ids /*[B,T] i32*/) const;  // -> logits [B,T,V] in the compute dtype
  // Inference over a K/V cache (layers/kv_cache.h): ids [1,T] are the positions [cache.length, cache.length + T)
  // of one sequence, either its prompt (length 0, the same ops as forward) or one token after it; their keys
  // and values join the cache and length grows by T. -> logits [1,T,V]. Under NoGradGuard, on a model built with
  // the bf16 recipe (FP8 GEMMs take no single rows: ConfigError otherwise).
  Variable forward_cached(const Tensor& ids /*[1,T] i32*/, KvCache& cache) const;
  // The two terms of the training objective, kept apart so the language-model loss is reported alone.
  struct Losses {
    Variable lm;   // mean next-token cross-entropy, an f32 scalar
    Variable aux;  // sum over MoE layers of aux_loss_alpha * L_Bal; undefined when aux_loss_alpha == 0
    // Multi-token prediction (layers/mtp.h): (1/D) Σ_k CE_k, the mean over depths of each depth's mean
    // cross-entropy, unweighted; undefined without MTP modules. mtp_weight is λ (train.mtp_loss_weight).
    Variable mtp;
    double mtp_weight = 0;
    Variable total() const;  // lm + aux + mtp_weight * mtp: what training minimizes
  };
  // ids and targets [B,T] i32 (moved to the device). With dual micro-batches on and grad enabled (training),
  // the batch runs as two halves of B/2 sequences interleaved layer by layer: in each MoE layer both halves'
  // attention and dispatch, then both halves' experts, then both combines, so that one half's exchanges (on
  // the comm lane, engine/stream_lane.h) travel beside the other half's compute. lm is the mean of the halves'
  // (the same tokens: the batch's mean up to the order of the sums), each layer's aux term too.
  Losses losses(const Tensor& ids, const Tensor& targets) const;
  void set_dual_microbatch(bool on) { dual_microbatch_ = on; }  // parallel.dual_microbatch
  // λ of the MTP loss (train.mtp_loss_weight). The MTP modules run in losses() with grad enabled (training)
  // only: evaluation, forward and generation use the main model alone.
  void set_mtp_loss_weight(double w) { mtp_weight_ = w; }
  int64_t num_mtp_modules() const { return int64_t(mtp_.size()); }
  const MtpModule& mtp_module(int64_t k) const { return *mtp_.at(size_t(k - 1)); }  // k in [1, D]
  // The last block's output [B,T,H] before the final norm: h^0 of the MTP modules.
  Variable hidden(const Tensor& ids) const;
  void set_recompute_attention(bool on);  // train.recompute attention (TransformerBlock)
  void set_fused_residual(bool on);       // every block's (TransformerBlock::set_fused_residual)
  Variable loss(const Tensor& ids, const Tensor& targets) const { return losses(ids, targets).total(); }

  // State that is not trained but belongs to the model (the MoE expert biases); saved in checkpoints.
  const std::vector<Variable>& buffers() const { return buffers_; }
  // After an optimizer step: aux-loss-free bias update of every MoE layer at the step's scheduled rate
  // (MoeLayer::update_bias); returns each MoE layer's loads since the last call, in layer order, still on
  // the device (empty for a dense model).
  std::vector<Tensor> update_moe_bias(const StepScalars* control);
  // Every MoE layer's counts since the last update_moe_bias (MoeLayer::load_counts), in layer order (the MTP
  // modules' blocks after the model's).
  std::vector<Tensor> moe_load_counts() const;
  int64_t num_moe_layers() const;
  // Whether a training forward runs MoE exchanges beside compute (token chunks, or dual micro-batches):
  // parallel.exchange_sms then keeps SMs free for them.
  bool overlaps_exchanges() const;
  // Every MoE layer's zero-sync receive buffers (MoeLayer::set_exchange_buffers), and whether its MoE layers
  // exchange that way (MoeLayer::zero_sync; false without them).
  void set_exchange_buffers(double capacity_factor, int64_t min_rows, const Tensor& overflow);
  bool exchanges_zero_sync() const;

  const std::vector<Variable>& parameters() const { return params_; }  // fixed order
  // Where each parameter's rows sit in the full tensor, in parameters()' order: expert weights are
  // sharded over the expert-parallel group (MoeOptions::expert_parallel), the rest are whole.
  const std::vector<ParamShard>& parameter_shards() const { return shards_; }
  int64_t num_parameters() const;
  // The stage of the forward that first reads each parameter, in parameters()' order: 0 the embedding,
  // 1 + i layer i, num_hidden_layers + 1 the final norm and the head, num_hidden_layers + 1 + k MTP module k.
  // A stage hook, when set, is called
  // with each stage before the forward reads its weights: a sharded optimizer waits there for the
  // weights it is still gathering (parallel/grad_reducer.h), so the gather overlaps the earlier stages.
  const std::vector<int64_t>& parameter_stages() const { return stages_; }
  void set_stage_hook(std::function<void(int64_t)> hook) { stage_hook_ = std::move(hook); }
  const ModelConfig& config() const { return cfg_; }
  Device device() const { return device_; }
  DType compute_dtype() const { return compute_; }

 private:
  void check_ids(const Tensor& ids) const;
  void stage(int64_t s) const;
  Variable embed(const Tensor& ids) const;
  Residual stream(const Tensor& ids) const;  // the embedding through every block, the last add pending
  // The stream normed by the final norm's weight or an MTP module's (shared_head.norm), with its sum .h.
  AddNormed head_norm(const Residual& x, const Variable& norm) const;
  Variable head(const Variable& normed) const;  // the logits of normed rows
  // Training with MTP modules: lm and mtp of out (Losses), the embedding and the head each used once.
  void joint_losses(const Tensor& ids, const Tensor& targets, Losses& out) const;
  // The MTP term from h^0 [B,T,H], the main model's last hidden states (Losses::mtp); each depth its own
  // embedding and head (the dual micro-batches' halves).
  Variable mtp_loss(const Variable& h0, const Tensor& ids, const Tensor& targets) const;
  // The model's blocks, then the MTP modules' blocks.
  std::vector<TransformerBlock*> all_blocks() const;
  // The mean cross-entropy of logits [..., V] against targets [...] i32 (any device).
  Variable lm_loss(const Variable& logits, const Tensor& targets) const;
  Losses dual_losses(const Tensor& ids, const Tensor& targets) const;

  ModelConfig cfg_;
  Device device_;
  DType compute_;
  std::vector<Variable> params_, buffers_;
  std::vector<ParamShard> shards_;
  std::vector<int64_t> stages_;
  std::function<void(int64_t)> stage_hook_;
  bool dual_microbatch_ = false;
  MoeRecipe recipe_;
  bool comm_stream_;  // MoeOptions::exchange_comm_stream: the dual micro-batches' exchanges on the comm stream
  Variable embed_tokens_, norm_, lm_head_;
  std::vector<std::unique_ptr<TransformerBlock>> layers_;
  std::vector<std::shared_ptr<MtpModule>> mtp_;  // shared_ptr: MtpModule is incomplete here
  double mtp_weight_ = 0;
};

}  // namespace flowmoe
