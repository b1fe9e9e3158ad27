// The model's shape and MoE keys as the layers read them, under the Hugging Face DeepSeek-V3 names
// (DESIGN.md §5). The run configuration's model: section (config/config.h) fills it from YAML; the
// cross-key checks of routing keys call validate_router_config (engine/ops/router.h) on the same values.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "kernels/attention_cudnn.h"
#include "kernels/common/name_table.h"
#include "kernels/router.h"  // RouterScoring, BiasUpdateRule

namespace flowmoe {

// The deepest multi-token prediction the config takes (DeepSeek-V3 trains with 1).
constexpr int64_t kMaxMtpDepth = 16;

// The attention block: plain multi-head attention (layers/attention.h) or DeepSeek-V3's multi-head latent
// attention (layers/mla.h). Parsed once from model.attention.
enum class AttentionType { mha, mla };
inline constexpr EnumName<AttentionType> kAttentionTypeNames[] = {{AttentionType::mha, "mha"},
                                                                  {AttentionType::mla, "mla"}};

// model.bias_update_schedule: constant moves expert_bias by bias_update_rate every step; lr scales that step with
// lr(step) / optimizer.lr.
enum class BiasUpdateSchedule { constant, lr };
inline constexpr EnumName<BiasUpdateSchedule> kBiasUpdateScheduleNames[] = {{BiasUpdateSchedule::constant, "constant"},
                                                                            {BiasUpdateSchedule::lr, "lr"}};

struct ModelConfig {
  int64_t vocab_size = 256;
  int64_t hidden_size = 128;  // H, the residual stream's width
  int64_t num_hidden_layers = 2;
  int64_t num_attention_heads = 4;        // each head H / heads wide
  int64_t intermediate_size = 384;        // the dense MLP's width
  int64_t max_position_embeddings = 128;  // the longest sequence the model takes
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  // MoE (DeepSeek-V3 names). n_routed_experts = 0 builds a dense model; with experts, the layers from
  // first_k_dense_replace on are MoE layers (layers/transformer.h).
  int64_t n_routed_experts = 0;  // E
  int64_t n_shared_experts = 1;
  int64_t num_experts_per_tok = 2;      // k, the routed experts each token takes
  int64_t moe_intermediate_size = 256;  // F, each expert's width (a shared expert's too)
  int64_t first_k_dense_replace = 0;
  int64_t n_group = 1;                                  // group-limited routing: E in n_group groups,
  int64_t topk_group = 1;                               // of which each token picks from the best topk_group
  RouterScoring scoring_func = RouterScoring::sigmoid;  // names: engine/ops/router.h kRouterScoringNames
  bool norm_topk_prob = true;
  double routed_scaling_factor = 1.0;
  double aux_loss_alpha = 0.0;
  double bias_update_rate = 0.001;
  BiasUpdateSchedule bias_update_schedule = BiasUpdateSchedule::constant;
  BiasUpdateRule bias_update_rule = BiasUpdateRule::sign;  // sign (DeepSeek-V3) | proportional to the load error
  // Attention. mha: num_attention_heads heads of H / heads. mla (DeepSeek-V3's keys): queries through a
  // q_lora_rank bottleneck (0, null in YAML and config.json: one direct projection), keys and values from one
  // kv_lora_rank latent per token; each head's query and key are qk_nope_head_dim + qk_rope_head_dim wide (the
  // rope part of the key one per token, shared by the heads), its value v_head_dim.
  AttentionType attention = AttentionType::mha;
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 64;
  int64_t qk_nope_head_dim = 32;
  int64_t qk_rope_head_dim = 16;
  int64_t v_head_dim = 32;
  // The attention core's GPU kernels (kernels/attention_cudnn.h): auto (cuDNN where the build has it and it takes
  // the shape, else flash), flash or cudnn.
  AttentionBackend attention_kernel = AttentionBackend::automatic;
  // Multi-token prediction depth D (layers/mtp.h): modules after the main model, trained to predict the tokens
  // 2..D+1 ahead; 0 builds none. The name transformers' deepseek_v3 and glm4_moe configs use.
  int64_t num_nextn_predict_layers = 0;
};

// Each head's query/key width and value width: H / heads under mha.
inline int64_t attention_qk_head_dim(const ModelConfig& c) {
  return c.attention == AttentionType::mla ? c.qk_nope_head_dim + c.qk_rope_head_dim
                                           : c.hidden_size / c.num_attention_heads;
}
inline int64_t attention_v_head_dim(const ModelConfig& c) {
  return c.attention == AttentionType::mla ? c.v_head_dim : c.hidden_size / c.num_attention_heads;
}

// The init std of the output projections (attention's o_proj, an MLP's or expert's down projection): smaller than
// initializer_range so the residual stream's variance does not grow with depth.
inline double output_init_std(const ModelConfig& c) {
  return c.initializer_range / std::sqrt(2.0 * double(c.num_hidden_layers));
}

// Whether block i is an MoE layer: with routed experts, from first_k_dense_replace on; the others are dense.
// An MTP module's block (i >= num_hidden_layers) is the kind of the model's last block.
inline bool is_moe_layer(const ModelConfig& c, int64_t i) {
  return c.n_routed_experts > 0 && std::min(i, c.num_hidden_layers - 1) >= c.first_k_dense_replace;
}
// The MTP modules' MoE blocks: all D of them when the model's last block is MoE, else none.
inline int64_t num_mtp_moe_layers(const ModelConfig& c) {
  return c.num_nextn_predict_layers > 0 && is_moe_layer(c, c.num_hidden_layers) ? c.num_nextn_predict_layers : 0;
}
// The layer number of MTP module k (1..num_nextn_predict_layers), as DeepSeek-V3's checkpoints number it.
inline int64_t mtp_layer_index(const ModelConfig& c, int64_t k) { return c.num_hidden_layers + k - 1; }
inline int64_t num_moe_layers(const ModelConfig& c) {
  return c.n_routed_experts > 0 ? std::max<int64_t>(0, c.num_hidden_layers - c.first_k_dense_replace) : 0;
}

}  // namespace flowmoe
