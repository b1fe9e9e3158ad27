// Multi-token prediction (layers/mtp.h): names and init beside the main model's, the loss against a hand-written
// f64 composition (depths 1 and 2), a finite-difference check through a module, the main model alone in
// evaluation, a tiny training run with it, and D = 0 leaving the model as it was.
#include <cmath>
#include <map>

#include "layers/mtp.h"
#include "tests/support/checks.h"
#include "tests/support/mla_config.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

ModelConfig mtp_model(int64_t depth, bool moe = false) {
  ModelConfig m;
  m.vocab_size = 40;
  m.hidden_size = 16;
  m.num_hidden_layers = 2;
  m.num_attention_heads = 2;
  m.intermediate_size = 24;
  m.max_position_embeddings = 16;
  m.num_nextn_predict_layers = depth;
  if (moe) {
    m.n_routed_experts = 4;
    m.num_experts_per_tok = 2;
    m.moe_intermediate_size = 12;
    m.first_k_dense_replace = 1;
  }
  return m;
}

std::map<std::string, std::vector<double>> weights_by_name(const Transformer& model) {
  std::map<std::string, std::vector<double>> w;
  for (const Variable& p : model.parameters()) w[p.name()] = p.data().to_doubles();
  return w;
}

// x / sqrt(mean(x^2) + eps) * w over one row of H.
std::vector<double> rms_row(const double* x, const std::vector<double>& w, double eps) {
  const size_t H = w.size();
  double ss = 0;
  for (size_t j = 0; j < H; ++j) ss += x[j] * x[j];
  const double r = 1.0 / std::sqrt(ss / double(H) + eps);
  std::vector<double> y(H);
  for (size_t j = 0; j < H; ++j) y[j] = x[j] * r * w[j];
  return y;
}

// The MTP loss by hand in f64: (1/D) Σ_k mean over the positions i with i + k < T of
// -log softmax(W_head · shared_head.norm(h^k_i))[targets[i + k]], h^k = TRM_k(eh_proj [enorm(E[ids[i + k]]);
// hnorm(h^{k-1}_i)]). Only the block runs through the engine (in f64, an MoE one in f32; the module's weights).
double reference_mtp_loss(const Transformer& model, const Tensor& ids, const Tensor& targets) {
  const ModelConfig& c = model.config();
  const int64_t B = ids.size(0), T = ids.size(1), H = c.hidden_size, V = c.vocab_size;
  auto w = weights_by_name(model);
  const std::vector<int64_t> id = ids.to_ints(), tg = targets.to_ints();
  std::vector<double> h = model.hidden(ids).data().to_doubles();
  const std::vector<double>& E = w["model.embed_tokens.weight"];
  const std::vector<double>& head = c.tie_word_embeddings ? E : w["lm_head.weight"];
  double total = 0;
  for (int64_t k = 1; k <= c.num_nextn_predict_layers; ++k) {
    const std::string p = "model.layers." + std::to_string(c.num_hidden_layers + k - 1);
    const std::vector<double>&enorm = w[p + ".enorm.weight"], &hnorm = w[p + ".hnorm.weight"],
          &proj = w[p + ".eh_proj.weight"], &snorm = w[p + ".shared_head.norm.weight"];
    std::vector<double> x(size_t(B * T * H));
    for (int64_t r = 0; r < B * T; ++r) {
      const int64_t b = r / T, i = r % T;
      const int64_t ahead = i + k < T ? id[size_t(b * T + i + k)] : 0;
      const std::vector<double> e = rms_row(&E[size_t(ahead * H)], enorm, c.rms_norm_eps);
      const std::vector<double> hn = rms_row(&h[size_t(r * H)], hnorm, c.rms_norm_eps);
      for (int64_t o = 0; o < H; ++o) {
        double acc = 0;
        for (int64_t j = 0; j < H; ++j) acc += proj[size_t(o * 2 * H + j)] * e[size_t(j)];
        for (int64_t j = 0; j < H; ++j) acc += proj[size_t(o * 2 * H + H + j)] * hn[size_t(j)];
        x[size_t(r * H + o)] = acc;
      }
    }
    // The MoE layer computes in f32 and bf16 only.
    const TransformerBlock& block = model.mtp_module(k).block();
    const DType dt = block.moe() ? DType::f32 : DType::f64;
    const Variable xv(Tensor::from_doubles(x, {B, T, H}, dt), false);
    h = block.forward({xv, Variable()}, dt).sum().data().to_doubles();
    double ce = 0;
    int64_t n = 0;
    for (int64_t r = 0; r < B * T; ++r) {
      const int64_t b = r / T, i = r % T;
      if (i + k >= T) continue;
      const std::vector<double> y = rms_row(&h[size_t(r * H)], snorm, c.rms_norm_eps);
      std::vector<double> logits(static_cast<size_t>(V));
      double mx = -INFINITY;
      for (int64_t v = 0; v < V; ++v) {
        double acc = 0;
        for (int64_t j = 0; j < H; ++j) acc += head[size_t(v * H + j)] * y[size_t(j)];
        logits[size_t(v)] = acc;
        mx = std::max(mx, acc);
      }
      double z = 0;
      for (double l : logits) z += std::exp(l - mx);
      ce += std::log(z) + mx - logits[size_t(tg[size_t(b * T + i + k)])];
      ++n;
    }
    total += ce / double(n);
  }
  return total / double(c.num_nextn_predict_layers);
}

void expect_loss_matches_reference(const ModelConfig& cfg) {
  Transformer model(cfg, Device::cpu(), DType::f32, 7);
  model.set_mtp_loss_weight(0.3);
  Rng rng(11);
  const Tensor ids = rng.randint({2, 9}, 0, cfg.vocab_size), targets = rng.randint({2, 9}, 0, cfg.vocab_size);
  const Transformer::Losses l = model.losses(ids, targets);
  ASSERT_TRUE(l.mtp.defined());
  EXPECT_EQ(l.mtp_weight, 0.3);
  const double got = l.mtp.data().to_doubles()[0], want = reference_mtp_loss(model, ids, targets);
  EXPECT_NEAR(got, want, 2e-5 * std::abs(want)) << "depth " << cfg.num_nextn_predict_layers;
  // A small bug (the window's tail counted, the halves swapped, the final norm used) moves it far more.
  EXPECT_GT(std::abs(want - double(l.lm.data().to_doubles()[0])), 1e-4);
  const double lm = l.lm.data().to_doubles()[0], aux = l.aux.defined() ? l.aux.data().to_doubles()[0] : 0.0;
  EXPECT_NEAR(l.total().data().to_doubles()[0], lm + aux + 0.3 * got, 1e-5);
}

}  // namespace

TEST(Mtp, NamesFollowDeepSeekV3AndTheMainModelIsUnchanged) {
  const Transformer plain(mtp_model(0), Device::cpu(), DType::f32, 3);
  const Transformer deep(mtp_model(2), Device::cpu(), DType::f32, 3);
  EXPECT_EQ(plain.num_mtp_modules(), 0);
  EXPECT_EQ(deep.num_mtp_modules(), 2);
  const std::vector<Variable>&a = plain.parameters(), &b = deep.parameters();
  ASSERT_GT(b.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) {  // the model's own draws come first, the same bits
    EXPECT_EQ(a[i].name(), b[i].name());
    EXPECT_TRUE(bit_equal(a[i].data(), b[i].data())) << a[i].name();
  }
  std::map<std::string, Shape> shapes;
  for (const Variable& p : b) shapes[p.name()] = p.shape();
  for (const char* layer : {"model.layers.2", "model.layers.3"}) {
    const std::string l = layer;
    EXPECT_EQ(shapes[l + ".enorm.weight"], (Shape{16}));
    EXPECT_EQ(shapes[l + ".hnorm.weight"], (Shape{16}));
    EXPECT_EQ(shapes[l + ".eh_proj.weight"], (Shape{16, 32}));
    EXPECT_EQ(shapes[l + ".shared_head.norm.weight"], (Shape{16}));
    EXPECT_EQ(shapes[l + ".self_attn.q_proj.weight"], (Shape{16, 16}));
    EXPECT_EQ(shapes[l + ".mlp.down_proj.weight"], (Shape{16, 24}));
    EXPECT_EQ(shapes[l + ".input_layernorm.weight"], (Shape{16}));
  }
  EXPECT_EQ(shapes.count("model.layers.4.enorm.weight"), 0u);
  // Stages: module k after the head's.
  EXPECT_EQ(deep.parameter_stages().back(), 2 + 1 + 2);
}

TEST(Mtp, DepthZeroLeavesTheLossesAsTheyWere) {
  const Transformer plain(mtp_model(0), Device::cpu(), DType::f32, 3);
  const Transformer deep(mtp_model(1), Device::cpu(), DType::f32, 3);
  Rng rng(5);
  const Tensor ids = rng.randint({2, 8}, 0, 40), targets = rng.randint({2, 8}, 0, 40);
  const Transformer::Losses p = plain.losses(ids, targets), d = deep.losses(ids, targets);
  EXPECT_FALSE(p.mtp.defined());
  EXPECT_TRUE(bit_equal(p.total().data(), p.lm.data()));
  EXPECT_TRUE(bit_equal(p.lm.data(), d.lm.data()));  // MTP adds a term, it does not touch the LM loss
  EXPECT_TRUE(bit_equal(plain.forward(ids).data(), deep.forward(ids).data()));
}

TEST(Mtp, LossMatchesAnF64CompositionAtDepthsOneAndTwo) {
  expect_loss_matches_reference(mtp_model(1));
  expect_loss_matches_reference(mtp_model(2));
  ModelConfig tied = mtp_model(2);
  tied.tie_word_embeddings = true;
  expect_loss_matches_reference(tied);
}

TEST(Mtp, MoeModelsGetAnMoeModule) {
  const Transformer model(mtp_model(1, /*moe=*/true), Device::cpu(), DType::f32, 3);
  EXPECT_NE(model.mtp_module(1).block().moe(), nullptr);
  EXPECT_EQ(model.num_moe_layers(), 2);   // layer 1 and the module's block
  EXPECT_EQ(model.buffers().size(), 2u);  // their expert biases
  expect_loss_matches_reference(mtp_model(1, true));
  ModelConfig last_dense = mtp_model(1, true);  // the last block dense: so is the module's
  last_dense.first_k_dense_replace = 2;
  const Transformer dense(last_dense, Device::cpu(), DType::f32, 3);
  EXPECT_EQ(dense.mtp_module(1).block().moe(), nullptr);
}

// The modules' blocks take the model's attention: MLA's (layers/mla.h) named as DeepSeek-V3 names it.
TEST(Mtp, MlaModelsGetAnMlaModule) {
  const ModelConfig c =
      with_mla(mtp_model(1, true),
               {.q_lora_rank = 8, .kv_lora_rank = 6, .qk_nope_head_dim = 4, .qk_rope_head_dim = 4, .v_head_dim = 6});
  const Transformer model(c, Device::cpu(), DType::f32, 3);
  std::map<std::string, Shape> shapes;
  for (const Variable& p : model.parameters()) shapes[p.name()] = p.data().shape();
  EXPECT_EQ(shapes.at("model.layers.2.self_attn.kv_b_proj.weight"), (Shape{2 * (4 + 6), 6}));
  EXPECT_EQ(shapes.count("model.layers.2.self_attn.k_proj.weight"), 0u);
  expect_loss_matches_reference(c);
}

TEST(Mtp, GradientsThroughAModuleMatchFiniteDifferences) {
  const Transformer model(mtp_model(1), Device::cpu(), DType::f32, 3);
  const MtpModule& m = model.mtp_module(1);
  Rng rng(9);
  const Tensor h = random_tensor(rng, {1, 5, 16}, DType::f64), e = random_tensor(rng, {1, 5, 16}, DType::f64);
  EXPECT_TRUE(
      gradcheck([&m](const std::vector<Variable>& in) { return m.forward(in[0], in[1], DType::f64).sum(); }, {h, e}));
}

TEST(Mtp, EveryParameterGetsAGradientAndEvaluationSkipsTheModules) {
  Transformer model(mtp_model(2, true), Device::cpu(), DType::f32, 3);
  model.set_mtp_loss_weight(0.3);
  Rng rng(2);
  const Tensor ids = rng.randint({2, 8}, 0, 40), targets = rng.randint({2, 8}, 0, 40);
  model.losses(ids, targets).total().backward();
  for (const Variable& p : model.parameters()) {
    if (p.name().find("gate.weight") != std::string::npos) continue;  // the router's gate: the balance loss's
    ASSERT_TRUE(p.grad().defined()) << p.name();
    double norm = 0;
    for (double g : p.grad().to_doubles()) norm += g * g;
    EXPECT_GT(norm, 0) << p.name();
  }
  NoGradGuard no_grad;
  EXPECT_FALSE(model.losses(ids, targets).mtp.defined());
}

// parallel.dual_microbatch: the two halves' MTP losses average to the batch's (the same tokens), as the LM
// loss does, and so do the gradients.
TEST(Mtp, DualMicroBatchesGiveTheBatchsMtpLoss) {
  Transformer model(mtp_model(2, true), Device::cpu(), DType::f32, 3);
  Rng rng(4);
  const Tensor ids = rng.randint({4, 8}, 0, 40), targets = rng.randint({4, 8}, 0, 40);
  const Transformer::Losses whole = model.losses(ids, targets);
  model.set_dual_microbatch(true);
  const Transformer::Losses dual = model.losses(ids, targets);
  ASSERT_TRUE(dual.mtp.defined());
  const double w = whole.mtp.data().to_doubles()[0], d = dual.mtp.data().to_doubles()[0];
  EXPECT_NEAR(d, w, 1e-6 * w);
  EXPECT_NEAR(dual.lm.data().to_doubles()[0], whole.lm.data().to_doubles()[0], 1e-6);
}

TEST(Mtp, TinyTrainingRunLearnsAndLogsTheMtpLoss) {
  const fs::path d = fresh_dir("mtp_learns");
  Config c = tiny_config(d / "run");
  apply_override(c, "model.num_nextn_predict_layers=1");
  apply_override(c, "train.steps=20");
  const TrainResult r = train(c, quiet());
  const std::vector<StepMetrics> rows = read_metrics(r.metrics_file);
  ASSERT_EQ(rows.size(), 20u);
  EXPECT_TRUE(std::isfinite(rows.front().mtp_loss));
  EXPECT_LT(rows.back().mtp_loss, rows.front().mtp_loss - 0.2);
  EXPECT_LT(rows.back().loss, rows.front().loss - 0.2);
  Config plain = tiny_config(d / "plain");
  apply_override(plain, "train.steps=2");
  const TrainResult p = train(plain, quiet());
  EXPECT_TRUE(std::isnan(read_metrics(p.metrics_file).front().mtp_loss));
  fs::remove_all(d);
}

// Two micro-batches accumulated (each loss halved) give each parameter the bits two data-parallel ranks give it
// (each rank's gradient, summed and halved): the embedding and the head, read at every depth, get one gradient
// per backward, not one per depth added to what the first micro-batch left.
TEST(Mtp, AccumulatedMicroBatchesSumAsRanksDo) {
  for (int64_t D : {0, 1, 2}) {
    ModelConfig cfg = mtp_model(D);
    Transformer model(cfg, Device::cpu(), DType::f32, 3);
    model.set_mtp_loss_weight(0.3);
    Rng rng(4);
    const Tensor ids = rng.randint({4, 8}, 0, 40), targets = rng.randint({4, 8}, 0, 40);
    const Tensor i1 = ids.slice(0, 0, 2).contiguous(), i2 = ids.slice(0, 2, 4).contiguous();
    const Tensor t1 = targets.slice(0, 0, 2).contiguous(), t2 = targets.slice(0, 2, 4).contiguous();
    for (const Variable& p : model.parameters()) p.impl()->grad = Tensor();
    scale(model.losses(i1, t1).total(), 0.5).backward();
    scale(model.losses(i2, t2).total(), 0.5).backward();
    std::vector<Tensor> acc;
    for (const Variable& p : model.parameters()) acc.push_back(p.grad().clone());
    for (const Variable& p : model.parameters()) p.impl()->grad = Tensor();
    model.losses(i1, t1).total().backward();
    std::vector<Tensor> g1;
    for (const Variable& p : model.parameters()) g1.push_back(p.grad().clone());
    for (const Variable& p : model.parameters()) p.impl()->grad = Tensor();
    model.losses(i2, t2).total().backward();
    for (size_t i = 0; i < acc.size(); ++i) {
      const Tensor sep = tensor_scale(tensor_add(g1[i], model.parameters()[i].grad()), 0.5);
      EXPECT_TRUE(bit_equal(acc[i], sep)) << "depth " << D << ": " << model.parameters()[i].name();
    }
  }
}
