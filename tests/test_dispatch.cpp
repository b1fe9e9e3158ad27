// dispatch and combine (parallel/dispatch.h) at expert-parallel size 1: they hand their tensors back
// without a copy, their backward passes gradients through, and combine's FP8 backward quantizes dy
// once (one counted cast) into rowwise 1x128 FP8 that unpermute's backward moves as bytes. Rows hold
// their token id, so a wrong row is named.
#include <gtest/gtest.h>

#include <random>

#include "engine/cast_stats.h"
#include "engine/ops/ops.h"
#include "engine/ops/permute.h"
#include "engine/ops/quantize.h"
#include "engine/ops/unpermute.h"
#include "parallel/dispatch.h"
#include "test_util.h"

namespace flowmoe {
namespace {

using test::all_close;
using test::bit_equal;
using test::random_tensor;
using test::random_topk;
using test::test_seed;

// x[t, h] = t + h / 1000: each row names its token.
Tensor token_rows(int64_t num_tokens, int64_t hidden, DType dtype, Device device) {
  std::vector<float> v(size_t(num_tokens * hidden));
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) v[size_t(t * hidden + h)] = float(t) + float(h) / 1000.f;
  return Tensor::from_floats(v, {num_tokens, hidden}, dtype).to(device);
}

void check_pass_through(Device device) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (int64_t num_tokens : {0, 1, 37}) {
    SCOPED_TRACE("tokens " + std::to_string(num_tokens));
    Variable x(token_rows(num_tokens, 256, DType::f32, device), true);
    Tensor idx = random_topk(gen, num_tokens, 2, 4).to(device);
    Variable prob(random_tensor(rng, {num_tokens, 2}, DType::f32, device), true);
    Dispatched d = dispatch(x, idx, prob, 4);
    EXPECT_EQ(d.tokens.data().raw_data(), x.data().raw_data()) << "dispatch copied the tokens";
    EXPECT_EQ(d.topk_prob.data().raw_data(), prob.data().raw_data()) << "dispatch copied the probs";
    EXPECT_EQ(d.topk_idx.raw_data(), idx.raw_data());
    EXPECT_EQ(d.expert_offset, 0);
    EXPECT_EQ(d.num_local_experts, -1);
    Variable y = combine(d.tokens, d, CombineGrad::as_is);
    EXPECT_EQ(y.data().raw_data(), x.data().raw_data()) << "combine copied its input";
    // Backward: the gradients come back as they went in.
    Tensor dy = random_tensor(rng, {num_tokens, 256}, DType::f32, device);
    Tensor dp = random_tensor(rng, {num_tokens, 2}, DType::f32, device);
    backward({y, d.topk_prob}, {dy, dp});
    EXPECT_TRUE(bit_equal(x.grad().to(Device::cpu()), dy.to(Device::cpu())));
    EXPECT_TRUE(bit_equal(prob.grad().to(Device::cpu()), dp.to(Device::cpu())));
  }
}

TEST(Dispatch, PassesThroughAtSizeOne) { check_pass_through(Device::cpu()); }

TEST(Dispatch, WithoutProbsGivesNone) {
  Variable x(token_rows(5, 8, DType::f32, Device::cpu()));
  Dispatched d = dispatch(x, Tensor::zeros({5, 1}, DType::i32), Variable(), 2);
  EXPECT_FALSE(d.topk_prob.defined());
}

TEST(Dispatch, BadShapesThrowNamingThem) {
  Variable x(token_rows(5, 8, DType::f32, Device::cpu()));
  EXPECT_TRUE(test::throws_naming<ShapeError>([&] { dispatch(x, Tensor::zeros({4, 2}, DType::i32), Variable(), 4); },
                                              {"topk_idx", "[5, k]"}));
  Dispatched d = dispatch(x, Tensor::zeros({5, 2}, DType::i32), Variable(), 4);
  Variable wrong(token_rows(6, 8, DType::f32, Device::cpu()));
  EXPECT_TRUE(test::throws_naming<ShapeError>([&] { combine(wrong, d, CombineGrad::as_is); }, {"combine", "[5, H]"}));
}

TEST(Dispatch, Gradcheck) {
  Rng rng(test_seed());
  Tensor idx = Tensor::from_ints({0, 1, 1, 2, 2, 0}, {3, 2});
  auto f = [&](const std::vector<Variable>& v) {
    Dispatched d = dispatch(v[0], idx, v[1], 3);
    return combine(mul(d.tokens, d.tokens), d, CombineGrad::as_is);
  };
  EXPECT_TRUE(test::gradcheck(f, {random_tensor(rng, {3, 4}, DType::f64), random_tensor(rng, {3, 2}, DType::f64)},
                              1e-6, 1e-5, {0}));
}

// fp8_flow's backward: combine quantizes dy once; unpermute (no probs) moves the FP8 rows and scales
// to the expert rows with the permute routing: d_rows[row_map[t,j]] = q(dy)[t], pad rows zero.
void check_fp8_grad(Device device) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (int64_t num_tokens : {0, 1, 45}) {
    SCOPED_TRACE("tokens " + std::to_string(num_tokens));
    const int64_t hidden = 384;
    Tensor idx = random_topk(gen, num_tokens, 2, 4).to(device);
    Variable xq(quantize_rowwise_tensor(token_rows(num_tokens, hidden, DType::f32, device), ""));
    Dispatched d = dispatch(xq, idx, Variable(), 4);
    PermuteResult p = permute_pad(d.tokens, d.topk_idx, Variable(), 4, 16);
    // The expert rows: bf16 on the GPU, f32 on the CPU (the dtypes each unpermute backend takes).
    const DType rows_dtype = device.is_cpu() ? DType::f32 : DType::bf16;
    Variable rows(Tensor::zeros({p.rows.size(0), hidden}, rows_dtype, device), true);
    Variable y = combine(unpermute_unpad(rows, p, Variable()), d, CombineGrad::fp8);
    Tensor dy = random_tensor(rng, {num_tokens, hidden}, rows_dtype, device);
    reset_cast_counts();
    y.backward(dy);
    CastCounts n = cast_counts();
    EXPECT_EQ(n.activation_casts(), 1);
    EXPECT_EQ(n.by_site["quantize combine backward: dy"], 1);
    const Tensor& g = rows.grad();
    ASSERT_EQ(g.dtype(), DType::e4m3) << "the expert rows' gradient is not FP8";
    ASSERT_TRUE(g.fp8_scales() != nullptr);
    Tensor want = permute_rows_like(quantize_rowwise_tensor(dy, ""), p);
    EXPECT_TRUE(bit_equal(g.to(Device::cpu()), want.to(Device::cpu())));
    EXPECT_TRUE(bit_equal(g.fp8_scales()->scale_inv.to(Device::cpu()), want.fp8_scales()->scale_inv.to(Device::cpu())));
  }
}

TEST(Dispatch, CombineFp8GradIsOneCast) { check_fp8_grad(Device::cpu()); }

TEST(DispatchCuda, PassesThroughAtSizeOne) {
  FLOWMOE_REQUIRE_CUDA();
  check_pass_through(Device::cuda(0));
}

TEST(DispatchCuda, CombineFp8GradIsOneCast) {
  FLOWMOE_REQUIRE_CUDA();
  check_fp8_grad(Device::cuda(0));
}

}  // namespace
}  // namespace flowmoe
