// The BF16 MoE block end to end (layers/moe.cpp): against a plain per-token loop, finite
// differences of its weight gradients, CUDA vs CPU, and a small MoE model that trains, balances
// its load and resumes bit for bit.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>

#include "engine/ops/router.h"
#include "layers/moe.h"
#include "tests/support/checks.h"
#include "tests/support/moe_config.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// Weights large enough (std 0.2) that every term matters in the comparisons.
ModelConfig moe_config(int64_t E, int64_t k, int64_t H, int64_t F, int64_t groups, int64_t topk_group, int64_t shared) {
  return moe_test_config(E, k, H, F, shared, 0.2, groups, topk_group);
}

double silu_d(double v) { return v / (1.0 + std::exp(-v)); }

// y[t] = sum_j p[t,j] * W2[e] · (silu(W1g[e] x_t) * (W1u[e] x_t)) + shared(x_t), in double, from
// the layer's own parameters (order: gate, fc1, fc2, then the shared MLP's gate/up/down).
std::vector<double> reference_forward(const std::vector<Variable>& params, const Tensor& x, const RouterOutput& r,
                                      int64_t H, int64_t F, int64_t shared_f) {
  const int64_t T = x.size(0), k = r.topk_idx.size(1);
  auto xs = x.to_doubles(), w1 = params[1].data().to_doubles(), w2 = params[2].data().to_doubles();
  auto idx = r.topk_idx.to_ints();
  auto prob = r.topk_prob.data().to_doubles();
  std::vector<double> y(size_t(T * H), 0.0);
  auto mlp_add = [&](const double* xt, const double* wg, const double* wu, const double* wd, int64_t width,
                     double scale, double* yt) {
    for (int64_t f = 0; f < width; ++f) {
      double g = 0, u = 0;
      for (int64_t h = 0; h < H; ++h) g += wg[f * H + h] * xt[h], u += wu[f * H + h] * xt[h];
      double a = silu_d(g) * u;
      for (int64_t h = 0; h < H; ++h) yt[h] += scale * wd[h * width + f] * a;
    }
  };
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      int64_t e = idx[size_t(t * k + j)];
      const double* base1 = w1.data() + e * 2 * F * H;
      mlp_add(&xs[size_t(t * H)], base1, base1 + F * H, w2.data() + e * H * F, F, prob[size_t(t * k + j)],
              &y[size_t(t * H)]);
    }
    if (shared_f > 0) {
      auto g = params[3].data().to_doubles(), u = params[4].data().to_doubles(), d = params[5].data().to_doubles();
      mlp_add(&xs[size_t(t * H)], g.data(), u.data(), d.data(), shared_f, 1.0, &y[size_t(t * H)]);
    }
  }
  return y;
}

}  // namespace

TEST(MoeLayer, MatchesPerTokenLoopReference) {
  Rng rng(test_seed());
  struct Case {
    int64_t E, k, H, F, groups, topk_group, shared, T;
    int align;
  };
  for (Case cs : {Case{4, 2, 24, 16, 1, 1, 1, 37, 16}, Case{8, 1, 16, 8, 2, 1, 0, 5, 32},
                  Case{8, 3, 20, 12, 4, 2, 2, 64, 128}, Case{4, 2, 16, 8, 1, 1, 1, 0, 16}}) {
    SCOPED_TRACE("E=" + std::to_string(cs.E) + " k=" + std::to_string(cs.k) + " T=" + std::to_string(cs.T));
    ModelConfig c = moe_config(cs.E, cs.k, cs.H, cs.F, cs.groups, cs.topk_group, cs.shared);
    ParamFactory f(test_seed(), Device::cpu());
    MoeLayer layer(f, c, "mlp", MoeOptions(cs.align), Device::cpu());
    Tensor x = random_tensor(rng, {cs.T, cs.H});
    Variable y = layer.forward(Variable(x), DType::f32);
    RouterOutput r = route(Variable(x), f.params()[0], layer.expert_bias().data(), router_config(c));
    std::vector<double> ref = reference_forward(f.params(), x, r, cs.H, cs.F, cs.F * cs.shared);
    EXPECT_TRUE(all_close(y.data(), Tensor::from_doubles(ref, {cs.T, cs.H}), 1e-4, 1e-5));
  }
}

// Finite differences (f32, a projection of the output) of the weight gradients. Perturbing the
// expert weights never changes the routing; a router-weight probe whose perturbation changes the
// top-k selection is skipped (the selection is not differentiable), as the router's own tests do.
TEST(MoeLayer, WeightGradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  ModelConfig c = moe_config(4, 2, 16, 8, 1, 1, 1);
  ParamFactory f(test_seed() + 1, Device::cpu());
  MoeLayer layer(f, c, "mlp", MoeOptions(16), Device::cpu());
  Tensor x = random_tensor(rng, {23, 16});
  Tensor proj = random_tensor(rng, {23, 16});
  auto objective = [&] {
    NoGradGuard ng;
    auto y = layer.forward(Variable(x), DType::f32).data().to_doubles();
    auto p = proj.to_doubles();
    double s = 0;
    for (size_t i = 0; i < y.size(); ++i) s += y[i] * p[i];
    return s;
  };
  auto selection = [&] {
    NoGradGuard ng;
    return route(Variable(x), f.params()[0], layer.expert_bias().data(), router_config(c)).topk_idx.to_ints();
  };
  const std::vector<int64_t> chosen = selection();
  layer.forward(Variable(x), DType::f32).backward(proj);
  for (const Variable& w : f.params()) {
    SCOPED_TRACE(w.name());
    ASSERT_TRUE(w.grad().defined());
    auto g = w.grad().to_doubles();
    float* pw = w.data().data<float>();
    int checked = 0;
    for (int attempt = 0; attempt < 200 && checked < 6; ++attempt) {
      int64_t i = int64_t(rng.next_u64() % uint64_t(w.data().numel()));
      const float orig = pw[i], eps = 1e-2f;
      pw[i] = orig + eps;
      double lp = objective();
      bool same = selection() == chosen;
      pw[i] = orig - eps;
      double lm = objective();
      same = same && selection() == chosen;
      pw[i] = orig;
      if (!same) continue;
      double numeric = (lp - lm) / (2.0 * double(eps));
      EXPECT_NEAR(g[size_t(i)], numeric, 2e-3 + 2e-2 * std::fabs(numeric)) << "element " << i;
      ++checked;
    }
    EXPECT_EQ(checked, 6) << "too few probes kept the routing fixed";
  }
}

// The same layer and weights on the GPU (bf16 compute, f32 masters) against the CPU in f32.
// x is bf16-representable, and inputs are redrawn until both devices route identically (their
// fp32 logits may differ in the last bit, which can flip a near-tie).
TEST(MoeLayerCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (int64_t T : {0, 1, 100, 1000}) {
    SCOPED_TRACE("T=" + std::to_string(T));
    ModelConfig c = moe_config(8, 2, 64, 32, 2, 2, 1);
    ParamFactory fc(7, Device::cpu()), fg(7, Device::cuda());
    MoeLayer cpu(fc, c, "mlp", MoeOptions(16), Device::cpu()), gpu(fg, c, "mlp", MoeOptions(16), Device::cuda());
    Tensor x;
    for (int attempt = 0; attempt < 5; ++attempt) {
      x = random_tensor(rng, {T, 64}).to(DType::bf16).to(DType::f32);
      RouterOutput rc = route(Variable(x), fc.params()[0], cpu.expert_bias().data(), router_config(c));
      RouterOutput rg =
          route(Variable(x.to(Device::cuda())), fg.params()[0], gpu.expert_bias().data(), router_config(c));
      if (rc.topk_idx.to_ints() == rg.topk_idx.to_ints()) break;
    }
    Tensor dy = random_tensor(rng, {T, 64});
    Variable xc(x, true), xg(x.to(Device::cuda()).to(DType::bf16), true);
    Variable yc = cpu.forward(xc, DType::f32), yg = gpu.forward(xg, DType::bf16);
    EXPECT_EQ(yg.dtype(), DType::bf16);
    EXPECT_LT(rel_error(yg.data(), yc.data()), 2e-2);
    yc.backward(dy);
    yg.backward(dy.to(Device::cuda()).to(DType::bf16));
    if (T == 0) continue;
    EXPECT_LT(rel_error(xg.grad(), xc.grad()), 3e-2) << "d_x";
    // Parameter 0 is the router gate: with one token its gradient is a difference of nearly equal
    // products (the top-k probs are normalized), so bf16 rounding moves it by more than 3%. Larger T
    // compare it.
    for (size_t i = T == 1 ? 1 : 0; i < fc.params().size(); ++i)
      EXPECT_LT(rel_error(fg.params()[i].grad(), fc.params()[i].grad()), 3e-2) << fc.params()[i].name();
  }
}

// A 3-layer model with two MoE layers learns on the CPU, reports per-layer load, keeps its load
// near balance with the bias on, and resumes bit for bit (the expert biases are in the checkpoint).
namespace {
Config tiny_moe(const fs::path& out, int64_t steps, int64_t warmup = 3) {
  Config c = parse_config(
      "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 3, num_attention_heads: 2,"
      " intermediate_size: 64, max_position_embeddings: 16, first_k_dense_replace: 1, n_routed_experts: 8,"
      " num_experts_per_tok: 2, moe_intermediate_size: 16, n_group: 2, topk_group: 2, n_shared_experts: 1,"
      " bias_update_rate: 0.01}\n"
      "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.1}\n"
      "train: {device: cpu, steps: " +
          std::to_string(steps) +
          ", batch_size: 8, eval_every: 0, eval_batches: 2}\n"
          "optimizer: {lr: 0.01, min_lr: 0.001, warmup_steps: " +
          std::to_string(warmup) +
          "}\n"
          "checkpoint: {every: 10, keep_last: 2}\n"
          "logging: {progress: plain}\n",
      "tiny_moe_test.yaml");
  c.logging.out_dir = out.string();
  return c;
}
bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }
// The expert biases (<layer>.mlp.gate.e_score_correction_bias) a checkpoint holds, in layer order.
std::vector<NamedTensor> saved_expert_biases(const std::string& checkpoint) {
  std::vector<NamedTensor> biases;
  for (NamedTensor& t : read_safetensors(checkpoint + "/model.safetensors"))
    if (t.name.find("e_score_correction_bias") != std::string::npos) biases.push_back(std::move(t));
  return biases;
}
}  // namespace

// optimizer.router_lr_scale reaches exactly the routers of a real model (one per MoE layer), and a
// model without MoE layers refuses it, naming the key.
TEST(MoeModel, RouterLrScaleFindsEveryRouter) {
  Config c = tiny_moe(fs::temp_directory_path() / "unused", 2, 1);
  Transformer model(c.model, Device::cpu(), DType::f32, 1);
  EXPECT_EQ(AdamW(model.parameters(), c.optimizer).num_router_params(), 2);
  fs::path d = fresh_dir("router_lr");
  Config dense = tiny_moe(d, 2, 1);
  dense.model.first_k_dense_replace = 3;
  dense.optimizer.router_lr_scale = 0.5;
  EXPECT_TRUE(throws_naming<ConfigError>([&] { train(dense, quiet()); }, {"optimizer.router_lr_scale"}));
  fs::remove_all(d);
}

TEST(MoeModel, TrainsBalancesAndResumesExactly) {
  fs::path d = fresh_dir("moe");
  TrainResult a = train(tiny_moe(d / "straight", 20), quiet());
  ASSERT_EQ(a.losses.size(), 20u);
  EXPECT_LT(a.losses.back(), 0.8 * a.losses.front());

  // Per-layer load in the metrics: one value per MoE layer on every row.
  std::vector<StepMetrics> rows = read_metrics(a.metrics_file);
  ASSERT_EQ(rows.size(), 20u);
  for (const StepMetrics& m : rows) EXPECT_EQ(m.moe_max_over_mean.size(), 2u) << "step " << m.step;

  Config split = tiny_moe(d / "split", 20);
  TrainOptions stop = quiet();
  stop.stop_after = 10;
  TrainResult b = train(split, stop);
  split.checkpoint.resume = "true";
  TrainResult c = train(split, quiet());
  ASSERT_EQ(b.losses.size() + c.losses.size(), 20u);
  for (size_t i = 0; i < 20; ++i) {
    double r = i < 10 ? b.losses[i] : c.losses[i - 10];
    EXPECT_TRUE(same_bits(a.losses[i], r)) << "step " << i + 1 << ": " << a.losses[i] << " vs " << r;
  }
  fs::remove_all(d);
}

// The metrics report the language-model loss alone and the balance loss beside it: the first step's
// loss (taken before any update) is the same with aux_loss_alpha on or off.
TEST(MoeModel, BalanceLossIsLoggedApartFromTheLmLoss) {
  fs::path d = fresh_dir("moe_aux");
  Config off = tiny_moe(d / "off", 1, 1), on = tiny_moe(d / "on", 1, 1);
  on.model.aux_loss_alpha = 0.1;
  TrainResult a = train(off, quiet()), b = train(on, quiet());
  ASSERT_EQ(a.losses.size(), 1u);
  ASSERT_EQ(b.losses.size(), 1u);
  EXPECT_TRUE(same_bits(a.losses[0], b.losses[0])) << a.losses[0] << " vs " << b.losses[0];
  std::vector<StepMetrics> rows_off = read_metrics(a.metrics_file), rows_on = read_metrics(b.metrics_file);
  ASSERT_EQ(rows_on.size(), 1u);
  EXPECT_TRUE(std::isnan(rows_off.at(0).aux_loss));
  // alpha * L_Bal over 2 MoE layers; L_Bal is about 1 near balance and at most E / k.
  EXPECT_GT(rows_on[0].aux_loss, 0.0);
  EXPECT_LT(rows_on[0].aux_loss, 0.1 * 2 * 8 / 2);
  fs::remove_all(d);
}

// bias_update_rule: proportional reaches the layers: after one step each bias is
// rate * (mean - load) / mean, so a layer's biases sum to zero and its lowest one is
// rate * (1 - max/mean), with max/mean read from the metrics (4 significant digits).
TEST(MoeModel, ProportionalBiasStepFollowsTheLoadError) {
  fs::path d = fresh_dir("moe_prop");
  for (const std::string format : {"jsonl", "csv"}) {  // both metrics formats carry the per-layer loads
    SCOPED_TRACE(format);
    Config c = tiny_moe(d / format, 1, 1);
    c.model.bias_update_rule = BiasUpdateRule::proportional;
    c.checkpoint.every = 1;
    c.logging.metrics_format = parse_enum(kMetricsFormatNames, format, "logging.metrics_format");
    TrainResult r = train(c, quiet());
    std::vector<StepMetrics> rows = read_metrics(r.metrics_file);
    ASSERT_EQ(rows.size(), 1u);
    ASSERT_EQ(rows[0].moe_max_over_mean.size(), 2u);
    const double rate = c.model.bias_update_rate;
    int layer = 0;
    for (const NamedTensor& t : saved_expert_biases(r.last_checkpoint)) {
      std::vector<double> b = t.tensor.to_doubles();
      double sum = 0;
      for (double v : b) sum += v;
      EXPECT_NEAR(sum, 0.0, 1e-7) << t.name;
      const double max_over_mean = rows[0].moe_max_over_mean[size_t(layer)];
      EXPECT_GT(max_over_mean, 1.0);
      EXPECT_NEAR(*std::min_element(b.begin(), b.end()), rate * (1 - max_over_mean), 1e-5) << t.name;
      ++layer;
    }
    EXPECT_EQ(layer, 2);
  }
  fs::remove_all(d);
}

// bias_update_schedule scales each step's bias move: constant by 1, lr by lr(step) / optimizer.lr.
// Three steps, warmup 2: lr(1..3) = lr/2, lr, min_lr = lr/10, so both the warmup and the decay show.
// Each bias is a sum of one signed step per update (0 where the load was exactly the mean), so it
// must be reachable with its own schedule's scales, and some bias out of reach of the other's.
TEST(MoeModel, BiasStepFollowsItsSchedule) {
  fs::path d = fresh_dir("moe_sched");
  const std::map<std::string, std::vector<double>> scales = {{"constant", {1, 1, 1}}, {"lr", {0.5, 1, 0.1}}};
  auto reachable = [](double b, double rate, const std::vector<double>& s) {
    for (int i : {-1, 0, 1})
      for (int j : {-1, 0, 1})
        for (int k : {-1, 0, 1})
          if (std::abs(b - rate * (i * s[0] + j * s[1] + k * s[2])) < 1e-6) return true;
    return false;
  };
  for (const auto& [schedule, own] : scales) {
    SCOPED_TRACE(schedule);
    Config c = tiny_moe(d / schedule, 3, 2);
    ASSERT_DOUBLE_EQ(c.optimizer.min_lr, c.optimizer.lr / 10);
    c.model.bias_update_schedule = parse_enum(kBiasUpdateScheduleNames, schedule, "model.bias_update_schedule");
    c.checkpoint.every = 3;
    TrainResult r = train(c, quiet());
    const double rate = c.model.bias_update_rate;
    std::map<std::string, int> out_of_reach;  // other schedule -> biases it cannot reach
    int num_biases = 0;
    for (const NamedTensor& t : saved_expert_biases(r.last_checkpoint)) {
      for (double b : t.tensor.to_doubles()) {
        EXPECT_TRUE(reachable(b, rate, own)) << t.name << " = " << b;
        for (const auto& [other, s] : scales) out_of_reach[other] += !reachable(b, rate, s);
        ++num_biases;
      }
    }
    EXPECT_EQ(num_biases, 2 * 8);  // two MoE layers of 8 experts
    for (const auto& [other, n] : out_of_reach) {
      if (other == schedule) continue;
      EXPECT_GT(n, 0) << "no bias tells " << schedule << " from " << other;
    }
  }
  fs::remove_all(d);
}
