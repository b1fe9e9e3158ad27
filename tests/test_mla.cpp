// Multi-head latent attention (layers/mla.h): the layer against a hand-written f64 DeepSeek-V3 attention that
// follows transformers' DeepseekV3Attention step by step (its rope_interleave permutation and rotate_half
// included), with and without the query bottleneck; finite-difference gradients through the layer; every weight
// reached by the backward; the model's names and shapes; the errors; configs/tiny_mla.yaml training; and
// DeepSeek-V3's head widths on the GPU against the CPU.
#include <algorithm>
#include <cmath>
#include <map>

#include "config/config.h"
#include "layers/mla.h"
#include "layers/transformer.h"
#include "tests/support/checks.h"
#include "tests/support/mla_config.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

ModelConfig mla_config(int64_t q_lora_rank) {
  ModelConfig c = with_mla(
      ModelConfig{},
      {.q_lora_rank = q_lora_rank, .kv_lora_rank = 6, .qk_nope_head_dim = 4, .qk_rope_head_dim = 6, .v_head_dim = 5});
  c.hidden_size = 16;
  c.num_attention_heads = 3;
  c.rope_theta = 50.0;
  c.initializer_range = 0.3;  // large enough that the softmax is far from uniform
  c.rms_norm_eps = 0.05;      // not the latent norms' 1e-6: a layer that took this for them is caught
  return c;
}

using Weights = std::map<std::string, std::vector<double>>;

double max_abs(const Tensor& t) {
  double m = 0;
  for (double v : t.to_doubles()) m = std::max(m, std::fabs(v));
  return m;
}

// y[N, out] = x[N, in] · w[out, in]ᵀ
std::vector<double> matmul_t(const std::vector<double>& x, const std::vector<double>& w, size_t n, size_t in,
                             size_t out) {
  std::vector<double> y(n * out, 0.0);
  for (size_t r = 0; r < n; ++r)
    for (size_t o = 0; o < out; ++o)
      for (size_t j = 0; j < in; ++j) y[r * out + o] += x[r * in + j] * w[o * in + j];
  return y;
}

std::vector<double> rms_rows(const std::vector<double>& x, const std::vector<double>& w, double eps) {
  const size_t d = w.size(), n = x.size() / d;
  std::vector<double> y(x.size());
  for (size_t r = 0; r < n; ++r) {
    double ss = 0;
    for (size_t j = 0; j < d; ++j) ss += x[r * d + j] * x[r * d + j];
    const double s = 1.0 / std::sqrt(ss / double(d) + eps);
    for (size_t j = 0; j < d; ++j) y[r * d + j] = x[r * d + j] * s * w[j];
  }
  return y;
}

// transformers' apply_rotary_pos_emb_interleave on one vector at position pos: the interleaved pairs moved to
// halves (x[0], x[2], ..., x[1], x[3], ...), then x·cos + rotate_half(x)·sin with cos/sin of the frequencies
// repeated over both halves.
std::vector<double> hf_rope(const double* x, size_t d, double pos, double theta) {
  std::vector<double> h(d), out(d);
  for (size_t i = 0; i < d / 2; ++i) h[i] = x[2 * i], h[i + d / 2] = x[2 * i + 1];
  for (size_t i = 0; i < d; ++i) {
    const size_t f = i % (d / 2);
    const double angle = pos * std::pow(theta, -double(2 * f) / double(d));
    const double rot = i < d / 2 ? -h[i + d / 2] : h[i - d / 2];
    out[i] = h[i] * std::cos(angle) + rot * std::sin(angle);
  }
  return out;
}

// DeepseekV3Attention's forward for x [1, T, H] (f64), from the layer's weights.
std::vector<double> reference_mla(const ModelConfig& c, const Weights& w, const std::vector<double>& x, size_t t) {
  const size_t H = size_t(c.hidden_size), nh = size_t(c.num_attention_heads), nope = size_t(c.qk_nope_head_dim),
               rope = size_t(c.qk_rope_head_dim), vd = size_t(c.v_head_dim), kv = size_t(c.kv_lora_rank),
               qk = nope + rope;
  const std::string p = "a.self_attn.";
  std::vector<double> q;
  if (c.q_lora_rank > 0) {
    const size_t ql = size_t(c.q_lora_rank);
    q = matmul_t(rms_rows(matmul_t(x, w.at(p + "q_a_proj.weight"), t, H, ql), w.at(p + "q_a_layernorm.weight"), 1e-6),
                 w.at(p + "q_b_proj.weight"), t, ql, nh * qk);
  } else {
    q = matmul_t(x, w.at(p + "q_proj.weight"), t, H, nh * qk);
  }
  const std::vector<double> ckv = matmul_t(x, w.at(p + "kv_a_proj_with_mqa.weight"), t, H, kv + rope);
  std::vector<double> latent(t * kv), k_rot(t * rope);
  for (size_t r = 0; r < t; ++r) {
    for (size_t j = 0; j < kv; ++j) latent[r * kv + j] = ckv[r * (kv + rope) + j];
    const std::vector<double> kr = hf_rope(&ckv[r * (kv + rope) + kv], rope, double(r), c.rope_theta);
    for (size_t j = 0; j < rope; ++j) k_rot[r * rope + j] = kr[j];
  }
  const std::vector<double> kvb = matmul_t(rms_rows(latent, w.at(p + "kv_a_layernorm.weight"), 1e-6),
                                           w.at(p + "kv_b_proj.weight"), t, kv, nh * (nope + vd));
  // query_states = cat(q_pass, q_rot), key_states = cat(k_pass, k_rot expanded); scaling qk^-0.5.
  std::vector<double> o(t * nh * vd, 0.0);
  for (size_t h = 0; h < nh; ++h)
    for (size_t i = 0; i < t; ++i) {
      const double* qi = &q[(i * nh + h) * qk];
      const std::vector<double> qr = hf_rope(qi + nope, rope, double(i), c.rope_theta);
      std::vector<double> s(i + 1);
      double mx = -INFINITY;
      for (size_t j = 0; j <= i; ++j) {
        const double* kj = &kvb[(j * nh + h) * (nope + vd)];
        double dot = 0;
        for (size_t d = 0; d < nope; ++d) dot += qi[d] * kj[d];
        for (size_t d = 0; d < rope; ++d) dot += qr[d] * k_rot[j * rope + d];
        s[j] = dot / std::sqrt(double(qk));
        mx = std::max(mx, s[j]);
      }
      double z = 0;
      for (double& e : s) z += e = std::exp(e - mx);
      for (size_t j = 0; j <= i; ++j)
        for (size_t d = 0; d < vd; ++d)
          o[(i * nh + h) * vd + d] += s[j] / z * kvb[(j * nh + h) * (nope + vd) + nope + d];
    }
  return matmul_t(o, w.at(p + "o_proj.weight"), t, nh * vd, H);
}

void expect_matches_reference(int64_t q_lora_rank) {
  SCOPED_TRACE("q_lora_rank " + std::to_string(q_lora_rank));
  const ModelConfig c = mla_config(q_lora_rank);
  ParamFactory f(5, Device::cpu());
  const LatentAttention attn(f, "a.self_attn", c, 0.3, false);
  Weights w;
  for (const Variable& p : f.params()) w[p.name()] = p.data().to_doubles();
  Rng rng(3);
  const int64_t t = 7;
  const Tensor x = random_tensor(rng, {1, t, c.hidden_size}, DType::f64);
  const Tensor got = attn.forward(Variable(x), DType::f64).data();
  ASSERT_EQ(got.shape(), (Shape{1, t, c.hidden_size}));
  const Tensor want = Tensor::from_doubles(reference_mla(c, w, x.to_doubles(), size_t(t)), got.shape(), DType::f64);
  EXPECT_TRUE(all_close(got, want, 1e-10, 1e-12));
  EXPECT_GT(max_abs(got), 1e-3);  // not trivially zero
}

}  // namespace

TEST(Mla, MatchesDeepSeekV3AttentionWithTheQueryBottleneck) { expect_matches_reference(8); }
TEST(Mla, MatchesDeepSeekV3AttentionWithADirectQueryProjection) { expect_matches_reference(0); }

TEST(Mla, GradientsMatchFiniteDifferences) {
  for (int64_t q_lora_rank : {0, 8}) {
    SCOPED_TRACE(q_lora_rank);
    ParamFactory f(5, Device::cpu());
    const LatentAttention attn(f, "a.self_attn", mla_config(q_lora_rank), 0.3, false);
    Rng rng(4);
    const Tensor x = random_tensor(rng, {2, 4, 16}, DType::f64);
    EXPECT_TRUE(gradcheck([&attn](const std::vector<Variable>& in) { return attn.forward(in[0], DType::f64); }, {x}));
  }
}

TEST(Mla, EveryWeightGetsAGradient) {
  ParamFactory f(5, Device::cpu());
  const LatentAttention attn(f, "a.self_attn", mla_config(8), 0.3, false);
  Rng rng(4);
  const Variable y = attn.forward(Variable(random_tensor(rng, {2, 5, 16}, DType::f32)), DType::f32);
  sum(mul(y, y)).backward();
  ASSERT_EQ(f.params().size(), 7u);
  for (const Variable& p : f.params()) {
    ASSERT_TRUE(p.grad().defined()) << p.name();
    EXPECT_GT(max_abs(p.grad()), 0.0) << p.name();
  }
}

TEST(Mla, ModelHasDeepSeekV3NamesAndShapes) {
  ModelConfig c = mla_config(8);
  c.vocab_size = 32;
  c.num_hidden_layers = 2;
  c.intermediate_size = 24;
  c.max_position_embeddings = 16;
  const Transformer model(c, Device::cpu(), DType::f32, 1);
  std::map<std::string, Shape> shapes;
  for (const Variable& p : model.parameters()) shapes[p.name()] = p.data().shape();
  const std::string a = "model.layers.1.self_attn.";
  EXPECT_EQ(shapes.at(a + "q_a_proj.weight"), (Shape{8, 16}));
  EXPECT_EQ(shapes.at(a + "q_a_layernorm.weight"), (Shape{8}));
  EXPECT_EQ(shapes.at(a + "q_b_proj.weight"), (Shape{3 * 10, 8}));
  EXPECT_EQ(shapes.at(a + "kv_a_proj_with_mqa.weight"), (Shape{6 + 6, 16}));
  EXPECT_EQ(shapes.at(a + "kv_a_layernorm.weight"), (Shape{6}));
  EXPECT_EQ(shapes.at(a + "kv_b_proj.weight"), (Shape{3 * (4 + 5), 6}));
  EXPECT_EQ(shapes.at(a + "o_proj.weight"), (Shape{16, 3 * 5}));
  EXPECT_EQ(shapes.count(a + "k_proj.weight"), 0u);
  Rng rng(2);
  const Tensor logits = model.forward(rng.randint({2, 6}, 0, 32)).data();
  EXPECT_EQ(logits.shape(), (Shape{2, 6, 32}));
}

TEST(Mla, ErrorsNameTheLayer) {
  ModelConfig c = mla_config(8);
  c.qk_rope_head_dim = 5;
  ParamFactory f(5, Device::cpu());
  EXPECT_TRUE(throws_naming<ShapeError>([&] { LatentAttention(f, "a.self_attn", c, 0.3, false); },
                                        {"a.self_attn", "even qk_rope_head_dim"}));
  ParamFactory g(5, Device::cpu());
  const LatentAttention attn(g, "a.self_attn", mla_config(8), 0.3, false);
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        attn.forward(Variable(Tensor::zeros({1, 3, 8}, DType::f32)), DType::f32);
      },
      {"mla: input", "[B, T, 16]"}));
  ParamFactory h(5, Device::cpu());
  EXPECT_TRUE(throws_naming<ShapeError>([&] { LatentAttention(h, "a.self_attn", mla_config(8), 0.3, true); },
                                        {"q_a_proj", "128"}));
}

// DeepSeek-V3's head widths (query/key 128 + 64, values 128: the CUDA attention kernels' wide heads) on the GPU:
// the same layer and weights in bf16 against the CPU in f32, output and every gradient (input and weights), with
// and without the query bottleneck; T not a multiple of the attention kernels' tiles (T = 1 would make the query
// weights' gradients 0 in exact math, which no relative error measures: tests/test_attention.cpp covers it).
TEST(MlaCuda, DeepSeekV3HeadsMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (int64_t q_lora_rank : {0, 96})
    for (int64_t T : {77, 300}) {
      SCOPED_TRACE("q_lora_rank " + std::to_string(q_lora_rank) + " T " + std::to_string(T));
      ModelConfig c = mla_config(q_lora_rank);
      c.hidden_size = 128;
      c.num_attention_heads = 2;
      c.kv_lora_rank = 64;
      c.qk_nope_head_dim = 128;
      c.qk_rope_head_dim = 64;
      c.v_head_dim = 128;
      c.rope_theta = 10000.0;
      c.initializer_range = 0.05;
      ParamFactory fc(5, Device::cpu()), fg(5, Device::cuda());
      const LatentAttention cpu(fc, "a.self_attn", c, 0.05, false), gpu(fg, "a.self_attn", c, 0.05, false);
      const Tensor x = random_tensor(rng, {2, T, c.hidden_size}).to(DType::bf16).to(DType::f32);
      const Tensor dy = random_tensor(rng, {2, T, c.hidden_size}).to(DType::bf16).to(DType::f32);
      Variable xc(x, true), xg(x.to(Device::cuda()).to(DType::bf16), true);
      Variable yc = cpu.forward(xc, DType::f32), yg = gpu.forward(xg, DType::bf16);
      ASSERT_EQ(yg.data().shape(), yc.data().shape());
      EXPECT_LT(rel_error(yg.data(), yc.data()), 2e-2) << "y";
      yc.backward(dy);
      yg.backward(dy.to(Device::cuda()).to(DType::bf16));
      EXPECT_LT(rel_error(xg.grad(), xc.grad()), 3e-2) << "d_x";
      ASSERT_EQ(fg.params().size(), fc.params().size());
      for (size_t i = 0; i < fc.params().size(); ++i)
        EXPECT_LT(rel_error(fg.params()[i].grad(), fc.params()[i].grad()), 3e-2) << fc.params()[i].name();
    }
}

// configs/tiny_mla.yaml (MLA, MoE, shared experts, an MTP module) trains: a few CPU steps lower the loss.
TEST(Mla, TinyConfigTrainsWithTheLossFalling) {
  const fs::path out = fresh_dir("mla_tiny");
  const Config c = load_config(
      std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny_mla.yaml",
      {"train.device=cpu", "train.steps=16", "train.batch_size=4", "data.seq_len=32", "optimizer.warmup_steps=2",
       "train.eval_every=16", "checkpoint.every=16", "logging.log_every=1", "logging.out_dir=" + out.string()});
  const std::vector<StepMetrics> rows = read_metrics(train(c, quiet()).metrics_file);
  ASSERT_EQ(rows.size(), 16u);
  double first = 0, last = 0;
  for (size_t i = 0; i < 3; ++i) first += rows[i].loss, last += rows[rows.size() - 1 - i].loss;
  EXPECT_LT(last, 0.9 * first) << "the mean loss of the last 3 steps against the first 3";
  for (const StepMetrics& r : rows) EXPECT_TRUE(std::isfinite(r.loss));
  fs::remove_all(out);
}
