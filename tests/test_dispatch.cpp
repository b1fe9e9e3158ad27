// dispatch and combine (parallel/dispatch.h) in one process. Without a group they are permute+pad and
// unpermute+unpad with one counted host read; with a group of one rank (the none communicator) the
// exchange path runs against itself, and must give the same rows, outputs and gradients bit for bit,
// pass a finite-difference check, and keep fp8_flow's backward at one cast. Rows hold their token id,
// so a wrong row is named. The same path across ranks: tests/mpi/test_exchange.cpp.
#include <gtest/gtest.h>

#include <random>

#include "engine/cast_stats.h"
#include "engine/ops/ops.h"
#include "engine/ops/permute.h"
#include "engine/ops/quantize.h"
#include "engine/ops/unpermute.h"
#include "kernels/common/device_api.h"
#include "layers/moe.h"
#include "parallel/backends.h"
#include "parallel/dispatch.h"
#include "tests/support/checks.h"

namespace flowmoe {
namespace {

using test::bit_equal;
using test::random_tensor;
using test::random_topk;
using test::test_seed;
using test::times_probs;

constexpr int kExperts = 4, kTopK = 2;

// x[t, h] = t + h / 1000: each row names its token.
Tensor token_rows(int64_t num_tokens, int64_t hidden, DType dtype, Device device) {
  std::vector<float> v(size_t(num_tokens * hidden));
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) v[size_t(t * hidden + h)] = float(t) + float(h) / 1000.f;
  return Tensor::from_floats(v, {num_tokens, hidden}, dtype).to(device);
}

DispatchOptions options(bool exchange, int64_t num_rows = -1) {
  DispatchOptions o;
  o.num_experts = kExperts;
  o.num_rows = num_rows;
  if (exchange) o.expert_parallel = make_none_communicator();
  return o;
}

// The routings of the edge cases: random, one hot expert, an expert with none, 0 tokens.
std::vector<std::pair<std::string, Tensor>> routings(std::mt19937_64& gen) {
  return {{"random 37", random_topk(gen, 37, kTopK, kExperts)},
          {"hot experts 0 and 1", random_topk(gen, 21, kTopK, kExperts, {0, 1})},
          {"expert 2 empty", random_topk(gen, 45, kTopK, kExperts, {0, 1, 3})},
          {"one token", random_topk(gen, 1, kTopK, kExperts)},
          {"no tokens", Tensor::zeros({0, kTopK}, DType::i32)}};
}

Tensor host(const Tensor& t) { return t.to(Device::cpu()); }

// One rank: dispatch is permute_pad, combine is unpermute_unpad, one host read on a GPU (none where the
// GEMMs take device counts).
void check_one_rank(Device device) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (auto& [name, idx_cpu] : routings(gen)) {
    SCOPED_TRACE(name);
    const int64_t T = idx_cpu.size(0);
    Tensor idx = idx_cpu.to(device);
    Variable x(token_rows(T, 64, DType::f32, device));
    Variable prob(random_tensor(rng, {T, kTopK}, DType::f32, device));
    const uint64_t syncs = num_host_syncs();
    Dispatched d = dispatch(x, idx, prob, options(false));
    EXPECT_EQ(num_host_syncs() - syncs, device.is_cuda() ? 1u : 0u);
    PermuteResult p = permute_pad(x, idx, prob, kExperts, 16);
    EXPECT_TRUE(bit_equal(host(d.rows.data()), host(p.rows.data())));
    EXPECT_TRUE(bit_equal(host(d.probs.data()), host(p.probs.data())));
    EXPECT_EQ(d.counts.host, p.padded_tokens_per_expert.to_ints());
    EXPECT_FALSE(d.counts.on_device());
    EXPECT_TRUE(d.plan == nullptr);
    // GEMMs that read the counts on the device (FP8 ones, on any backend) get them there, unread.
    DispatchOptions on_device = options(false);
    on_device.device_counts = on_device.fp8_experts = true;
    const uint64_t before = num_host_syncs();
    const Dispatched dd = dispatch(x, idx, prob, on_device);
    EXPECT_EQ(num_host_syncs(), before) << "device counts were read";
    ASSERT_TRUE(dd.counts.on_device());
    EXPECT_TRUE(dd.counts.host.empty());
    EXPECT_EQ(dd.counts.device.to_ints(), p.padded_tokens_per_expert.to_ints());
    Variable y = combine(d.rows, d, prob);
    EXPECT_TRUE(bit_equal(host(y.data()), host(unpermute_unpad(p.rows, p, prob).data())));
  }
}

TEST(Dispatch, OneRankIsPermutePadAndUnpermuteUnpad) { check_one_rank(Device::cpu()); }

// The exchange with a group of one against the one-rank path: the same rows (the exchange sizes its
// buffer exactly, so compare the padded total), the same outputs and gradients, bit for bit.
void check_exchange_matches_one_rank(Device device, bool probs_with_rows) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (auto& [name, idx_cpu] : routings(gen)) {
    SCOPED_TRACE(name + (probs_with_rows ? ", probs with the rows" : ", probs at combine"));
    const int64_t T = idx_cpu.size(0), H = 64;
    Tensor idx = idx_cpu.to(device), x0 = token_rows(T, H, DType::f32, device);
    Tensor p0 = random_tensor(rng, {T, kTopK}, DType::f32, device);
    Tensor dy = random_tensor(rng, {T, H}, DType::f32, device);
    std::vector<Tensor> out, dx, dp;
    std::vector<Dispatched> ds;
    for (bool exchange : {false, true}) {
      Variable x(x0, true), prob(p0, true);
      Dispatched d = dispatch(x, idx, probs_with_rows ? prob : Variable(), options(exchange));
      Variable rows = mul(d.rows, d.rows);  // a nonlinear "expert", the same for every row
      if (probs_with_rows) rows = times_probs(rows, d.probs);
      Variable y = combine(rows, d, probs_with_rows ? Variable() : prob);
      y.backward(dy);
      out.push_back(host(y.data()));
      dx.push_back(host(x.grad()));
      dp.push_back(host(prob.grad()));
      ds.push_back(d);
    }
    const int64_t used = ds[0].routing.segment_starts.to_ints().back();
    EXPECT_EQ(ds[1].rows.size(0), used) << "the exchanged buffer holds exactly the padded segments";
    EXPECT_TRUE(bit_equal(host(ds[1].rows.data()), host(ds[0].rows.data()).slice(0, 0, used).contiguous()));
    EXPECT_EQ(ds[1].counts.host, ds[0].counts.host);
    EXPECT_EQ(ds[1].tokens_per_expert.to_ints(), ds[0].tokens_per_expert.to_ints());
    EXPECT_TRUE(bit_equal(out[1], out[0]));
    EXPECT_TRUE(bit_equal(dx[1], dx[0]));
    EXPECT_TRUE(bit_equal(dp[1], dp[0]));
  }
}

TEST(Dispatch, ExchangeWithItselfMatchesOneRank) {
  check_exchange_matches_one_rank(Device::cpu(), false);
  check_exchange_matches_one_rank(Device::cpu(), true);
}

// Bounded zero-sync buffers (DispatchOptions::capacity_factor), over a group of one rank: a capacity the
// need fits moves the worst-case buffers' rows and outputs; one it does not fit empties the exchange (every
// row, count and output zero, so all finite) and raises most_needed to the need.
TEST(Dispatch, ZeroSyncCapacityEmptiesOnlyAnExchangeThatDoesNotFit) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  const Tensor idx = random_topk(gen, 400, kTopK, kExperts);
  const int64_t T = idx.size(0);
  const Tensor x0 = token_rows(T, 64, DType::f32, Device::cpu()), p0 = random_tensor(rng, {T, kTopK}, DType::f32);
  struct Run {
    Dispatched d;
    Tensor y;
    int32_t most = 0;
  };
  const auto run = [&](double factor) {
    DispatchOptions o = options(true);
    o.zero_sync = true;
    o.capacity_factor = factor;
    o.most_needed = Tensor::zeros({1}, DType::i32);
    Variable x(x0, true), prob(p0, true);
    Run r{dispatch(x, idx, Variable(), o), Tensor(), 0};
    r.y = combine(mul(r.d.rows, r.d.rows), r.d, prob).data();
    r.most = int32_t(o.most_needed.to_ints()[0]);
    return r;
  };
  const Run worst = run(0), fits = run(1.0), over = run(0.5);
  const int64_t need = worst.d.plan->device_segment_starts.to_ints().back();
  ASSERT_GT(need, over.d.rows.size(0)) << "half an even load's rows must be too few";
  EXPECT_EQ(worst.most, 0);
  EXPECT_EQ(fits.most, 0) << "an even load's rows and the pad rows hold one rank's need";
  EXPECT_TRUE(
      bit_equal(fits.d.rows.data().slice(0, 0, need).contiguous(), worst.d.rows.data().slice(0, 0, need).contiguous()));
  EXPECT_TRUE(bit_equal(fits.y, worst.y));
  EXPECT_EQ(over.most, need);
  EXPECT_EQ(over.d.plan->device_overflow.to_ints(), std::vector<int64_t>{need});
  for (int64_t c : over.d.tokens_per_expert.to_ints()) EXPECT_EQ(c, 0) << "an emptied exchange counts nothing";
  EXPECT_TRUE(bit_equal(over.d.rows.data(), Tensor::zeros(over.d.rows.shape(), DType::f32))) << "rows";
  EXPECT_TRUE(bit_equal(over.y, Tensor::zeros({T, 64}, DType::f32))) << "the routed experts' output";
}

// FP8 tokens arrive byte for byte with their scales; pad rows are zero with scale_inv 1.
void check_fp8_payload(Device device) {
  std::mt19937_64 gen(test_seed());
  for (auto& [name, idx_cpu] : routings(gen)) {
    SCOPED_TRACE(name);
    const int64_t T = idx_cpu.size(0);
    Variable xq(quantize_rowwise_tensor(token_rows(T, 256, DType::f32, device), ""));
    Dispatched one = dispatch(xq, idx_cpu.to(device), Variable(), options(false));
    Dispatched ex = dispatch(xq, idx_cpu.to(device), Variable(), options(true));
    const int64_t used = ex.rows.size(0);
    ASSERT_TRUE(ex.rows.data().fp8_scales() != nullptr) << "the exchanged rows lost their scales";
    EXPECT_TRUE(bit_equal(host(ex.rows.data()), host(one.rows.data()).slice(0, 0, used).contiguous()));
    EXPECT_TRUE(bit_equal(host(ex.rows.data().fp8_scales()->scale_inv),
                          host(one.rows.data().fp8_scales()->scale_inv).slice(0, 0, used).contiguous()));
  }
}

TEST(Dispatch, Fp8PayloadArrivesBitIdentical) { check_fp8_payload(Device::cpu()); }

TEST(Dispatch, GradcheckThroughTheExchange) {
  Rng rng(test_seed());
  Tensor idx = Tensor::from_ints({0, 1, 1, 3, 3, 0}, {3, 2});
  for (bool probs_with_rows : {false, true}) {
    SCOPED_TRACE(probs_with_rows ? "probs with the rows" : "probs at combine");
    auto f = [&](const std::vector<Variable>& v) {
      Dispatched d = dispatch(v[0], idx, probs_with_rows ? v[1] : Variable(), options(true));
      Variable rows = mul(d.rows, d.rows);
      if (probs_with_rows) rows = times_probs(rows, d.probs);
      return combine(rows, d, probs_with_rows ? Variable() : v[1]);
    };
    EXPECT_TRUE(test::gradcheck(f, {random_tensor(rng, {3, 4}, DType::f64), random_tensor(rng, {3, 2}, DType::f64)},
                                1e-6, 1e-5));
  }
}

// fp8_flow's backward: combine quantizes dy once, and the FP8 rows and scales reach the experts'
// rows (d_rows[row of (t,j)] = q(dy)[t], pad rows zero) through unpermute and, with a group, the exchange.
void check_fp8_grad(Device device, bool exchange) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (auto& [name, idx_cpu] : routings(gen)) {
    SCOPED_TRACE(name + (exchange ? ", exchange" : ", one rank"));
    const int64_t T = idx_cpu.size(0), hidden = 384;
    Tensor idx = idx_cpu.to(device);
    Variable xq(quantize_rowwise_tensor(token_rows(T, hidden, DType::f32, device), ""));
    Dispatched d = dispatch(xq, idx, Variable(), options(exchange));
    // The expert rows: bf16 on the GPU, f32 on the CPU (the dtypes each unpermute backend takes).
    const DType rows_dtype = device.is_cpu() ? DType::f32 : DType::bf16;
    Variable rows(Tensor::zeros({d.rows.size(0), hidden}, rows_dtype, device), true);
    Variable y = combine_grad_to_fp8(combine(rows, d, Variable()));
    Tensor dy = random_tensor(rng, {T, hidden}, rows_dtype, device);
    reset_cast_counts();
    y.backward(dy);
    CastCounts n = cast_counts();
    EXPECT_EQ(n.activation_casts(), 1);
    EXPECT_EQ(n.by_site["quantize combine backward: dy"], 1);
    const Tensor& g = rows.grad();
    ASSERT_EQ(g.dtype(), DType::e4m3) << "the expert rows' gradient is not FP8";
    ASSERT_TRUE(g.fp8_scales() != nullptr);
    PermuteResult p = permute_pad(xq, idx, Variable(), kExperts, 16);
    Tensor want = permute_rows_like(quantize_rowwise_tensor(dy, ""), p);
    const int64_t used = g.size(0);
    EXPECT_TRUE(bit_equal(host(g), host(want).slice(0, 0, used).contiguous()));
    EXPECT_TRUE(
        bit_equal(host(g.fp8_scales()->scale_inv), host(want.fp8_scales()->scale_inv).slice(0, 0, used).contiguous()));
  }
}

TEST(Dispatch, CombineFp8GradIsOneCast) {
  check_fp8_grad(Device::cpu(), false);
  check_fp8_grad(Device::cpu(), true);
}

TEST(Dispatch, BadShapesThrowNamingThem) {
  Variable x(token_rows(5, 8, DType::f32, Device::cpu()));
  EXPECT_TRUE(test::throws_naming<ShapeError>(
      [&] {
        dispatch(x, Tensor::zeros({4, 2}, DType::i32), Variable(), options(false));
      },
      {"topk_idx", "[5, k]"}));
  Dispatched d = dispatch(x, Tensor::zeros({5, 2}, DType::i32), Variable(), options(false));
  Variable wrong(Tensor::zeros({d.rows.size(0) + 1, 8}, DType::f32));
  EXPECT_TRUE(test::throws_naming<ShapeError>([&] { combine(wrong, d, Variable()); }, {"combine", "dispatched rows"}));
}

TEST(DispatchCuda, OneRankIsPermutePadAndUnpermuteUnpad) {
  FLOWMOE_REQUIRE_CUDA();
  check_one_rank(Device::cuda(0));
}

TEST(DispatchCuda, ExchangeWithItselfMatchesOneRank) {
  FLOWMOE_REQUIRE_CUDA();
  check_exchange_matches_one_rank(Device::cuda(0), false);
  check_exchange_matches_one_rank(Device::cuda(0), true);
}

TEST(DispatchCuda, Fp8PayloadArrivesBitIdentical) {
  FLOWMOE_REQUIRE_CUDA();
  check_fp8_payload(Device::cuda(0));
}

TEST(DispatchCuda, CombineFp8GradIsOneCast) {
  FLOWMOE_REQUIRE_CUDA();
  check_fp8_grad(Device::cuda(0), false);
  check_fp8_grad(Device::cuda(0), true);
}

}  // namespace
}  // namespace flowmoe
