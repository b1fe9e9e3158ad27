// The glm4_moe mapping (see hf_format.h): config.json written, the tensor plan and the per-tensor conversions
// (config.json read: hf_config.cpp).
#include "checkpoint/hf_format.h"

#include <charconv>
#include <cstring>
#include <map>

#include "engine/ops/router.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace {

// A JSON number that reads back as the same double, with a decimal point so that a float field stays a float.
std::string json_number(double v) {
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

int64_t head_dim(const ModelConfig& m) { return m.hidden_size / m.num_attention_heads; }

// transformers' glm4_moe normalises the top-k weights whenever norm_topk_prob is set, also for one expert (the
// weight is then 1); flowmoe, as DeepSeek-V3, only for k > 1. So top-1 with norm_topk_prob is top-1 without.
bool hf_norm_topk_prob(const ModelConfig& m) { return m.norm_topk_prob && m.num_experts_per_tok > 1; }

}  // namespace

void check_hf_exportable(const ModelConfig& m) {
  if (m.n_routed_experts == 0) return;  // a dense model: no router to map
  const auto refuse = [&m](const std::string& key, const std::string& value, const std::string& why) {
    FLOWMOE_THROW(ConfigError, "model.", key, ": ", value, " has no ", hf_model_type(m), " counterpart (", why, ")");
  };
  if (m.scoring_func != RouterScoring::sigmoid)
    refuse("scoring_func", enum_name(kRouterScoringNames, m.scoring_func),
           "transformers' glm4_moe and deepseek_v3 routers score with sigmoid only");
  if (m.n_routed_experts / m.n_group < 2)
    refuse(m.n_group > 1 ? "n_group" : "n_routed_experts",
           std::to_string(m.n_group > 1 ? m.n_group : m.n_routed_experts),
           "its router scores each group by its top two experts, so a group needs at least 2 of them; here " +
               std::to_string(m.n_routed_experts) + " experts in " + std::to_string(m.n_group) + " group(s)");
}

std::string hf_config_json(const ModelConfig& m) {
  check_hf_exportable(m);
  const bool dense = m.n_routed_experts == 0, mla = m.attention == AttentionType::mla;
  const auto text = [](const std::string& v) { return "\"" + v + "\""; };
  const auto integer = [](int64_t v) { return std::to_string(v); };
  const auto boolean = [](bool v) { return std::string(v ? "true" : "false"); };
  // Every field transformers writes for a Glm4MoeConfig (mha) or a DeepseekV3Config (mla), written in its sorted
  // order: a folder that reads the same.
  std::map<std::string, std::string> f = {
      {"architectures", "[\n    " + text(hf_architecture(m)) + "\n  ]"},
      {"attention_bias", "false"},
      {"attention_dropout", "0.0"},
      {"bos_token_id", "null"},
      {"dtype", text("float32")},
      {"eos_token_id", "null"},
      {"first_k_dense_replace", integer(dense ? m.num_hidden_layers : m.first_k_dense_replace)},
      {"hidden_act", text("silu")},
      {"hidden_size", integer(m.hidden_size)},
      {"initializer_range", json_number(m.initializer_range)},
      {"intermediate_size", integer(m.intermediate_size)},
      {"max_position_embeddings", integer(m.max_position_embeddings)},
      {"model_type", text(hf_model_type(m))},
      {"moe_intermediate_size", integer(m.moe_intermediate_size)},
      {"n_group", integer(m.n_group)},
      {"n_routed_experts", integer(m.n_routed_experts)},
      {"n_shared_experts", integer(m.n_shared_experts)},
      {"norm_topk_prob", boolean(hf_norm_topk_prob(m))},
      {"num_attention_heads", integer(m.num_attention_heads)},
      {"num_experts_per_tok", integer(m.num_experts_per_tok)},
      {"num_hidden_layers", integer(m.num_hidden_layers)},
      {"num_key_value_heads", integer(m.num_attention_heads)},
      {"num_nextn_predict_layers", integer(m.num_nextn_predict_layers)},
      {"output_router_logits", "false"},
      {"pad_token_id", "null"},
      {"rms_norm_eps", json_number(m.rms_norm_eps)},
      {"routed_scaling_factor", json_number(m.routed_scaling_factor)},
      {"tie_word_embeddings", boolean(m.tie_word_embeddings)},
      {"topk_group", integer(m.topk_group)},
      {"transformers_version", text(kHfTransformersVersion)},
      {"use_cache", "true"},
      {"vocab_size", integer(m.vocab_size)},
  };
  const std::string theta =
      "    \"rope_theta\": " + json_number(m.rope_theta) + ",\n    \"rope_type\": \"default\"\n  }";
  if (mla) {
    f["kv_lora_rank"] = integer(m.kv_lora_rank);
    f["q_lora_rank"] = m.q_lora_rank > 0 ? integer(m.q_lora_rank) : "null";
    f["qk_nope_head_dim"] = integer(m.qk_nope_head_dim);
    f["qk_rope_head_dim"] = integer(m.qk_rope_head_dim);
    f["v_head_dim"] = integer(m.v_head_dim);
    f["qk_head_dim"] = integer(attention_qk_head_dim(m));
    f["head_dim"] = integer(m.qk_rope_head_dim);  // deepseek_v3's head_dim is its rotary width
    f["pretraining_tp"] = "1";
    f["rope_interleave"] = "true";  // flowmoe's interleaved pairs (hf_format.h)
    f["rope_parameters"] = "{\n" + theta;
  } else {
    f["head_dim"] = integer(head_dim(m));
    f["use_qk_norm"] = "false";
    // Every dim rotates; glm4_moe's own default is 0.5.
    f["rope_parameters"] = "{\n    \"partial_rotary_factor\": 1.0,\n" + theta;
  }
  std::string j = "{\n";
  for (const auto& [key, value] : f) j += "  \"" + key + "\": " + value + (key == f.rbegin()->first ? "\n" : ",\n");
  return j + "}\n";
}

// ---- tensors --------------------------------------------------------------------------------------

int64_t hf_layer_of(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return -1;
  const size_t dot = name.find('.', prefix.size());
  try {
    return std::stoll(name.substr(prefix.size(), dot - prefix.size()));
  } catch (const std::exception&) {
    return -1;
  }
}

std::vector<HfTensorGroup> hf_tensor_plan(const ModelConfig& m) {
  const int64_t H = m.hidden_size, V = m.vocab_size, E = m.n_routed_experts, F = m.moe_intermediate_size,
                I = m.intermediate_size, S = m.n_shared_experts * m.moe_intermediate_size;
  std::vector<HfTensorGroup> plan, buffers;
  HfTensorGroup empty;
  const auto whole = [&](const std::string& name, const Shape& shape, HfPart part = HfPart::whole) {
    plan.push_back({name, shape, false, {{name, shape, part, 0}}});
  };
  const auto mlp = [&](const std::string& prefix, int64_t width) {
    if (width == 0) {  // transformers' module still has its (empty) weights
      empty.hf.push_back({prefix + ".gate_proj.weight", {0, H}, HfPart::empty, 0});
      empty.hf.push_back({prefix + ".up_proj.weight", {0, H}, HfPart::empty, 0});
      empty.hf.push_back({prefix + ".down_proj.weight", {H, 0}, HfPart::empty, 0});
      return;
    }
    whole(prefix + ".gate_proj.weight", {width, H});
    whole(prefix + ".up_proj.weight", {width, H});
    whole(prefix + ".down_proj.weight", {H, width});
  };
  // Attention's tensors in the order its layer creates them (layers/attention.h, layers/mla.h).
  const auto attention = [&](const std::string& p) {
    if (m.attention == AttentionType::mla) {
      const int64_t nh = m.num_attention_heads, qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
      if (m.q_lora_rank > 0) {
        whole(p + ".q_a_proj.weight", {m.q_lora_rank, H});
        whole(p + ".q_a_layernorm.weight", {m.q_lora_rank});
        whole(p + ".q_b_proj.weight", {nh * qk, m.q_lora_rank});
      } else {
        whole(p + ".q_proj.weight", {nh * qk, H});
      }
      whole(p + ".kv_a_proj_with_mqa.weight", {m.kv_lora_rank + m.qk_rope_head_dim, H});
      whole(p + ".kv_a_layernorm.weight", {m.kv_lora_rank});
      whole(p + ".kv_b_proj.weight", {nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank});
      whole(p + ".o_proj.weight", {H, nh * m.v_head_dim});
      return;
    }
    whole(p + ".q_proj.weight", {H, H}, HfPart::rope_rows);
    whole(p + ".k_proj.weight", {H, H}, HfPart::rope_rows);
    whole(p + ".v_proj.weight", {H, H});
    whole(p + ".o_proj.weight", {H, H});
  };
  whole("model.embed_tokens.weight", {V, H});
  // Block i's tensors, in the order the Transformer creates them (a main layer's or an MTP module's block).
  const auto block = [&](int64_t i) {
    const std::string p = "model.layers." + std::to_string(i);
    whole(p + ".input_layernorm.weight", {H});
    attention(p + ".self_attn");
    if (is_moe_layer(m, i)) {
      whole(p + ".mlp.gate.weight", {E, H});
      HfTensorGroup fc1{p + ".mlp.experts.fc1.weight", {E, 2 * F, H}, false, {}};
      HfTensorGroup fc2{p + ".mlp.experts.fc2.weight", {E, H, F}, false, {}};
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = p + ".mlp.experts." + std::to_string(e);
        fc1.hf.push_back({x + ".gate_proj.weight", {F, H}, HfPart::expert_gate, e});
        fc1.hf.push_back({x + ".up_proj.weight", {F, H}, HfPart::expert_up, e});
        fc2.hf.push_back({x + ".down_proj.weight", {H, F}, HfPart::expert_down, e});
      }
      plan.push_back(std::move(fc1));
      plan.push_back(std::move(fc2));
      mlp(p + ".mlp.shared_experts", S);
      const std::string bias = p + ".mlp.gate.e_score_correction_bias";
      buffers.push_back({bias, {E}, true, {{bias, {E}, HfPart::whole, 0}}});
    } else {
      mlp(p + ".mlp", I);
    }
    whole(p + ".post_attention_layernorm.weight", {H});
  };
  for (int64_t i = 0; i < m.num_hidden_layers; ++i) block(i);
  whole("model.norm.weight", {H});
  if (!m.tie_word_embeddings) whole("lm_head.weight", {V, H});  // tied: transformers ties it to the embedding
  // The MTP modules (layers/mtp.h) under DeepSeek-V3's numbering; the embedding and the head are the model's.
  for (int64_t k = 1; k <= m.num_nextn_predict_layers; ++k) {
    const std::string p = "model.layers." + std::to_string(mtp_layer_index(m, k));
    whole(p + ".enorm.weight", {H});
    whole(p + ".hnorm.weight", {H});
    whole(p + ".eh_proj.weight", {H, 2 * H});
    block(mtp_layer_index(m, k));
    whole(p + ".shared_head.norm.weight", {H});
  }
  for (HfTensorGroup& b : buffers) plan.push_back(std::move(b));
  if (!empty.hf.empty()) plan.push_back(std::move(empty));
  return plan;
}

namespace {

// Each head's rows in transformers' order (to_hf) or back: row j < hd/2 of a head there is row 2j here, row
// hd/2 + j is row 2j + 1 (hf_format.h).
Tensor permute_rope_rows(const Tensor& w, int64_t hd, bool to_hf) {
  const Tensor src = w.contiguous();
  Tensor out = Tensor::empty(src.shape(), src.dtype());
  const size_t row = size_t(src.size(1)) * dtype_size(src.dtype());
  const auto* in = static_cast<const char*>(src.raw_data());
  auto* o = static_cast<char*>(out.raw_data());
  for (int64_t head = 0; head < src.size(0) / hd; ++head)
    for (int64_t j = 0; j < hd; ++j) {
      const int64_t interleaved = head * hd + (j < hd / 2 ? 2 * j : 2 * (j - hd / 2) + 1);
      const int64_t halves = head * hd + j;
      const int64_t from = to_hf ? interleaved : halves, to = to_hf ? halves : interleaved;
      std::memcpy(o + size_t(to) * row, in + size_t(from) * row, row);
    }
  return out;
}

// The byte offset of HF tensor t's first value inside its flowmoe tensor, relative to expert `first_expert`.
size_t expert_offset_bytes(const HfTensor& t, const ModelConfig& m, int64_t first_expert, size_t elem) {
  const int64_t H = m.hidden_size, F = m.moe_intermediate_size, e = t.expert - first_expert;
  switch (t.part) {
    case HfPart::expert_gate:
      return size_t(e * 2 * F * H) * elem;
    case HfPart::expert_up:
      return size_t((e * 2 * F + F) * H) * elem;
    case HfPart::expert_down:
      return size_t(e * H * F) * elem;
    default:
      return 0;
  }
}

}  // namespace

Tensor hf_tensor_from(const Tensor& src, const HfTensor& t, const ModelConfig& m) {
  switch (t.part) {
    case HfPart::whole:
      return src;
    case HfPart::rope_rows:
      return permute_rope_rows(src, head_dim(m), true);
    case HfPart::empty:
      return Tensor::zeros(t.shape, src.defined() ? src.dtype() : DType::f32);
    default: {
      const Tensor whole = src.contiguous();
      Tensor out = Tensor::empty(t.shape, whole.dtype());
      const size_t elem = dtype_size(whole.dtype());
      std::memcpy(out.raw_data(), static_cast<const char*>(whole.raw_data()) + expert_offset_bytes(t, m, 0, elem),
                  out.nbytes());
      return out;
    }
  }
}

void hf_tensor_into(Tensor& dst, const Tensor& hf, const HfTensor& t, const ModelConfig& m, int64_t expert_offset) {
  FLOWMOE_CHECK(dst.device().is_cpu() && dst.is_contiguous() && dst.dtype() == hf.dtype(), Error,
                "hf_tensor_into: ", dst.describe(), " from ", hf.describe());
  switch (t.part) {
    case HfPart::whole:
      dst.copy_(hf);
      return;
    case HfPart::rope_rows:
      dst.copy_(permute_rope_rows(hf, head_dim(m), false));
      return;
    case HfPart::empty:
      return;
    default: {
      if (t.expert < expert_offset || t.expert >= expert_offset + dst.size(0)) return;  // another rank's expert
      const Tensor src = hf.contiguous();
      const size_t elem = dtype_size(dst.dtype());
      std::memcpy(static_cast<char*>(dst.raw_data()) + expert_offset_bytes(t, m, expert_offset, elem), src.raw_data(),
                  src.nbytes());
    }
  }
}

}  // namespace flowmoe
