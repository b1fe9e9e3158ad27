// The glm4_moe mapping (see hf_format.h): config.json written, the tensor plan and the per-tensor conversions
// (config.json read: hf_config.cpp).
#include "train/hf_format.h"

#include <charconv>
#include <cstring>
#include <sstream>

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
  const auto refuse = [](const std::string& key, const std::string& value, const std::string& why) {
    FLOWMOE_THROW(ConfigError, "model.", key, ": ", value, " has no glm4_moe counterpart (", why, ")");
  };
  if (m.scoring_func != "sigmoid")
    refuse("scoring_func", m.scoring_func, "transformers' glm4_moe router scores with sigmoid only");
  if (m.n_routed_experts / m.n_group < 2)
    refuse(m.n_group > 1 ? "n_group" : "n_routed_experts",
           std::to_string(m.n_group > 1 ? m.n_group : m.n_routed_experts),
           "glm4_moe scores each group by its top two experts, so a group needs at least 2 of them; here " +
               std::to_string(m.n_routed_experts) + " experts in " + std::to_string(m.n_group) + " group(s)");
}

std::string hf_config_json(const ModelConfig& m) {
  check_hf_exportable(m);
  const bool dense = m.n_routed_experts == 0;
  // Every field transformers writes for a Glm4MoeConfig, in its order: a folder that reads the same.
  std::ostringstream j;
  j << "{\n"
    << "  \"architectures\": [\n    \"" << kHfArchitecture << "\"\n  ],\n"
    << "  \"attention_bias\": false,\n"
    << "  \"attention_dropout\": 0.0,\n"
    << "  \"bos_token_id\": null,\n"
    << "  \"dtype\": \"float32\",\n"
    << "  \"eos_token_id\": null,\n"
    << "  \"first_k_dense_replace\": " << (dense ? m.num_hidden_layers : m.first_k_dense_replace) << ",\n"
    << "  \"head_dim\": " << head_dim(m) << ",\n"
    << "  \"hidden_act\": \"silu\",\n"
    << "  \"hidden_size\": " << m.hidden_size << ",\n"
    << "  \"initializer_range\": " << json_number(m.initializer_range) << ",\n"
    << "  \"intermediate_size\": " << m.intermediate_size << ",\n"
    << "  \"max_position_embeddings\": " << m.max_position_embeddings << ",\n"
    << "  \"model_type\": \"" << kHfModelType << "\",\n"
    << "  \"moe_intermediate_size\": " << m.moe_intermediate_size << ",\n"
    << "  \"n_group\": " << m.n_group << ",\n"
    << "  \"n_routed_experts\": " << m.n_routed_experts << ",\n"
    << "  \"n_shared_experts\": " << m.n_shared_experts << ",\n"
    << "  \"norm_topk_prob\": " << (hf_norm_topk_prob(m) ? "true" : "false") << ",\n"
    << "  \"num_attention_heads\": " << m.num_attention_heads << ",\n"
    << "  \"num_experts_per_tok\": " << m.num_experts_per_tok << ",\n"
    << "  \"num_hidden_layers\": " << m.num_hidden_layers << ",\n"
    << "  \"num_key_value_heads\": " << m.num_attention_heads << ",\n"
    << "  \"num_nextn_predict_layers\": " << m.num_nextn_predict_layers << ",\n"
    << "  \"output_router_logits\": false,\n"
    << "  \"pad_token_id\": null,\n"
    << "  \"rms_norm_eps\": " << json_number(m.rms_norm_eps) << ",\n"
    << "  \"rope_parameters\": {\n"
    << "    \"partial_rotary_factor\": 1.0,\n"  // every dim rotates; glm4_moe's default is 0.5
    << "    \"rope_theta\": " << json_number(m.rope_theta) << ",\n"
    << "    \"rope_type\": \"default\"\n"
    << "  },\n"
    << "  \"routed_scaling_factor\": " << json_number(m.routed_scaling_factor) << ",\n"
    << "  \"tie_word_embeddings\": " << (m.tie_word_embeddings ? "true" : "false") << ",\n"
    << "  \"topk_group\": " << m.topk_group << ",\n"
    << "  \"transformers_version\": \"" << kHfTransformersVersion << "\",\n"
    << "  \"use_cache\": true,\n"
    << "  \"use_qk_norm\": false,\n"
    << "  \"vocab_size\": " << m.vocab_size << "\n"
    << "}\n";
  return j.str();
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
  whole("model.embed_tokens.weight", {V, H});
  // Block i's tensors, in the order the Transformer creates them (a main layer's or an MTP module's block).
  const auto block = [&](int64_t i) {
    const std::string p = "model.layers." + std::to_string(i);
    whole(p + ".input_layernorm.weight", {H});
    whole(p + ".self_attn.q_proj.weight", {H, H}, HfPart::rope_rows);
    whole(p + ".self_attn.k_proj.weight", {H, H}, HfPart::rope_rows);
    whole(p + ".self_attn.v_proj.weight", {H, H});
    whole(p + ".self_attn.o_proj.weight", {H, H});
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
