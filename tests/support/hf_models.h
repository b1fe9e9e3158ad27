// What the Hugging Face export and import tests share: the models they cover and a checkpoint of one.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "layers/transformer.h"
#include "tests/support/checks.h"
#include "tests/support/mla_config.h"

namespace flowmoe::test {

// DeepSeek-V3's shape in small: a dense first layer, one shared expert, 8 experts in 2 groups of which each
// token keeps 1, top-2 with a routed scale; 4 heads of 8 (RoPE's pairs within each head matter).
inline ModelConfig hf_moe_model() {
  ModelConfig m;
  m.vocab_size = 96;
  m.hidden_size = 32;
  m.num_hidden_layers = 3;
  m.num_attention_heads = 4;
  m.intermediate_size = 48;
  m.max_position_embeddings = 32;
  m.rope_theta = 5000.0;
  m.n_routed_experts = 8;
  m.n_shared_experts = 1;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 16;
  m.first_k_dense_replace = 1;
  m.n_group = 2;
  m.topk_group = 1;
  m.routed_scaling_factor = 2.5;
  return m;
}

// A dense model with tied embeddings (no router: glm4_moe with every layer dense).
inline ModelConfig hf_dense_model() {
  ModelConfig m = hf_moe_model();
  m.n_routed_experts = 0;
  m.first_k_dense_replace = 0;
  m.tie_word_embeddings = true;
  return m;
}

// MoE from the first layer, no shared experts (transformers' module then has empty ones), top-1.
inline ModelConfig hf_moe_unshared_model() {
  ModelConfig m = hf_moe_model();
  m.n_shared_experts = 0;
  m.first_k_dense_replace = 0;
  m.num_experts_per_tok = 1;
  m.n_group = 1;
  return m;
}

// hf_moe_model() with multi-head latent attention (transformers' deepseek_v3), an MTP module, and query, key
// and value heads of three widths; q_lora_rank 0 takes the direct q_proj.
inline ModelConfig hf_mla_model(int64_t q_lora_rank = 12) {
  ModelConfig m = with_mla(
      hf_moe_model(),
      {.q_lora_rank = q_lora_rank, .kv_lora_rank = 10, .qk_nope_head_dim = 6, .qk_rope_head_dim = 4, .v_head_dim = 5});
  m.num_nextn_predict_layers = 1;
  return m;
}

// A run config of model m that trains on the CPU, writing into out_dir.
inline Config hf_run_config(const ModelConfig& m, const std::filesystem::path& out_dir) {
  Config c = parse_config(
      "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.0}\n"
      "train: {device: cpu, steps: 2, batch_size: 2, eval_every: 0}\n"
      "optimizer: {lr: 0.01, warmup_steps: 1}\n"
      "logging: {progress: plain}\n",
      "hf_test.yaml");
  c.model = m;
  c.logging.out_dir = out_dir.string();
  validate(c);
  return c;
}

// A checkpoint of step 3 of cfg's model at <root>/step_00000003 with seeded weights and expert biases that are
// not zero (a trained model's), as a run saves it; returns its folder.
inline std::string hf_test_checkpoint(const Config& cfg, const std::string& root, uint64_t seed = 7) {
  Transformer model(cfg.model, Device::cpu(), DType::f32, seed);
  Rng rng(seed + 1);
  for (const Variable& b : model.buffers()) {
    Tensor values = b.data();  // the buffer's storage
    values.copy_(random_tensor(rng, b.shape(), DType::f32));
  }
  std::vector<Tensor> m1, m2;
  for (const Variable& p : model.parameters()) {
    m1.push_back(Tensor::zeros(p.shape(), DType::f32));
    m2.push_back(Tensor::zeros(p.shape(), DType::f32));
  }
  CheckpointMeta meta;
  meta.step = meta.num_updates = 3;
  meta.config_yaml = to_yaml(cfg);
  return save_checkpoint(root, meta, model.parameters(), m1, m2, 3, model.buffers());
}

}  // namespace flowmoe::test
