// Router: brute-force reference (every choice of groups enumerated) vs the CPU kernel on random
// inputs with many ties; CUDA vs CPU over edge shapes; f64 gradient checks of topk_prob and of the
// balance loss with the selection held fixed; the aux-loss-free bias update; config errors.
#include <algorithm>
#include <bit>
#include <cmath>
#include <string>
#include <tuple>

#include "engine/ops/router.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

RouterConfig make_cfg(int E, int k, int n_group, int topk_group, const std::string& scoring = "sigmoid",
                      bool norm = true, double scale = 1.0) {
  RouterConfig c;
  c.num_experts = E, c.top_k = k, c.n_group = n_group, c.topk_group = topk_group;
  c.scoring_func = parse_enum(kRouterScoringNames, scoring, "scoring_func");
  c.norm_topk_prob = norm, c.routed_scaling_factor = scale;
  return c;
}

std::string describe(const RouterConfig& c) {
  return "E=" + std::to_string(c.num_experts) + " k=" + std::to_string(c.top_k) +
         " n_group=" + std::to_string(c.n_group) + " topk_group=" + std::to_string(c.topk_group) + " " +
         enum_name(kRouterScoringNames, c.scoring_func) + (c.norm_topk_prob ? " norm" : "") +
         " scale=" + std::to_string(c.routed_scaling_factor);
}

// Values step * (i - levels/2) for i uniform in [0, levels): few distinct values, so many exact ties.
Tensor quantized(Rng& rng, const Shape& shape, double step, int levels) {
  std::vector<float> v(size_t(shape_numel(shape)));
  for (float& x : v) x = float(step * (std::floor(rng.next_uniform() * levels) - levels / 2));
  return Tensor::from_floats(v, shape);
}

// Scores as defined: sigmoid, or softmax over the row, in double and rounded to float once.
std::vector<double> ref_scores(const double* l, int E, bool softmax) {
  std::vector<double> s(static_cast<size_t>(E));
  if (!softmax) {
    for (int e = 0; e < E; ++e) s[size_t(e)] = 1.0 / (1.0 + std::exp(-l[e]));
    return s;
  }
  double m = *std::max_element(l, l + E), z = 0;
  for (int e = 0; e < E; ++e) z += s[size_t(e)] = std::exp(l[e] - m);
  for (double& v : s) v /= z;
  return s;
}

bool outranks(float a, int ia, float b, int ib) { return a > b || (a == b && ia < ib); }

struct Routing {
  std::vector<int64_t> idx, counts;
  std::vector<float> prob;
};

// Brute force: of all sets of topk_group groups, the kept one is the set whose every member outranks
// every other group (group score = sum of its two largest keys); its experts are then sorted by key
// (ties: lower index) and the first k taken.
Routing brute_force(const Tensor& logits_t, const Tensor& bias_t, const RouterConfig& c) {
  const int E = c.num_experts, k = c.top_k, gs = E / c.n_group;
  const int64_t T = logits_t.size(0);
  std::vector<double> logits = logits_t.to_doubles();
  std::vector<float> bias = bias_t.to_floats();
  Routing r;
  r.counts.assign(size_t(E), 0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> sd = ref_scores(logits.data() + t * E, E, c.scoring_func == RouterScoring::softmax);
    std::vector<float> s(static_cast<size_t>(E)), key(static_cast<size_t>(E)),
        group_score(static_cast<size_t>(c.n_group));
    for (int e = 0; e < E; ++e) s[size_t(e)] = float(sd[size_t(e)]), key[size_t(e)] = s[size_t(e)] + bias[size_t(e)];
    for (int g = 0; g < c.n_group; ++g) {
      std::vector<float> v(key.begin() + g * gs, key.begin() + (g + 1) * gs);
      std::sort(v.begin(), v.end(), std::greater<float>());
      group_score[size_t(g)] = gs >= 2 ? v[0] + v[1] : v[0];
    }
    int found = 0;
    uint32_t kept = 0;
    for (uint32_t mask = 0; mask < (1u << c.n_group); ++mask) {
      if (std::popcount(mask) != c.topk_group) continue;
      bool dominates = true;
      for (int g = 0; g < c.n_group; ++g)
        for (int h = 0; h < c.n_group; ++h)
          if ((mask >> g & 1u) && !(mask >> h & 1u) && !outranks(group_score[size_t(g)], g, group_score[size_t(h)], h))
            dominates = false;
      if (dominates) ++found, kept = mask;
    }
    EXPECT_EQ(found, 1) << "token " << t << ": the kept group set is not unique";
    std::vector<int> cand;
    for (int e = 0; e < E; ++e)
      if (kept >> (e / gs) & 1u) cand.push_back(e);
    std::sort(cand.begin(), cand.end(), [&](int a, int b) { return outranks(key[size_t(a)], a, key[size_t(b)], b); });
    float sum = 0;
    for (int j = 0; j < k; ++j) sum += s[size_t(cand[size_t(j)])];
    for (int j = 0; j < k; ++j) {
      int e = cand[size_t(j)];
      float w = s[size_t(e)];
      if (c.norm_topk_prob && k > 1) w = w / (sum + float(1e-20));
      r.idx.push_back(e);
      r.prob.push_back(w * float(c.routed_scaling_factor));
      r.counts[size_t(e)] += 1;
    }
  }
  return r;
}

::testing::AssertionResult same_ints(const std::vector<int64_t>& got, const std::vector<int64_t>& want,
                                     const char* what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << got.size() << " vs " << want.size() << " elements";
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i])
      return ::testing::AssertionFailure() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

// The input families every routing test runs: continuous, heavy ties, and one expert pulled ahead
// by a large bias (it must take every token).
struct Inputs {
  Tensor logits, bias;
  int hot = -1;  // the expert with the large bias, or -1
};
std::vector<Inputs> input_families(Rng& rng, int64_t T, int E) {
  std::vector<Inputs> v;
  v.push_back({rng.uniform({T, E}, -4, 4), rng.uniform({E}, -0.1, 0.1)});
  v.push_back({quantized(rng, {T, E}, 0.5, 5), Tensor::zeros({E}, DType::f32)});
  v.push_back({quantized(rng, {T, E}, 0.5, 3), quantized(rng, {E}, 0.125, 3)});
  std::vector<float> b(size_t(E), 0.f);
  int hot = int(rng.next_u64() % uint64_t(E));
  b[size_t(hot)] = 100.f;
  v.push_back({rng.uniform({T, E}, -4, 4), Tensor::from_floats(b, {E}), hot});
  return v;
}

const std::vector<RouterConfig>& configs() {
  static const std::vector<RouterConfig> c = {
      make_cfg(8, 2, 4, 2),
      make_cfg(8, 1, 1, 1),
      make_cfg(16, 4, 4, 2, "sigmoid", true, 2.5),
      make_cfg(64, 6, 8, 3),
      make_cfg(48, 5, 4, 2),
      make_cfg(16, 3, 16, 3),  // groups of one expert
      make_cfg(64, 4, 1, 1, "softmax"),
      make_cfg(64, 6, 8, 3, "softmax", false, 1.5),
      make_cfg(256, 8, 8, 4, "sigmoid", true, 2.5),
      make_cfg(256, 16, 16, 16),
      make_cfg(256, 8, 16, 4, "softmax"),
  };
  return c;
}

// Smallest gap between two keys or two group scores of any token: a perturbation well below it
// cannot change the selection, so finite differences stay on one branch.
double selection_margin(const Tensor& logits, const Tensor& bias, const RouterConfig& c) {
  const int E = c.num_experts, gs = E / c.n_group;
  std::vector<double> l = logits.to_doubles(), b = bias.to_doubles();
  double margin = INFINITY;
  auto min_gap = [&](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    for (size_t i = 1; i < v.size(); ++i) margin = std::min(margin, v[i] - v[i - 1]);
  };
  for (int64_t t = 0; t < logits.size(0); ++t) {
    std::vector<double> s = ref_scores(l.data() + t * E, E, c.scoring_func == RouterScoring::softmax),
                        key(static_cast<size_t>(E)), group;
    for (int e = 0; e < E; ++e) key[size_t(e)] = s[size_t(e)] + b[size_t(e)];
    for (int g = 0; g < c.n_group; ++g) {
      std::vector<double> v(key.begin() + g * gs, key.begin() + (g + 1) * gs);
      std::sort(v.rbegin(), v.rend());
      group.push_back(gs >= 2 ? v[0] + v[1] : v[0]);
    }
    min_gap(key), min_gap(group);
  }
  return margin;
}

}  // namespace

TEST(Router, ConfigErrorsNameTheKey) {
  auto expect_error = [](RouterConfig c, const char* key) {
    try {
      validate_router_config(c);
      ADD_FAILURE() << "no ConfigError for a bad " << key;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  };
  EXPECT_NO_THROW(validate_router_config(make_cfg(256, 8, 8, 4)));
  expect_error(make_cfg(0, 1, 1, 1), "n_routed_experts");
  expect_error(make_cfg(512, 8, 8, 4), "n_routed_experts");
  expect_error(make_cfg(8, 0, 1, 1), "num_experts_per_tok");
  expect_error(make_cfg(64, 17, 1, 1), "num_experts_per_tok");
  expect_error(make_cfg(8, 2, 3, 1), "n_group");
  expect_error(make_cfg(64, 2, 32, 1), "n_group");
  expect_error(make_cfg(8, 2, 4, 5), "topk_group");
  expect_error(make_cfg(8, 5, 4, 2), "num_experts_per_tok");  // only 2 groups x 2 experts are kept
  expect_error(make_cfg(8, 2, 1, 1, "sigmoid", true, 0.0), "routed_scaling_factor");
  RouterConfig c = make_cfg(8, 2, 1, 1);
  c.aux_loss_alpha = -1;
  expect_error(c, "aux_loss_alpha");
  Variable logits(Tensor::zeros({4, 8}, DType::f32));
  EXPECT_THROW(route_logits(logits, Tensor(), make_cfg(8, 2, 3, 1)), ConfigError);
  EXPECT_THROW(route_logits(logits, Tensor(), make_cfg(16, 2, 1, 1)), ShapeError);
}

TEST(Router, CpuMatchesBruteForce) {
  Rng rng(test_seed());
  for (const RouterConfig& c : configs()) {
    for (const Inputs& in : input_families(rng, c.n_group == 16 ? 24 : 61, c.num_experts)) {
      SCOPED_TRACE(describe(c) + (in.hot >= 0 ? " hot expert " + std::to_string(in.hot) : ""));
      RouterOutput r = route_logits(Variable(in.logits), in.bias, c);
      Routing want = brute_force(in.logits, in.bias, c);
      ASSERT_TRUE(same_ints(r.topk_idx.to_ints(), want.idx, "topk_idx"));
      EXPECT_TRUE(same_ints(r.tokens_per_expert.to_ints(), want.counts, "tokens_per_expert"));
      EXPECT_TRUE(all_close(r.topk_prob.data(), Tensor::from_floats(want.prob, r.topk_prob.shape()), 1e-6, 1e-7));
      if (in.hot >= 0) {  // the hot expert leads every token and takes all of them
        std::vector<int64_t> idx = r.topk_idx.to_ints();
        for (int64_t t = 0; t < in.logits.size(0); ++t) EXPECT_EQ(idx[size_t(t * c.top_k)], in.hot);
        EXPECT_EQ(r.tokens_per_expert.to_ints()[size_t(in.hot)], in.logits.size(0));
      }
    }
  }
}

TEST(Router, EmptyBatchAndThreeDimInput) {
  RouterConfig c = make_cfg(8, 2, 4, 2);
  c.aux_loss_alpha = 0.01;
  RouterOutput r = route_logits(Variable(Tensor::zeros({0, 8}, DType::f32)), Tensor(), c);
  EXPECT_EQ(r.topk_idx.shape(), Shape({0, 2}));
  EXPECT_EQ(r.topk_prob.shape(), Shape({0, 2}));
  EXPECT_TRUE(same_ints(r.tokens_per_expert.to_ints(), std::vector<int64_t>(8, 0), "tokens_per_expert"));
  ASSERT_TRUE(r.aux_loss.defined());
  EXPECT_EQ(r.aux_loss.data().to_doubles()[0], 0.0);

  // [B, S, H] input: S becomes the balance loss's sequence length.
  Rng rng(test_seed());
  Tensor x = rng.uniform({2, 3, 5}, -1, 1), w = rng.uniform({8, 5}, -1, 1);
  RouterOutput r3 = route(Variable(x), Variable(w), Tensor(), c);
  RouterConfig c2 = c;
  c2.seq_len = 3;
  RouterOutput r2 = route(Variable(x.reshape({6, 5})), Variable(w), Tensor(), c2);
  EXPECT_TRUE(same_ints(r3.topk_idx.to_ints(), r2.topk_idx.to_ints(), "topk_idx"));
  EXPECT_TRUE(all_close(r3.aux_loss.data(), r2.aux_loss.data(), 0, 0));
  c2.seq_len = 4;  // 6 tokens are not whole sequences of 4
  EXPECT_THROW(route(Variable(x.reshape({6, 5})), Variable(w), Tensor(), c2), ShapeError);
  c.aux_loss_alpha = 0;
  EXPECT_FALSE(route(Variable(x), Variable(w), Tensor(), c).aux_loss.defined());
}

TEST(Router, BalanceLossMatchesDefinition) {
  Rng rng(test_seed());
  for (const char* scoring : {"sigmoid", "softmax"}) {
    RouterConfig c = make_cfg(16, 3, 4, 2, scoring);
    c.aux_loss_alpha = 0.3, c.seq_len = 5;
    Tensor logits = rng.uniform({15, 16}, -2, 2);
    RouterOutput r = route_logits(Variable(logits), Tensor(), c);
    std::vector<double> l = logits.to_doubles();
    std::vector<int64_t> idx = r.topk_idx.to_ints();
    double total = 0;
    for (int b = 0; b < 3; ++b) {
      std::vector<double> f(16, 0), P(16, 0);
      for (int t = b * 5; t < b * 5 + 5; ++t) {
        std::vector<double> s = ref_scores(l.data() + t * 16, 16, std::string(scoring) == "softmax");
        double z = 0;
        for (double v : s) z += v;
        for (int e = 0; e < 16; ++e) P[size_t(e)] += s[size_t(e)] / z / 5;
        for (int j = 0; j < 3; ++j) f[size_t(idx[size_t(t * 3 + j)])] += 16.0 / (3 * 5);
      }
      for (int e = 0; e < 16; ++e) total += f[size_t(e)] * P[size_t(e)];
    }
    EXPECT_NEAR(r.aux_loss.data().to_doubles()[0], 0.3 * total / 3, 1e-6) << scoring;
  }
}

TEST(Router, Gradcheck) {
  Rng rng(test_seed());
  struct Case {
    RouterConfig cfg;
    double alpha;
  };
  std::vector<Case> cases = {
      {make_cfg(8, 3, 4, 2, "sigmoid", true, 2.5), 0},
      {make_cfg(8, 2, 1, 1, "softmax", false, 1.5), 0},
      {make_cfg(8, 1, 2, 1), 0},
      {make_cfg(12, 4, 3, 2, "softmax", true, 1.0), 0},
      {make_cfg(8, 3, 4, 2, "sigmoid", true, 2.5), 0.3},
      {make_cfg(8, 2, 2, 1, "softmax"), 0.3},
  };
  const int64_t T = 6, H = 5;
  for (Case cs : cases) {
    RouterConfig c = cs.cfg;
    c.aux_loss_alpha = cs.alpha, c.seq_len = 3;
    SCOPED_TRACE(describe(c) + " alpha=" + std::to_string(cs.alpha));
    const int E = c.num_experts;
    Tensor bias = rng.uniform({E}, -0.05, 0.05), x, w, logits;
    for (int tries = 0;; ++tries) {  // inputs whose selection a 1e-6 perturbation cannot flip
      ASSERT_LT(tries, 1000) << "no input with a clear selection margin";
      x = rng.uniform({T, H}, -1, 1, DType::f64), w = rng.uniform({E, H}, -1, 1, DType::f64);
      NoGradGuard ng;
      logits = linear(Variable(x), Variable(w)).data();
      if (selection_margin(logits, bias, c) > 1e-4) break;
    }
    auto out = [&](const RouterOutput& r) { return cs.alpha > 0 ? r.aux_loss : r.topk_prob; };
    EXPECT_TRUE(gradcheck([&](const std::vector<Variable>& v) { return out(route_logits(v[0], bias, c)); }, {logits}));
    EXPECT_TRUE(gradcheck([&](const std::vector<Variable>& v) { return out(route(v[0], v[1], bias, c)); }, {x, w}));
  }
}

// Both rules on the same loads: sign moves each bias by ±rate (bit-exact), proportional by
// rate * (mean - load) / mean (to within the f32 spacing of the biases, 6e-8).
TEST(Router, BiasUpdateMovesTowardMeanLoad) {
  const double rate = 0.001;
  struct Case {
    std::vector<int64_t> counts;
    std::vector<double> error;  // (mean - load) / mean of each expert; sign gives the sign step
  };
  std::vector<Case> cases = {
      {{5, 1, 3, 3}, {-2.0 / 3, 2.0 / 3, 0, 0}},  // mean 3: overloaded down, underloaded up, equal unchanged
      {{2, 1, 0}, {-1, 0, 1}},                    // mean 1: an idle expert moves by the full rate
      {{1, 2}, {1.0 / 3, -1.0 / 3}},              // mean 1.5: nobody equals it
      {{12, 0, 0, 0}, {-3, 1, 1, 1}},             // one hot expert: proportional is not clamped
      {{0, 0, 0, 0}, {0, 0, 0, 0}},               // no tokens: nothing moves
      {{7, 7, 7}, {0, 0, 0}},
  };
  Rng rng(test_seed());
  for (const Case& c : cases) {
    int64_t E = int64_t(c.counts.size());
    Tensor counts = Tensor::from_ints(c.counts, {E}), bias = rng.uniform({E}, -0.5, 0.5);
    std::vector<float> before = bias.to_floats(), want(static_cast<size_t>(E));
    for (size_t e = 0; e < size_t(E); ++e)
      want[e] = before[e] + float(rate) * float((c.error[e] > 0) - (c.error[e] < 0));
    update_expert_bias(bias, counts, rate);
    EXPECT_TRUE(bit_equal(bias, Tensor::from_floats(want, {E})));
    Tensor prop = Tensor::from_floats(before, {E});
    update_expert_bias(prop, counts, rate, BiasUpdateRule::proportional);
    std::vector<float> after = prop.to_floats();
    for (size_t e = 0; e < size_t(E); ++e)
      EXPECT_NEAR(after[e] - before[e], rate * c.error[e], 1e-7) << "proportional, expert " << e;
  }
  Tensor total = Tensor::from_ints({1, 2, 3}, {3}), more = Tensor::from_ints({10, 0, 5}, {3});
  add_tokens_per_expert(total, more);
  EXPECT_TRUE(same_ints(total.to_ints(), {11, 2, 8}, "add_tokens_per_expert"));
  Tensor f = Tensor::zeros({3}, DType::f32);
  EXPECT_THROW(update_expert_bias(f, Tensor::zeros({3}, DType::f32), rate), DTypeError);
  EXPECT_THROW(update_expert_bias(f, Tensor::zeros({4}, DType::i32), rate), ShapeError);
}

// Routing a fixed skewed batch again and again with the bias update in between balances the load.
static void balance_loop(Device d, BiasUpdateRule rule, double rate) {
  Rng rng(test_seed());
  const int64_t T = 512;
  const int E = 8;
  std::vector<float> l = rng.uniform({T, E}, -1, 1).to_floats();
  for (int64_t t = 0; t < T; ++t) l[size_t(t * E)] += 3, l[size_t(t * E + 1)] += 3;  // experts 0, 1 are hot
  Tensor logits = Tensor::from_floats(l, {T, E}).to(d), bias = Tensor::zeros({E}, DType::f32, d);
  RouterConfig c = make_cfg(E, 2, 1, 1);
  NoGradGuard ng;
  LoadStats first = load_stats(route_logits(Variable(logits), bias, c).tokens_per_expert);
  EXPECT_EQ(first.total, T * 2);
  EXPECT_EQ(first.max_load, T);
  EXPECT_DOUBLE_EQ(first.max_over_mean, 4.0);
  for (int step = 0; step < 800; ++step)  // ~200 steps close the gap; then it oscillates by about the rate
    update_expert_bias(bias, route_logits(Variable(logits), bias, c).tokens_per_expert, rate, rule);
  LoadStats last = load_stats(route_logits(Variable(logits), bias, c).tokens_per_expert);
  EXPECT_LT(last.max_over_mean, 1.2) << "max " << last.max_load << " min " << last.min_load;
  std::vector<float> b = bias.to_floats();
  for (int e = 2; e < E; ++e) EXPECT_LT(std::max(b[0], b[1]), b[size_t(e)] - 0.2f) << "the hot experts sit lowest";
}

TEST(Router, BiasUpdateBalancesLoad) {
  balance_loop(Device::cpu(), BiasUpdateRule::sign, 0.001);
  balance_loop(Device::cpu(), BiasUpdateRule::proportional, 0.001);
}

// ---- CUDA vs CPU ------------------------------------------------------------------------------

TEST(RouterCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (const RouterConfig& c : configs()) {
    for (int64_t T : {0, 1, 37, 4096}) {
      for (const Inputs& in : input_families(rng, T, c.num_experts)) {
        SCOPED_TRACE(describe(c) + " T=" + std::to_string(T) + (in.hot >= 0 ? " hot" : ""));
        RouterOutput cpu = route_logits(Variable(in.logits), in.bias, c);
        RouterOutput gpu = route_logits(Variable(in.logits.to(Device::cuda())), in.bias.to(Device::cuda()), c);
        ASSERT_TRUE(same_ints(gpu.topk_idx.to_ints(), cpu.topk_idx.to_ints(), "topk_idx"));
        EXPECT_TRUE(same_ints(gpu.tokens_per_expert.to_ints(), cpu.tokens_per_expert.to_ints(), "tokens_per_expert"));
        EXPECT_TRUE(all_close(gpu.topk_prob.data(), cpu.topk_prob.data(), 1e-6, 1e-7));
      }
    }
  }
}

TEST(RouterCuda, BackwardMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (const RouterConfig& base : configs()) {
    for (int64_t T : {0, 1, 300}) {
      RouterConfig c = base;
      c.aux_loss_alpha = 0.01, c.seq_len = T == 300 ? 50 : 0;
      SCOPED_TRACE(describe(c) + " T=" + std::to_string(T));
      Tensor logits = rng.uniform({T, c.num_experts}, -3, 3), bias = rng.uniform({c.num_experts}, -0.1, 0.1);
      Tensor d_prob = rng.uniform({T, c.top_k}, -1, 1);
      auto run = [&](Device d) {
        Variable lg(logits.to(d), true);
        RouterOutput r = route_logits(lg, bias.to(d), c);
        backward({r.topk_prob, r.aux_loss}, {d_prob.to(d), Tensor::full({}, 1.0, DType::f32, d)});
        Tensor grad = lg.grad().defined() ? lg.grad() : Tensor::zeros(logits.shape(), DType::f32, d);
        return std::make_tuple(r.topk_idx.to(Device::cpu()), r.aux_loss.data().to(Device::cpu()),
                               grad.to(Device::cpu()));
      };
      auto [cpu_idx, cpu_loss, cpu_grad] = run(Device::cpu());
      auto [gpu_idx, gpu_loss, gpu_grad] = run(Device::cuda());
      ASSERT_TRUE(same_ints(gpu_idx.to_ints(), cpu_idx.to_ints(), "topk_idx"));
      EXPECT_TRUE(all_close(gpu_loss, cpu_loss, 1e-5, 1e-9));
      EXPECT_TRUE(all_close(gpu_grad, cpu_grad, 1e-4, 1e-7));
    }
  }
}

TEST(RouterCuda, BiasUpdateMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (int E : {1, 8, 64, 256, 1000}) {
    SCOPED_TRACE(E);
    Tensor counts = rng.randint({E}, 0, 5), bias = rng.uniform({E}, -1, 1);
    for (BiasUpdateRule rule : {BiasUpdateRule::sign, BiasUpdateRule::proportional}) {
      Tensor gpu_bias = bias.to(Device::cuda());
      update_expert_bias(bias, counts, 0.001, rule);
      update_expert_bias(gpu_bias, counts.to(Device::cuda()), 0.001, rule);
      EXPECT_TRUE(bit_equal(gpu_bias, bias)) << "rule " << int(rule);
    }
    Tensor total = rng.randint({E}, 0, 100), gpu_total = total.to(Device::cuda());
    add_tokens_per_expert(total, counts);
    add_tokens_per_expert(gpu_total, counts.to(Device::cuda()));
    EXPECT_TRUE(bit_equal(gpu_total, total));
  }
}

TEST(RouterCuda, BiasUpdateBalancesLoad) {
  FLOWMOE_REQUIRE_CUDA();
  balance_loop(Device::cuda(), BiasUpdateRule::sign, 0.001);
  balance_loop(Device::cuda(), BiasUpdateRule::proportional, 0.001);
}
