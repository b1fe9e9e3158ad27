// The glm4_moe mapping (checkpoint/hf_format.h): the tensor plan against the Transformer's own parameters, config.json
// both ways, what either direction refuses, and RoPE's row permutation, by hand and by attention scores.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <regex>

#include "checkpoint/hf_format.h"
#include "engine/autograd.h"
#include "engine/ops/ops.h"
#include "tests/support/hf_models.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// The plan's flowmoe tensors are the Transformer's parameters, then its buffers, in order, name and shape; its
// HF tensors hold as many values (the empty ones none).
void expect_plan_matches_model(const ModelConfig& m) {
  const Transformer model(m, Device::cpu(), DType::f32, 1);
  std::vector<Variable> tensors = model.parameters();
  tensors.insert(tensors.end(), model.buffers().begin(), model.buffers().end());
  const std::vector<HfTensorGroup> plan = hf_tensor_plan(m);
  size_t i = 0;
  for (const HfTensorGroup& g : plan) {
    int64_t hf_values = 0;
    for (const HfTensor& t : g.hf) hf_values += shape_numel(t.shape);
    if (g.name.empty()) {
      EXPECT_EQ(hf_values, 0);
      continue;
    }
    ASSERT_LT(i, tensors.size()) << g.name;
    EXPECT_EQ(g.name, tensors[i].name());
    EXPECT_EQ(g.shape, tensors[i].shape()) << g.name;
    EXPECT_EQ(g.buffer, i >= model.parameters().size()) << g.name;
    EXPECT_EQ(hf_values, shape_numel(g.shape)) << g.name;
    ++i;
  }
  EXPECT_EQ(i, tensors.size());
}

// The HF names and shapes of a plan, flattened.
std::map<std::string, Shape> hf_names(const ModelConfig& m) {
  std::map<std::string, Shape> out;
  for (const HfTensorGroup& g : hf_tensor_plan(m))
    for (const HfTensor& t : g.hf) EXPECT_TRUE(out.emplace(t.name, t.shape).second) << "twice: " << t.name;
  return out;
}

// config.json text of m with one field's line replaced ("" drops it), to make a folder's variants.
std::string edited_json(const ModelConfig& m, const std::string& field, const std::string& line) {
  const std::string json = hf_config_json(m);
  const std::regex field_line("\n *\"" + field + "\": [^\n]*");
  EXPECT_TRUE(std::regex_search(json, field_line)) << field;
  return std::regex_replace(json, field_line, line.empty() ? std::string("") : "\n  " + line,
                            std::regex_constants::format_first_only);
}

}  // namespace

TEST(HfFormat, PlanIsTheTransformersParameters) {
  expect_plan_matches_model(hf_mla_model());
  expect_plan_matches_model(hf_mla_model(0));
  expect_plan_matches_model(hf_moe_model());
  expect_plan_matches_model(hf_dense_model());
  expect_plan_matches_model(hf_moe_unshared_model());
}

TEST(HfFormat, PlanHasTransformersNames) {
  const ModelConfig m = hf_moe_model();
  const std::map<std::string, Shape> names = hf_names(m);
  const int64_t H = 32, F = 16;
  const std::map<std::string, Shape> want = {{"model.embed_tokens.weight", {96, H}},
                                             {"model.layers.0.mlp.gate_proj.weight", {48, H}},  // the dense first layer
                                             {"model.layers.0.mlp.down_proj.weight", {H, 48}},
                                             {"model.layers.1.self_attn.q_proj.weight", {H, H}},
                                             {"model.layers.1.mlp.gate.weight", {8, H}},
                                             {"model.layers.1.mlp.gate.e_score_correction_bias", {8}},
                                             {"model.layers.1.mlp.experts.0.gate_proj.weight", {F, H}},
                                             {"model.layers.2.mlp.experts.7.up_proj.weight", {F, H}},
                                             {"model.layers.2.mlp.experts.7.down_proj.weight", {H, F}},
                                             {"model.layers.2.mlp.shared_experts.up_proj.weight", {F, H}},
                                             {"model.layers.2.post_attention_layernorm.weight", {H}},
                                             {"model.norm.weight", {H}},
                                             {"lm_head.weight", {96, H}}};
  for (const auto& [name, shape] : want) {
    ASSERT_TRUE(names.count(name)) << name;
    EXPECT_EQ(names.at(name), shape) << name;
  }
  // 1 embedding + 3 x (2 norms + 4 attention) + 3 dense MLP + 2 x (gate, bias, 8 x 3 experts, 3 shared) + norm + head
  EXPECT_EQ(names.size(), size_t(1 + 3 * 6 + 3 + 2 * (2 + 24 + 3) + 2));
  EXPECT_FALSE(hf_names(hf_dense_model()).count("lm_head.weight"));  // tied: transformers ties it
  // No shared experts: transformers' module still has them, of width 0.
  EXPECT_EQ(hf_names(hf_moe_unshared_model()).at("model.layers.0.mlp.shared_experts.gate_proj.weight"), Shape({0, H}));
}

TEST(HfFormat, ConfigJsonRoundTrip) {
  for (const ModelConfig& m : {hf_moe_model(), hf_dense_model(), hf_moe_unshared_model()}) {
    const std::string json = hf_config_json(m);
    const ModelConfig back = model_config_from_hf(json, "config.json");
    EXPECT_EQ(hf_config_json(back), json);
    EXPECT_EQ(back.rope_theta, m.rope_theta);
    EXPECT_EQ(back.routed_scaling_factor, m.routed_scaling_factor);
    EXPECT_EQ(back.n_group, m.n_group);
    EXPECT_EQ(back.tie_word_embeddings, m.tie_word_embeddings);
  }
  const std::string json = hf_config_json(hf_moe_model());
  for (const char* line : {"\"model_type\": \"glm4_moe\"", "\"num_key_value_heads\": 4", "\"head_dim\": 8",
                           "\"partial_rotary_factor\": 1.0", "\"rope_theta\": 5000.0", "\"first_k_dense_replace\": 1",
                           "\"routed_scaling_factor\": 2.5", "\"norm_topk_prob\": true"})
    EXPECT_NE(json.find(line), std::string::npos) << line;
  // A dense model: every layer dense.
  EXPECT_NE(hf_config_json(hf_dense_model()).find("\"first_k_dense_replace\": 3"), std::string::npos);
  // top-1: flowmoe does not normalise one weight; glm4_moe would make it 1.
  EXPECT_NE(hf_config_json(hf_moe_unshared_model()).find("\"norm_topk_prob\": false"), std::string::npos);
}

// MLA is deepseek_v3 under DeepseekV3Attention's names, row for row (rope_interleave: transformers rotates the
// interleaved pairs itself); q_lora_rank 0 is null and back.
TEST(HfFormat, MlaIsDeepseekV3) {
  const std::map<std::string, Shape> names = hf_names(hf_mla_model());
  const std::string a = "model.layers.1.self_attn.";
  const std::map<std::string, Shape> want = {
      {a + "q_a_proj.weight", {12, 32}},     {a + "q_a_layernorm.weight", {12}},
      {a + "q_b_proj.weight", {4 * 10, 12}}, {a + "kv_a_proj_with_mqa.weight", {10 + 4, 32}},
      {a + "kv_a_layernorm.weight", {10}},   {a + "kv_b_proj.weight", {4 * (6 + 5), 10}},
      {a + "o_proj.weight", {32, 4 * 5}},    {"model.layers.3.self_attn.kv_b_proj.weight", {4 * (6 + 5), 10}}};
  for (const auto& [name, shape] : want) {
    ASSERT_TRUE(names.count(name)) << name;
    EXPECT_EQ(names.at(name), shape) << name;
  }
  EXPECT_FALSE(names.count(a + "k_proj.weight"));
  for (const HfTensorGroup& g : hf_tensor_plan(hf_mla_model()))
    for (const HfTensor& t : g.hf) EXPECT_NE(t.part, HfPart::rope_rows) << t.name;
  EXPECT_EQ(hf_names(hf_mla_model(0)).at(a + "q_proj.weight"), Shape({4 * 10, 32}));
  for (const ModelConfig& m : {hf_mla_model(), hf_mla_model(0)}) {
    const std::string json = hf_config_json(m);
    ModelConfig back = model_config_from_hf(json, "config.json");
    EXPECT_EQ(back.num_nextn_predict_layers, 0);  // the MTP layers come with their tensors (HfFolder)
    back.num_nextn_predict_layers = m.num_nextn_predict_layers;
    EXPECT_EQ(hf_config_json(back), json);
    EXPECT_EQ(back.attention, AttentionType::mla);
    EXPECT_EQ(back.q_lora_rank, m.q_lora_rank);
    EXPECT_EQ(back.v_head_dim, 5);
  }
  const std::string json = hf_config_json(hf_mla_model());
  for (const char* line : {"\"model_type\": \"deepseek_v3\"", "\"DeepseekV3ForCausalLM\"", "\"rope_interleave\": true",
                           "\"q_lora_rank\": 12", "\"kv_lora_rank\": 10", "\"qk_nope_head_dim\": 6",
                           "\"qk_rope_head_dim\": 4", "\"v_head_dim\": 5", "\"num_nextn_predict_layers\": 1"})
    EXPECT_NE(json.find(line), std::string::npos) << line;
  EXPECT_NE(hf_config_json(hf_mla_model(0)).find("\"q_lora_rank\": null"), std::string::npos);
  // DeepSeek-V3's own head widths (128 + 64, values 128) import, as a model the GPU trains; a value head as wide
  // as that query/key head, as one the CPU trains.
  ModelConfig wide = hf_mla_model();
  wide.qk_nope_head_dim = 128;
  wide.qk_rope_head_dim = 64;
  wide.v_head_dim = 128;
  EXPECT_TRUE(attention_fits_cuda(wide));
  EXPECT_EQ(model_config_from_hf(hf_config_json(wide), "config.json").qk_rope_head_dim, 64);
  wide.v_head_dim = 192;
  EXPECT_FALSE(attention_fits_cuda(wide));
  EXPECT_EQ(model_config_from_hf(hf_config_json(wide), "config.json").v_head_dim, 192);
  // What import refuses, naming the field.
  const struct {
    const char* field;
    const char* line;
    std::vector<const char*> parts;
  } refusals[] = {
      {"rope_interleave", "\"rope_interleave\": false,", {"rope_interleave", "interleaved pairs"}},
      {"rope_parameters",
       "\"rope_parameters\": {\"rope_type\": \"yarn\", \"rope_theta\": 10000.0},",
       {"rope_parameters.rope_type", "yarn"}},
      {"rope_parameters",
       "\"rope_parameters\": {\"factor\": 40, \"mscale\": 1.0, \"rope_theta\": 10000.0},",
       {"rope_parameters.factor"}},
      {"kv_lora_rank", "", {"kv_lora_rank", "absent"}},
      {"q_lora_rank", "", {"q_lora_rank", "absent"}},
      {"n_group", "", {"n_group", "absent (deepseek_v3's default"}},
  };
  for (const auto& r : refusals) {
    SCOPED_TRACE(r.field);
    std::string edited = edited_json(hf_mla_model(), r.field, r.line);
    if (std::string(r.field) == "rope_parameters")  // the object's other lines go with it
      edited = std::regex_replace(edited, std::regex("(\\n    \"rope_t[^\\n]*)+\\n  \\},"), "");
    try {
      model_config_from_hf(edited, "config.json");
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      for (const char* part : r.parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  }
  // A glm4_moe folder does not take MLA's fields.
  EXPECT_TRUE(throws_naming<ConfigError>(
      [&] { model_config_from_hf(edited_json(hf_moe_model(), "use_qk_norm", "\"kv_lora_rank\": 8,"), "config.json"); },
      {"kv_lora_rank", "a field flowmoe does not map (glm4_moe"}));
}

TEST(HfFormat, ExportRefusesWhatGlm4MoeCannotHold) {
  ModelConfig m = hf_moe_model();
  m.scoring_func = RouterScoring::softmax;
  EXPECT_TRUE(throws_naming<ConfigError>([&] { hf_config_json(m); }, {"model.scoring_func: softmax"}));
  m = hf_moe_model();
  m.n_group = 8;
  m.topk_group = 4;
  EXPECT_TRUE(throws_naming<ConfigError>([&] { hf_config_json(m); }, {"model.n_group: 8", "at least 2"}));
}

TEST(HfFormat, ImportRefusesEachFieldItCannotRepresent) {
  const ModelConfig m = hf_moe_model();
  const struct {
    const char* field;
    std::string line;
    const char* named;
  } cases[] = {
      {"model_type", "\"model_type\": \"qwen2_moe\",", "model_type: 'qwen2_moe' is not glm4_moe or deepseek_v3"},
      {"num_key_value_heads", "\"num_key_value_heads\": 2,", "num_key_value_heads: 2"},
      {"attention_bias", "\"attention_bias\": true,", "attention_bias: true"},
      {"use_qk_norm", "\"use_qk_norm\": true,", "use_qk_norm: true"},
      {"hidden_act", "\"hidden_act\": \"gelu\",", "hidden_act: gelu"},
      {"head_dim", "\"head_dim\": 16,", "head_dim: 16"},
      {"partial_rotary_factor", "\"partial_rotary_factor\": 0.5,", "partial_rotary_factor: 0.5"},
      {"partial_rotary_factor", "", "partial_rotary_factor: absent"},
      {"rope_type", "\"rope_type\": \"yarn\"", "rope_parameters.rope_type: yarn"},
      {"vocab_size", "\"sliding_window\": 4096,", "sliding_window: a field flowmoe does not map"},
      {"intermediate_size", "", "intermediate_size: absent"},
      {"hidden_size", "\"hidden_size\": 30,", "'config.json'"},  // 30 / 4 heads: the config's own check
  };
  for (const auto& c : cases) {
    const std::string json = edited_json(m, c.field, c.line);
    EXPECT_TRUE(throws_naming<ConfigError>([&] { model_config_from_hf(json, "config.json"); }, {c.named})) << c.named;
  }
  ModelConfig top1 = hf_moe_unshared_model();
  const std::string json = edited_json(top1, "norm_topk_prob", "\"norm_topk_prob\": true,");
  EXPECT_TRUE(throws_naming<ConfigError>([&] { model_config_from_hf(json, "config.json"); },
                                         {"norm_topk_prob: true with num_experts_per_tok 1"}));
  // MTP layers are left out with a note.
  std::vector<std::string> notes;
  model_config_from_hf(edited_json(m, "num_nextn_predict_layers", "\"num_nextn_predict_layers\": 1,"), "c", &notes);
  ASSERT_EQ(notes.size(), 1u);
  EXPECT_NE(notes[0].find("MTP layer"), std::string::npos);
}

// Head width 4: flowmoe's pairs (0,1), (2,3) are transformers' (0,2), (1,3): rows 0, 2, 1, 3 of each head.
TEST(HfFormat, RopeRowsByHand) {
  ModelConfig m = hf_moe_model();
  m.hidden_size = 8;
  m.num_attention_heads = 2;
  Tensor w = Tensor::empty({8, 2}, DType::f32);
  for (int64_t r = 0; r < 8; ++r)
    for (int64_t c = 0; c < 2; ++c) w.data<float>()[r * 2 + c] = float(r * 10 + c);
  const HfTensor q{"q", {8, 2}, HfPart::rope_rows, 0};
  const Tensor hf = hf_tensor_from(w, q, m);
  const int64_t want_rows[] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int64_t r = 0; r < 8; ++r) EXPECT_EQ(hf.data<float>()[r * 2 + 1], float(want_rows[r] * 10 + 1)) << r;
  Tensor back = Tensor::zeros({8, 2}, DType::f32);
  hf_tensor_into(back, hf, q, m);
  EXPECT_TRUE(bit_equal(back, w));
}

namespace {

// transformers' RoPE (rotate_half: dims d and d + hd/2 turn together by pos * theta^(-2d/hd)) of x [T, nh, hd].
Tensor rope_rotate_half(const Tensor& x, double theta) {
  Tensor out = Tensor::empty(x.shape(), DType::f32);
  const int64_t T = x.size(0), nh = x.size(1), hd = x.size(2), half = hd / 2;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t d = 0; d < half; ++d) {
        const double angle = double(t) * std::pow(theta, -2.0 * double(d) / double(hd));
        const float* in = x.data<float>() + (t * nh + h) * hd;
        float* o = out.data<float>() + (t * nh + h) * hd;
        o[d] = float(in[d] * std::cos(angle) - in[d + half] * std::sin(angle));
        o[d + half] = float(in[d + half] * std::cos(angle) + in[d] * std::sin(angle));
      }
  return out;
}

// Per head, every q[t]·k[s] of q, k [T, nh, hd]: [nh, T, T].
Tensor scores(const Tensor& q, const Tensor& k) {
  const int64_t T = q.size(0), nh = q.size(1), hd = q.size(2);
  Tensor out = Tensor::zeros({nh, T, T}, DType::f32);
  for (int64_t h = 0; h < nh; ++h)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t s = 0; s < T; ++s) {
        double dot = 0;
        for (int64_t d = 0; d < hd; ++d)
          dot += double(q.data<float>()[(t * nh + h) * hd + d]) * k.data<float>()[(s * nh + h) * hd + d];
        out.data<float>()[(h * T + t) * T + s] = float(dot);
      }
  return out;
}

}  // namespace

// The attention scores of flowmoe's projections with its interleaved RoPE are those of the exported
// projections with transformers' rotate_half; the same weights unpermuted give other scores.
TEST(HfFormat, RopePermutationKeepsAttentionScores) {
  const ModelConfig m = hf_moe_model();
  const int64_t T = 12, H = m.hidden_size, nh = m.num_attention_heads, hd = H / nh;
  Rng rng(test_seed());
  const Tensor x = random_tensor(rng, {T, H});
  const Tensor wq = random_tensor(rng, {H, H}), wk = random_tensor(rng, {H, H});
  const HfTensor rows{"q", {H, H}, HfPart::rope_rows, 0};
  const auto project = [&](const Tensor& w) {
    return linear(Variable(x), Variable(w)).data().contiguous().view({T, nh, hd});
  };
  const auto flowmoe_rope = [&](const Tensor& y) {
    return rope(Variable(y.view({1, T, nh, hd})), m.rope_theta).data().contiguous().view({T, nh, hd});
  };
  const Tensor ours = scores(flowmoe_rope(project(wq)), flowmoe_rope(project(wk)));
  const Tensor theirs = scores(rope_rotate_half(project(hf_tensor_from(wq, rows, m)), m.rope_theta),
                               rope_rotate_half(project(hf_tensor_from(wk, rows, m)), m.rope_theta));
  EXPECT_TRUE(all_close(theirs, ours, 1e-4, 1e-4));
  const Tensor unpermuted =
      scores(rope_rotate_half(project(wq), m.rope_theta), rope_rotate_half(project(wk), m.rope_theta));
  EXPECT_GT(rel_error(unpermuted, ours), 1e-2);
}

// fc1 [E, 2F, H] is each expert's gate rows, then its up rows; fc2 [E, H, F] its down_proj.
TEST(HfFormat, ExpertTensorsByHand) {
  const ModelConfig m = hf_moe_model();
  const int64_t E = 8, F = 16, H = 32;
  Tensor fc1 = Tensor::empty({E, 2 * F, H}, DType::f32), fc2 = Tensor::empty({E, H, F}, DType::f32);
  for (int64_t i = 0; i < fc1.numel(); ++i) fc1.data<float>()[i] = float(i);
  for (int64_t i = 0; i < fc2.numel(); ++i) fc2.data<float>()[i] = float(-i);
  const Tensor gate = hf_tensor_from(fc1, {"g", {F, H}, HfPart::expert_gate, 5}, m);
  const Tensor up = hf_tensor_from(fc1, {"u", {F, H}, HfPart::expert_up, 5}, m);
  const Tensor down = hf_tensor_from(fc2, {"d", {H, F}, HfPart::expert_down, 5}, m);
  EXPECT_EQ(gate.data<float>()[0], float(5 * 2 * F * H));
  EXPECT_EQ(up.data<float>()[0], float((5 * 2 * F + F) * H));
  EXPECT_EQ(up.data<float>()[F * H - 1], float((5 * 2 * F + 2 * F) * H - 1));
  EXPECT_EQ(down.data<float>()[H * F - 1], -float(6 * H * F - 1));
  // Into an expert shard of rows [4, 6): expert 5 is its row 1; expert 2 is another rank's.
  Tensor shard = Tensor::zeros({2, 2 * F, H}, DType::f32);
  hf_tensor_into(shard, up, {"u", {F, H}, HfPart::expert_up, 5}, m, 4);
  hf_tensor_into(shard, up, {"u", {F, H}, HfPart::expert_up, 2}, m, 4);
  EXPECT_EQ(shard.data<float>()[(2 * F + F) * H], float((5 * 2 * F + F) * H));
  EXPECT_EQ(shard.data<float>()[(2 * F) * H - 1], 0.0f);
  EXPECT_EQ(shard.data<float>()[F * H], 0.0f);
}
