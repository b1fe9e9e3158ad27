// The dense transformer: Hugging Face parameter names and shapes, seeded init, causality, the
// initial loss, gradients for every parameter, and the GPU (bf16) forward against the CPU (f32).
#include <cmath>
#include <set>

#include "layers/transformer.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

ModelConfig small_model(bool tied = false) {
  ModelConfig m;
  m.vocab_size = 50;
  m.hidden_size = 32;
  m.num_hidden_layers = 2;
  m.num_attention_heads = 4;
  m.intermediate_size = 48;
  m.max_position_embeddings = 16;
  m.tie_word_embeddings = tied;
  return m;
}

Tensor random_ids(Rng& rng, int64_t b, int64_t t, int64_t vocab) { return rng.randint({b, t}, 0, vocab); }

}  // namespace

TEST(Transformer, HuggingFaceNamesAndShapes) {
  Transformer model(small_model(), Device::cpu(), DType::f32, 1);
  std::map<std::string, Shape> want = {
      {"model.embed_tokens.weight", {50, 32}},
      {"model.norm.weight", {32}},
      {"lm_head.weight", {50, 32}},
  };
  for (int l = 0; l < 2; ++l) {
    std::string p = "model.layers." + std::to_string(l);
    want[p + ".input_layernorm.weight"] = {32};
    want[p + ".post_attention_layernorm.weight"] = {32};
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "o_proj"})
      want[p + ".self_attn." + proj + ".weight"] = {32, 32};
    want[p + ".mlp.gate_proj.weight"] = {48, 32};
    want[p + ".mlp.up_proj.weight"] = {48, 32};
    want[p + ".mlp.down_proj.weight"] = {32, 48};
  }
  ASSERT_EQ(model.parameters().size(), want.size());
  int64_t count = 0;
  for (const Variable& p : model.parameters()) {
    ASSERT_TRUE(want.count(p.name())) << "unexpected parameter " << p.name();
    EXPECT_EQ(p.shape(), want[p.name()]) << p.name();
    EXPECT_EQ(p.dtype(), DType::f32);
    EXPECT_TRUE(p.requires_grad());
    count += p.data().numel();
  }
  EXPECT_EQ(model.num_parameters(), count);
  Transformer tied(small_model(true), Device::cpu(), DType::f32, 1);
  EXPECT_EQ(tied.parameters().size(), want.size() - 1);
  EXPECT_EQ(tied.num_parameters(), count - 50 * 32);
}

TEST(Transformer, InitIsSeeded) {
  Transformer a(small_model(), Device::cpu(), DType::f32, 7), b(small_model(), Device::cpu(), DType::f32, 7),
      c(small_model(), Device::cpu(), DType::f32, 8);
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_TRUE(bit_equal(a.parameters()[i].data(), b.parameters()[i].data()));
  EXPECT_FALSE(bit_equal(a.parameters()[0].data(), c.parameters()[0].data()));
  std::vector<float> ln = a.parameters()[1].data().to_floats();  // a norm weight starts at 1
  for (float x : ln) EXPECT_EQ(x, 1.0f);
}

TEST(Transformer, InitialLossIsLnVocabAndEveryParameterGetsAGradient) {
  Rng rng(test_seed());
  Transformer model(small_model(), Device::cpu(), DType::f32, 3);
  Tensor ids = random_ids(rng, 3, 16, 50), targets = random_ids(rng, 3, 16, 50);
  Variable loss = model.loss(ids, targets);
  EXPECT_EQ(loss.shape(), Shape{});
  EXPECT_NEAR(loss.data().to_floats()[0], std::log(50.0), 0.1);
  loss.backward();
  for (const Variable& p : model.parameters()) {
    ASSERT_TRUE(p.grad().defined()) << p.name() << " got no gradient";
    double norm = 0;
    for (double g : p.grad().to_doubles()) norm += g * g;
    EXPECT_GT(norm, 0) << p.name();
  }
}

TEST(Transformer, IsCausal) {
  Rng rng(test_seed());
  Transformer model(small_model(), Device::cpu(), DType::f32, 3);
  NoGradGuard ng;
  Tensor ids = random_ids(rng, 1, 12, 50);
  std::vector<float> before = model.forward(ids).data().to_floats();
  Tensor changed = ids.clone();
  changed.data<int32_t>()[8] = (changed.data<int32_t>()[8] + 1) % 50;
  std::vector<float> after = model.forward(changed).data().to_floats();
  for (int64_t t = 0; t < 12; ++t) {
    bool same = true;
    for (int64_t v = 0; v < 50; ++v) same = same && before[size_t(t * 50 + v)] == after[size_t(t * 50 + v)];
    EXPECT_EQ(same, t < 8) << "position " << t;
  }
}

TEST(Transformer, RejectsBadInput) {
  Transformer model(small_model(), Device::cpu(), DType::f32, 3);
  EXPECT_THROW(model.forward(Tensor::zeros({2, 17}, DType::i32)), ShapeError);  // longer than max positions
  EXPECT_THROW(model.forward(Tensor::zeros({2, 4}, DType::f32)), ShapeError);
  EXPECT_THROW(Transformer(small_model(), Device::cpu(), DType::bf16, 1), DTypeError);
}

// bf16 compute on the GPU: same init bits, logits within bf16 rounding of the fp32 CPU forward.
TEST(TransformerCuda, Bf16ForwardMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Transformer cpu(small_model(), Device::cpu(), DType::f32, 5), gpu(small_model(), Device::cuda(), DType::bf16, 5);
  for (size_t i = 0; i < cpu.parameters().size(); ++i)
    ASSERT_TRUE(bit_equal(gpu.parameters()[i].data(), cpu.parameters()[i].data())) << cpu.parameters()[i].name();
  Tensor ids = random_ids(rng, 2, 16, 50), targets = random_ids(rng, 2, 16, 50);
  Variable lc = cpu.loss(ids, targets), lg = gpu.loss(ids, targets);
  EXPECT_EQ(lg.dtype(), DType::f32);
  EXPECT_NEAR(lg.data().to_floats()[0], lc.data().to_floats()[0], 2e-2 * lc.data().to_floats()[0]);
  lc.backward();
  lg.backward();
  for (size_t i = 0; i < cpu.parameters().size(); ++i) {
    const Variable& pg = gpu.parameters()[i];
    ASSERT_EQ(pg.grad().dtype(), DType::f32) << "master gradients stay f32";
    EXPECT_LT(rel_error(pg.grad(), cpu.parameters()[i].grad()), 0.1) << pg.name();
  }
}
