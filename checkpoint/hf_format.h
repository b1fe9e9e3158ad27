// The Hugging Face form of a flowmoe model: transformers' glm4_moe (Glm4MoeForCausalLM), which is
// DeepSeek-V3's MoE (sigmoid group-limited router with e_score_correction_bias, shared experts,
// first_k_dense_replace, routed_scaling_factor, norm_topk_prob) with plain multi-head attention, for a model
// with model.attention mha; transformers' deepseek_v3 (DeepseekV3ForCausalLM), the same MoE with multi-head
// latent attention (layers/mla.h), for one with mla. The config.json fields, the tensor names and shapes, and the
// one layout difference (RoPE's pairs, below) are decided here, for `flowmoe export --format hf`,
// `flowmoe import --format hf` (checkpoint/hf_export.h) and checkpoint.init_from: hf:DIR alike.
//
// RoPE: flowmoe rotates the interleaved pairs (x[2i], x[2i+1]) of each head (kernels/rope.h), transformers'
// rotate_half the pairs (x[i], x[i + hd/2]), both at angle pos·theta^(-2i/hd). So the q_proj and k_proj rows
// of each head go to transformers in the order 0, 2, 4, ..., hd-2, 1, 3, ..., hd-1 (and back on import):
// the same permutation of q and k leaves every q·k, hence the attention, as it was. deepseek_v3 is written with
// rope_interleave true: transformers then rotates the interleaved pairs of q_pe and k_pe itself, so its
// q_b_proj (q_proj) and kv_a_proj_with_mqa rows keep flowmoe's order.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "engine/tensor.h"
#include "layers/model_config.h"

namespace flowmoe {

constexpr const char* kHfModelType = "glm4_moe";
constexpr const char* kHfArchitecture = "Glm4MoeForCausalLM";
constexpr const char* kHfMlaModelType = "deepseek_v3";
constexpr const char* kHfMlaArchitecture = "DeepseekV3ForCausalLM";
// The model type and architecture a model is exported as: glm4_moe for mha, deepseek_v3 for mla.
inline const char* hf_model_type(const ModelConfig& m) {
  return m.attention == AttentionType::mla ? kHfMlaModelType : kHfModelType;
}
inline const char* hf_architecture(const ModelConfig& m) {
  return m.attention == AttentionType::mla ? kHfMlaArchitecture : kHfArchitecture;
}
// The transformers release whose glm4_moe this mapping was checked against (tests/interop/check_hf_export.py,
// with the pin of scripts/install_interop_deps.sh).
constexpr const char* kHfTransformersVersion = "5.25.0";
constexpr const char* kHfConfigFile = "config.json";
constexpr const char* kHfModelFile = "model.safetensors";
constexpr const char* kHfIndexFile = "model.safetensors.index.json";  // a sharded folder's tensor -> file map
// The MTP layers' tensors (model.num_nextn_predict_layers > 0), apart from model.safetensors: transformers'
// glm4_moe has no MTP module and ignores on load only GLM-4.5's own MTP layer numbers (46 and 92), so in
// model.safetensors they would be reported as unexpected; it reads model.safetensors alone, while loaders that
// take every *.safetensors of a folder get them too.
constexpr const char* kHfMtpFile = "mtp.safetensors";
// The layer number of "model.layers.N.<...>", or -1; an MTP layer's is num_hidden_layers or more.
int64_t hf_layer_of(const std::string& name);

// Throws ConfigError naming the model.* key and its value when the model has no exact glm4_moe counterpart
// (a softmax router; groups of one expert, or one expert, which glm4_moe's top-2 group score cannot take).
void check_hf_exportable(const ModelConfig& m);
// The config.json of the model, as transformers writes one for it (check_hf_exportable first). A dense model
// (no routed experts) is a glm4_moe whose first_k_dense_replace covers every layer; top-1 routing with
// norm_topk_prob, which flowmoe (as DeepSeek-V3) does not normalise, is written as norm_topk_prob false.
std::string hf_config_json(const ModelConfig& m);
// The model of a config.json text read from `path`. ConfigError names the file and the field: a model_type
// other than glm4_moe or deepseek_v3 (rope_interleave false, yarn rope_scaling and their mscale refused), a field
// flowmoe does not map, or a value it has no counterpart for (grouped-query attention, a partial or scaled RoPE,
// attention biases, q/k norms, top-1 routing with norm_topk_prob, ...). A value out of a model.* key's range is refused
// as the config file would refuse it. Fields that change nothing in the model's math (dtype, use_cache, token ids) are
// passed over; num_nextn_predict_layers is taken (the MTP layers' tensors are then read, HfFolder).
ModelConfig model_config_from_hf(const std::string& json_text, const std::string& path,
                                 std::vector<std::string>* notes = nullptr);
// The MTP (next-token prediction) layers a config.json declares: glm4_moe's num_nextn_predict_layers.
int64_t hf_num_mtp_layers(const std::string& json_text, const std::string& path);

// Where a Hugging Face tensor's values sit in a flowmoe tensor.
enum class HfPart {
  whole,        // the same values
  rope_rows,    // q_proj, k_proj: each head's rows permuted (above)
  expert_gate,  // fc1 [E, 2F, H]: rows [0, F) of one expert
  expert_up,    // fc1: rows [F, 2F) of one expert
  expert_down,  // fc2 [E, H, F]: one expert
  empty,        // a tensor of transformers' module with no values (shared experts of width 0): no flowmoe tensor
};
struct HfTensor {
  std::string name;  // "model.layers.1.mlp.experts.3.gate_proj.weight"
  Shape shape;
  HfPart part = HfPart::whole;
  int64_t expert = 0;
};
// One tensor of a flowmoe checkpoint and the Hugging Face tensors that hold its values, in the order written.
struct HfTensorGroup {
  std::string name;  // "" for the empty HF tensors that have no flowmoe tensor
  Shape shape;
  bool buffer = false;  // a model buffer (e_score_correction_bias), not a parameter
  std::vector<HfTensor> hf;
};
// Every tensor of the model's checkpoint (its parameters in creation order, then its buffers), each with its
// Hugging Face tensors, then the empty HF tensors (tests/test_hf_format.cpp checks the names and shapes
// against the Transformer's own).
std::vector<HfTensorGroup> hf_tensor_plan(const ModelConfig& m);

// HF tensor `t` cut from its flowmoe tensor `src` (f32, the group's shape).
Tensor hf_tensor_from(const Tensor& src, const HfTensor& t, const ModelConfig& m);
// Writes HF tensor `t`'s values (f32, t.shape) into their place in flowmoe tensor `dst`. expert_offset: the
// expert of dst's row 0 (an expert-parallel shard holds rows [offset, offset + rows) of the full tensor).
void hf_tensor_into(Tensor& dst, const Tensor& hf, const HfTensor& t, const ModelConfig& m, int64_t expert_offset = 0);

}  // namespace flowmoe
