// unpermute_unpad: the CPU op against a plain per-token loop, pad rows never read (NaN there stays
// out of y), round trips with permute_pad, edge cases, gradient checks, and CUDA vs CPU.
#include <cmath>
#include <numeric>
#include <random>

#include "engine/ops/unpermute.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// The routing of a permute (no payload needed): x is a [T,1] dummy.
PermuteResult route(const Tensor& idx, int num_experts, int align, int expert_offset = 0, int num_local = -1,
                    Device d = Device::cpu()) {
  return permute_pad(Variable(Tensor::zeros({idx.size(0), 1}, DType::f32, d)), idx.to(d), Variable(), num_experts,
                     align, expert_offset, num_local);
}

// Rows with NaN in every pad and tail row: unpermute must never read them.
Tensor rows_with_nan_pads(Rng& rng, const PermuteResult& p, int64_t hidden, DType dtype) {
  const int64_t num_rows = p.rows.size(0);
  std::vector<double> v = random_tensor(rng, {num_rows, hidden}, DType::f64).to_doubles();
  std::vector<bool> used(size_t(num_rows), false);
  for (int64_t r : p.row_map.to_ints())
    if (r >= 0) used[size_t(r)] = true;
  for (int64_t r = 0; r < num_rows; ++r)
    if (!used[size_t(r)])
      for (int64_t h = 0; h < hidden; ++h) v[size_t(r * hidden + h)] = NAN;
  return Tensor::from_doubles(v, {num_rows, hidden}, dtype);
}

// y[t] = sum_j prob[t,j] * rows[row_map[t,j]], in double.
Tensor reference_unpermute(const Tensor& rows, const Tensor& row_map, const Tensor& prob) {
  const int64_t num_tokens = row_map.size(0), top_k = row_map.size(1), hidden = rows.size(1);
  std::vector<double> r = rows.to_doubles(), p = prob.defined() ? prob.to_doubles() : std::vector<double>(),
                      y(size_t(num_tokens * hidden), 0.0);
  std::vector<int64_t> rm = row_map.to_ints();
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t row = rm[size_t(t * top_k + j)];
      if (row < 0) continue;
      const double w = prob.defined() ? p[size_t(t * top_k + j)] : 1.0;
      for (int64_t h = 0; h < hidden; ++h) y[size_t(t * hidden + h)] += w * r[size_t(row * hidden + h)];
    }
  return Tensor::from_doubles(y, {num_tokens, hidden});
}

struct Case {
  int64_t num_tokens;
  int top_k, num_experts, expert_offset, num_local, align;
  int64_t hidden;
};

}  // namespace

TEST(Unpermute, MatchesLoopAndNeverReadsPads) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (Case c : {Case{37, 2, 5, 0, 5, 16, 24}, Case{100, 4, 8, 0, 8, 32, 130}, Case{64, 8, 16, 0, 16, 128, 64},
                 Case{90, 4, 12, 4, 4, 16, 8}, Case{0, 2, 4, 0, 4, 16, 8}, Case{77, 1, 8, 0, 8, 16, 16},
                 Case{13, 3, 5, 0, 5, 16, 200}}) {
    SCOPED_TRACE(::testing::Message() << "T " << c.num_tokens << " k " << c.top_k << " align " << c.align << " H "
                                      << c.hidden);
    Tensor idx = random_topk(gen, c.num_tokens, c.top_k, c.num_experts);
    PermuteResult p = route(idx, c.num_experts, c.align, c.expert_offset, c.num_local);
    Tensor rows = rows_with_nan_pads(rng, p, c.hidden, DType::f32), prob = random_tensor(rng, {c.num_tokens, c.top_k});
    Variable y = unpermute_unpad(Variable(rows), p, Variable(prob));
    EXPECT_TRUE(all_close(y.data(), reference_unpermute(rows, p.row_map, prob), 1e-5, 1e-6));
    Variable y1 = unpermute_unpad(Variable(rows), p, Variable());  // no probs: weights 1
    EXPECT_TRUE(all_close(y1.data(), reference_unpermute(rows, p.row_map, Tensor()), 1e-5, 1e-6));
  }
}

TEST(Unpermute, RoundTripRestoresTokens) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  // k = 1 with no probs is an exact inverse; k = 4 with probs summing to 1 averages copies of the token.
  Tensor idx1 = random_topk(gen, 50, 1, 6), x = random_tensor(rng, {50, 20});
  PermuteResult p1 = permute_pad(Variable(x), idx1, Variable(), 6, 32);
  EXPECT_TRUE(bit_equal(unpermute_unpad(p1.rows, p1, Variable()).data(), x));
  Tensor idx4 = random_topk(gen, 50, 4, 6), quarter = Tensor::full({50, 4}, 0.25, DType::f32);
  PermuteResult p4 = permute_pad(Variable(x), idx4, Variable(quarter), 6, 16);
  EXPECT_TRUE(all_close(unpermute_unpad(p4.rows, p4, Variable(quarter)).data(), x, 1e-6, 1e-7));
}

TEST(Unpermute, EdgeCases) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  struct Edge {
    Case c;
    std::vector<int> allowed;
  };
  for (const Edge& e : {Edge{{40, 2, 6, 0, 6, 16, 8}, {0, 1, 3, 4, 5}},   // expert 2 empty
                        Edge{{300, 1, 4, 0, 4, 32, 8}, {3}},              // all tokens on one expert
                        Edge{{20, 2, 12, 0, 4, 16, 8}, {5, 6, 7, 8}}}) {  // nothing routed here: y = 0
    const Case& c = e.c;
    Tensor idx = random_topk(gen, c.num_tokens, c.top_k, c.num_experts, e.allowed);
    PermuteResult p = route(idx, c.num_experts, c.align, c.expert_offset, c.num_local);
    Tensor rows = rows_with_nan_pads(rng, p, c.hidden, DType::f32), prob = random_tensor(rng, {c.num_tokens, c.top_k});
    EXPECT_TRUE(all_close(unpermute_unpad(Variable(rows), p, Variable(prob)).data(),
                          reference_unpermute(rows, p.row_map, prob), 1e-5, 1e-6));
  }
}

TEST(Unpermute, BackwardZeroesPadRows) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  Tensor idx = random_topk(gen, 30, 3, 8);
  PermuteResult p = route(idx, 8, 16, 2, 4);
  Variable rows(random_tensor(rng, {p.rows.size(0), 5}), true), prob(random_tensor(rng, {30, 3}), true);
  Tensor dy = random_tensor(rng, {30, 5});
  unpermute_unpad(rows, p, prob).backward(dy);
  std::vector<float> g = rows.grad().to_floats(), d = dy.to_floats(), pr = prob.data().to_floats(),
                     r = rows.data().to_floats(), gp = prob.grad().to_floats();
  std::vector<int64_t> rm = p.row_map.to_ints();
  std::vector<float> want(g.size(), 0.f);
  for (int64_t i = 0; i < 90; ++i) {
    const int64_t row = rm[size_t(i)], t = i / 3;
    float dot = 0;
    for (int h = 0; h < 5; ++h) {
      if (row >= 0) want[size_t(row * 5 + h)] = pr[size_t(i)] * d[size_t(t * 5 + h)];
      if (row >= 0) dot += r[size_t(row * 5 + h)] * d[size_t(t * 5 + h)];
    }
    EXPECT_NEAR(gp[size_t(i)], dot, 1e-5) << "d_prob of token " << t << " slot " << i % 3;
  }
  EXPECT_TRUE(bit_equal(rows.grad(), Tensor::from_floats(want, {p.rows.size(0), 5})));  // pad rows exactly 0
}

TEST(Unpermute, Gradcheck) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  Tensor idx = random_topk(gen, 7, 2, 5);
  PermuteResult p = route(idx, 5, 16, 1, 3);
  Tensor rows = random_tensor(rng, {p.rows.size(0), 3}, DType::f64), prob = random_tensor(rng, {7, 2}, DType::f64);
  auto f = [&](const std::vector<Variable>& v) { return unpermute_unpad(v[0], p, v[1]); };
  EXPECT_TRUE(gradcheck(f, {rows, prob}));
  // Composition: permute, square the rows, unpermute with the same probs.
  Tensor x = random_tensor(rng, {7, 3}, DType::f64);
  auto g = [](const std::vector<Variable>& v) {
    PermuteResult q = permute_pad(v[0], v[1].data(), v[2], 5, 16);
    return unpermute_unpad(mul(q.rows, q.rows), q, v[2]);
  };
  EXPECT_TRUE(gradcheck(g, {x, idx, prob}, 1e-6, 1e-5, {0, 2}));
}

// Without probs the backward keeps only the routing and moves dy to the rows (routes to other
// ranks' experts, row_map -1, get nothing).
TEST(Unpermute, GradcheckWithoutProbs) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  Tensor idx = random_topk(gen, 9, 2, 5);
  PermuteResult p = route(idx, 5, 16, 1, 3);
  Tensor rows = random_tensor(rng, {p.rows.size(0), 3}, DType::f64);
  auto f = [&](const std::vector<Variable>& v) { return unpermute_unpad(v[0], p, Variable()); };
  EXPECT_TRUE(gradcheck(f, {rows}));
}

TEST(Unpermute, BadInputThrows) {
  Tensor idx = Tensor::from_ints({0, 1, 2, 3}, {2, 2});
  PermuteResult p = route(idx, 4, 16);
  Tensor rows = Tensor::zeros({p.rows.size(0), 4}, DType::f32), prob = Tensor::zeros({2, 2}, DType::f32);
  EXPECT_THROW(unpermute_unpad(Variable(rows), p, Variable(prob.to(DType::f64))), DTypeError);
  EXPECT_THROW(unpermute_unpad(Variable(rows), p, Variable(Tensor::zeros({2, 3}, DType::f32))), ShapeError);
  EXPECT_THROW(unpermute_unpad(Variable(rows.slice(0, 0, 10)), p, Variable(prob)), ShapeError);  // row_map past row 10
  EXPECT_THROW(unpermute_unpad(Variable(rows), p.row_map, p.tokens_per_expert, p.segment_starts, 12, Variable(prob)),
               Error);
}

// ---- CUDA ---------------------------------------------------------------------------------------

TEST(UnpermuteCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (Case c : {Case{0, 2, 4, 0, 4, 16, 64}, Case{37, 2, 5, 0, 5, 16, 100}, Case{333, 4, 16, 4, 8, 32, 37},
                 Case{5000, 1, 3, 0, 3, 64, 33}, Case{1000, 6, 64, 16, 16, 128, 7}, Case{2048, 8, 64, 0, 64, 128, 384},
                 Case{512, 8, 32, 0, 32, 16, 2048}, Case{64, 4, 8, 0, 8, 16, 4100}}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE(::testing::Message() << "T " << c.num_tokens << " k " << c.top_k << " align " << c.align << " H "
                                        << c.hidden << " " << dtype_name(dt));
      Tensor idx = random_topk(gen, c.num_tokens, c.top_k, c.num_experts);
      PermuteResult p = route(idx, c.num_experts, c.align, c.expert_offset, c.num_local);
      PermuteResult gp = route(idx, c.num_experts, c.align, c.expert_offset, c.num_local, Device::cuda());
      // Values representable in dt, so the CPU (f32) sees exactly what the GPU reads.
      Tensor rows = rows_with_nan_pads(rng, p, c.hidden, DType::f32).to(dt).to(DType::f32);
      Tensor prob = random_tensor(rng, {c.num_tokens, c.top_k});
      Tensor dy = random_tensor(rng, {c.num_tokens, c.hidden}).to(dt).to(DType::f32);

      Variable cr(rows, true), cp(prob, true);
      Variable cy = unpermute_unpad(cr, p, cp);
      cy.backward(dy);
      Variable gr(rows.to(dt).to(Device::cuda()), true), gpv(prob.to(Device::cuda()), true);
      Variable gy = unpermute_unpad(gr, gp, gpv);
      Tensor gdy = dy.to(dt).to(Device::cuda());
      {  // the next allocation of this size (d_rows) gets NaN bytes: unwritten pad rows would show
        Tensor poison = Tensor::full({int64_t(gr.data().nbytes() + 3) / 4}, NAN, DType::f32, Device::cuda());
      }
      gy.backward(gdy);
      // Same fmaf order in fp32 and one rounding: bit-identical forward and d_rows.
      EXPECT_TRUE(bit_equal(gy.data(), cy.data().to(dt)));
      Tensor want_d_rows = cr.grad().to(dt);
      EXPECT_TRUE(bit_equal(gr.grad(), want_d_rows));
      // d_prob: a tree reduction on the GPU, a sequential one on the CPU.
      EXPECT_TRUE(all_close(gpv.grad(), cp.grad(), 1e-4, 1e-4));
    }
  }
}

TEST(UnpermuteCuda, NoProbsAndPartialGradients) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  Tensor idx = random_topk(gen, 200, 2, 8);
  PermuteResult p = route(idx, 8, 32), gp = route(idx, 8, 32, 0, -1, Device::cuda());
  Tensor rows = rows_with_nan_pads(rng, p, 96, DType::f32), dy = random_tensor(rng, {200, 96});
  Tensor prob = random_tensor(rng, {200, 2});
  Variable cr(rows, true), gr(rows.to(Device::cuda()), true);
  unpermute_unpad(cr, p, Variable()).backward(dy);
  unpermute_unpad(gr, gp, Variable()).backward(dy.to(Device::cuda()));
  EXPECT_TRUE(bit_equal(gr.grad(), cr.grad()));
  Variable cp(prob, true), gpv(prob.to(Device::cuda()), true);  // only the probs want a gradient
  unpermute_unpad(Variable(rows), p, cp).backward(dy);
  unpermute_unpad(Variable(rows.to(Device::cuda())), gp, gpv).backward(dy.to(Device::cuda()));
  EXPECT_TRUE(all_close(gpv.grad(), cp.grad(), 1e-4, 1e-4));
}
