// config.json read as a flowmoe model (see hf_format.h): what maps, what is checked, what is refused.
#include <algorithm>

#include "checkpoint/hf_format.h"
#include "config/config.h"
#include "config/config_schema.h"
#include "io/json.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace {

// config.json fields that are model.* keys of the same name and meaning.
const char* const kSameFields[] = {"vocab_size",
                                   "hidden_size",
                                   "num_hidden_layers",
                                   "num_attention_heads",
                                   "intermediate_size",
                                   "max_position_embeddings",
                                   "rms_norm_eps",
                                   "tie_word_embeddings",
                                   "initializer_range",
                                   "n_routed_experts",
                                   "n_shared_experts",
                                   "num_experts_per_tok",
                                   "moe_intermediate_size",
                                   "first_k_dense_replace",
                                   "n_group",
                                   "topk_group",
                                   "norm_topk_prob",
                                   "routed_scaling_factor"};
// Fields that change nothing in the model's math (or are checked elsewhere: MTP layers are left out).
const char* const kPassedOver[] = {"architectures",
                                   "transformers_version",
                                   "dtype",
                                   "torch_dtype",
                                   "use_cache",
                                   "output_router_logits",
                                   "bos_token_id",
                                   "eos_token_id",
                                   "pad_token_id",
                                   "router_aux_loss_coef",
                                   "_name_or_path",
                                   "output_attentions",
                                   "output_hidden_states",
                                   "return_dict",
                                   "num_nextn_predict_layers",
                                   "num_mtp_layers"};
// deepseek_v3's multi-head latent attention: model.* keys of the same name (q_lora_rank null: a direct q_proj).
const char* const kMlaFields[] = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"};
// deepseek_v3 fields that change nothing in the model's math, or are checked below.
const char* const kMlaPassedOver[] = {"pretraining_tp", "rope_interleave", "qk_head_dim"};
// Fields checked for the one value flowmoe's model has, handled below.
const char* const kChecked[] = {"model_type",     "hidden_act",        "num_key_value_heads",  "head_dim",
                                "attention_bias", "attention_dropout", "use_qk_norm",          "rope_parameters",
                                "rope_scaling",   "rope_theta",        "partial_rotary_factor"};

bool listed(const std::string& s, const auto& list) {
  return std::find_if(std::begin(list), std::end(list), [&](const char* f) { return s == f; }) != std::end(list);
}

bool is_null(const YAML::Node& n) { return !n || n.IsNull(); }

std::string scalar_text(const YAML::Node& n) { return n.IsScalar() ? n.Scalar() : (n.IsMap() ? "{...}" : "[...]"); }

struct HfConfigReader {
  const YAML::Node& j;
  const std::string& path;

  [[noreturn]] void refuse(const std::string& field, const std::string& why) const {
    FLOWMOE_THROW(ConfigError, "'", path, "': ", field, ": ", why);
  }
  double number(const YAML::Node& n, const std::string& field) const {
    double v = 0;
    if (!n.IsScalar() || !YAML::convert<double>::decode(n, v))
      refuse(field, "expected a number, got " + scalar_text(n));
    return v;
  }
  // A field that must hold `want` (or be absent where `absent_ok`).
  void require(const std::string& field, const std::string& want, bool absent_ok, const std::string& why) const {
    const YAML::Node n = j[field];
    if (is_null(n) && absent_ok) return;
    if (is_null(n) || !n.IsScalar() || n.Scalar() != want)
      refuse(field, (is_null(n) ? std::string("absent") : scalar_text(n)) + " is not supported: flowmoe needs " + want +
                        " (" + why + ")");
  }
  // RoPE: a non-nested parameter dict (rope_scaling, as transformers reads it, wins over rope_parameters),
  // falling back to the top-level rope_theta and partial_rotary_factor of older config.json files.
  // mla: deepseek_v3 rotates qk_rope_head_dim dims of each head, so an absent partial_rotary_factor is fine.
  double rope_theta(bool mla) const {
    YAML::Node rope = !is_null(j["rope_scaling"]) ? j["rope_scaling"] : j["rope_parameters"];
    const std::string where = !is_null(j["rope_scaling"]) ? "rope_scaling" : "rope_parameters";
    if (!is_null(rope) && !rope.IsMap()) refuse(where, "expected an object, got " + scalar_text(rope));
    if (is_null(rope)) rope = YAML::Node(YAML::NodeType::Map);
    for (auto it = rope.begin(); it != rope.end(); ++it) {
      const std::string k = it->first.Scalar();
      if (k != "rope_type" && k != "type" && k != "rope_theta" && k != "partial_rotary_factor")
        refuse(where + "." + k, "not supported: flowmoe's RoPE is the default one, over every dim of each head");
    }
    const YAML::Node type = !is_null(rope["rope_type"]) ? rope["rope_type"] : rope["type"];
    if (!is_null(type) && (!type.IsScalar() || type.Scalar() != "default"))
      refuse(where + ".rope_type", scalar_text(type) + " is not supported: flowmoe's RoPE is the default one");
    const YAML::Node theta = !is_null(rope["rope_theta"]) ? rope["rope_theta"] : j["rope_theta"];
    if (is_null(theta)) refuse(where + ".rope_theta", "absent (no RoPE base given)");
    const YAML::Node factor =
        !is_null(rope["partial_rotary_factor"]) ? rope["partial_rotary_factor"] : j["partial_rotary_factor"];
    // Absent, glm4_moe takes 0.5: only half of each head's dims rotate.
    if (mla && is_null(factor)) return number(theta, "rope_theta");
    if (is_null(factor) || number(factor, "partial_rotary_factor") != 1.0)
      refuse(where + ".partial_rotary_factor",
             (is_null(factor) ? std::string("absent (glm4_moe then rotates half of each head)") : scalar_text(factor)) +
                 " is not supported: flowmoe rotates every dim of each head (1.0)");
    return number(theta, "rope_theta");
  }
};

}  // namespace

int64_t hf_num_mtp_layers(const std::string& json_text, const std::string& path) {
  const YAML::Node j = parse_json(json_text, "'" + path + "'");
  for (const char* f : {"num_nextn_predict_layers", "num_mtp_layers"})
    if (j.IsMap() && !is_null(j[f]) && j[f].IsScalar()) return j[f].as<int64_t>(0);
  return 0;
}

ModelConfig model_config_from_hf(const std::string& json_text, const std::string& path,
                                 std::vector<std::string>* notes) {
  const YAML::Node j = parse_json(json_text, "'" + path + "'");
  FLOWMOE_CHECK(j.IsMap(), ConfigError, "'", path, "': not a JSON object");
  const HfConfigReader r{j, path};
  const YAML::Node type = j["model_type"];
  const bool mla = !is_null(type) && type.IsScalar() && type.Scalar() == kHfMlaModelType;
  if (!mla && (is_null(type) || !type.IsScalar() || type.Scalar() != kHfModelType))
    r.refuse("model_type", (is_null(type) ? std::string("absent") : "'" + scalar_text(type) + "'") + " is not " +
                               kHfModelType + " or " + kHfMlaModelType + " (flowmoe imports transformers' " +
                               kHfArchitecture + " and " + kHfMlaArchitecture + ")");
  const std::string model_type = mla ? kHfMlaModelType : kHfModelType;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string field = it->first.Scalar();
    if (!listed(field, kSameFields) && !listed(field, kPassedOver) && !listed(field, kChecked) &&
        !(mla && (listed(field, kMlaFields) || listed(field, kMlaPassedOver))))
      r.refuse(field, "a field flowmoe does not map (" + model_type + " as transformers " + kHfTransformersVersion +
                          " writes it has none such)");
  }
  Config c;
  if (mla) {
    c.model.attention = AttentionType::mla;
    for (const char* field : kMlaFields) {
      const YAML::Node n = j[field];
      // transformers' deepseek_v3 defaults are DeepSeek-V3's own sizes, not flowmoe's: each must be given.
      if (!n) r.refuse(field, "absent (deepseek_v3's default is not flowmoe's; give it)");
      if (!n.IsNull() && !n.IsScalar()) r.refuse(field, "expected a value, got " + scalar_text(n));
      config_schema::set_field(c, *config_schema::find_field("model", field), n.IsNull() ? "null" : n.Scalar(),
                               "'" + path + "'");
      c.origins[std::string("model.") + field] = "'" + path + "'";
    }
    r.require("rope_interleave", "true", true, "flowmoe's RoPE rotates interleaved pairs");
    // deepseek_v3's other defaults that are not flowmoe's.
    for (const char* field : {"n_group", "topk_group", "n_shared_experts", "routed_scaling_factor", "norm_topk_prob"})
      if (is_null(j[field])) r.refuse(field, "absent (deepseek_v3's default is not flowmoe's; give it)");
  }
  for (const char* field : kSameFields) {
    const YAML::Node n = j[field];
    if (is_null(n)) continue;  // transformers' default differs from flowmoe's: checked below
    if (!n.IsScalar()) r.refuse(field, "expected a value, got " + scalar_text(n));
    config_schema::set_field(c, *config_schema::find_field("model", field), n.Scalar(), "'" + path + "'");
    c.origins[std::string("model.") + field] = "'" + path + "'";
  }
  // Fields whose glm4_moe default differs from flowmoe's must be given: an absent one means the default.
  for (const char* field : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                            "intermediate_size", "max_position_embeddings", "rms_norm_eps", "moe_intermediate_size",
                            "num_experts_per_tok", "n_routed_experts", "first_k_dense_replace"})
    if (is_null(j[field])) r.refuse(field, "absent (" + model_type + "'s default is not flowmoe's; give it)");
  ModelConfig& m = c.model;
  m.rope_theta = r.rope_theta(mla);
  c.origins["model.rope_theta"] = "'" + path + "'";
  r.require("hidden_act", "silu", true, "its MLPs are SwiGLU");
  r.require("attention_bias", "false", true, "its projections have no bias");
  r.require("use_qk_norm", "false", true, "it has no q/k norms");
  if (!is_null(j["attention_dropout"]) && r.number(j["attention_dropout"], "attention_dropout") != 0)
    r.refuse("attention_dropout", scalar_text(j["attention_dropout"]) + " is not supported: flowmoe has no dropout");
  if (!is_null(j["num_key_value_heads"]) &&
      j["num_key_value_heads"].as<std::string>() != j["num_attention_heads"].as<std::string>())
    r.refuse("num_key_value_heads", scalar_text(j["num_key_value_heads"]) +
                                        " is not num_attention_heads = " + scalar_text(j["num_attention_heads"]) +
                                        ": flowmoe's attention is multi-head (no grouped-query)");
  if (mla && !is_null(j["qk_head_dim"]) &&
      j["qk_head_dim"].as<std::string>() != std::to_string(attention_qk_head_dim(m)))
    r.refuse("qk_head_dim", scalar_text(j["qk_head_dim"]) + " is not qk_nope_head_dim + qk_rope_head_dim = " +
                                std::to_string(attention_qk_head_dim(m)));
  // deepseek_v3's head_dim is its qk_rope_head_dim (the rotary width).
  if (mla && !is_null(j["head_dim"]) && j["head_dim"].as<std::string>() != std::to_string(m.qk_rope_head_dim))
    r.refuse("head_dim", scalar_text(j["head_dim"]) + " is not qk_rope_head_dim = " +
                             std::to_string(m.qk_rope_head_dim) + " (deepseek_v3's rotary width)");
  if (!mla && m.num_attention_heads > 0 && !is_null(j["head_dim"]) &&
      j["head_dim"].as<std::string>() != std::to_string(m.hidden_size / m.num_attention_heads))
    r.refuse("head_dim", scalar_text(j["head_dim"]) + " is not hidden_size / num_attention_heads = " +
                             std::to_string(m.hidden_size / m.num_attention_heads) + " (flowmoe's head width)");
  if (m.n_routed_experts > 0 && m.num_experts_per_tok == 1 && m.norm_topk_prob)
    r.refuse("norm_topk_prob",
             "true with num_experts_per_tok 1 is not supported: glm4_moe then weighs the one expert by 1, flowmoe by "
             "its score (as DeepSeek-V3)");
  // Past the last layer, first_k_dense_replace means the same as at it: every layer dense.
  m.first_k_dense_replace = std::min(m.first_k_dense_replace, m.num_hidden_layers);
  if (m.n_routed_experts == 0 && m.first_k_dense_replace < m.num_hidden_layers)
    r.refuse("n_routed_experts", "0 with first_k_dense_replace " + std::to_string(m.first_k_dense_replace) +
                                     " below num_hidden_layers: MoE layers without experts");
  const int64_t mtp = hf_num_mtp_layers(json_text, path);
  if (mtp > 0 && notes)
    notes->push_back("left out the " + std::to_string(mtp) + " MTP layer" + (mtp == 1 ? "" : "s") +
                     " (num_nextn_predict_layers; model.layers." + std::to_string(m.num_hidden_layers) +
                     ".*): they do not change the logits");
  // The run config's own checks at the model's keys (the data keys' defaults fit any model that fits them).
  c.data.seq_len = std::min(c.data.seq_len, m.max_position_embeddings);
  if (!attention_fits_cuda(m))
    c.train.device = DeviceChoice::cpu;  // heads the CUDA kernels do not take: a CPU model here
  validate(c);
  return m;
}

}  // namespace flowmoe
