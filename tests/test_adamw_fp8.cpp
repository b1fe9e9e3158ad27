// AdamW writing the FP8 weights (kernels/adamw_fp8.h): the fused, tile-shaped update gives bit for bit what
// adamw_multi_cpu then quantize_block_cpu of the updated weights as the forward reads them give (weights, moments,
// copy, data, scales and transpose), on shapes with tails, zero, huge and non-finite blocks, f32 and bf16 moments
// and copies; a skipped step moves nothing; ranges of whole block rows (the sharded optimizer's) and the block
// transpose give the whole tensor's update; many weights in one call are each updated as alone; the GPU agrees with
// the CPU. In training: test_adamw_fp8_training.cpp.
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "kernels/adamw_fp8.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// One weight [B, N, K]: its update's buffers and its FP8 copy's.
struct Weight {
  int64_t B = 0, N = 0, K = 0;
  Tensor param, grad, exp_avg, exp_avg_sq, copy, q, scale_inv, q_t, scale_inv_t;
  int64_t grad_offset = 0;  // the gradient's first element in grad (1: not 16-byte aligned)

  Weight to(Device dev) const {
    auto on = [&](const Tensor& t) { return t.defined() ? t.to(dev).clone() : Tensor(); };
    return {B,
            N,
            K,
            on(param),
            on(grad),
            on(exp_avg),
            on(exp_avg_sq),
            on(copy),
            on(q),
            on(scale_inv),
            on(q_t),
            on(scale_inv_t),
            grad_offset};
  }
  AdamWTensor update(const AdamWStep& step) const {
    AdamWTensor t;
    t.param = param.data<float>();
    t.grad = grad.data<float>() + grad_offset;
    t.exp_avg = exp_avg.raw_data();
    t.exp_avg_sq = exp_avg_sq.raw_data();
    t.n = B * N * K;
    t.step = step;
    t.moment_dtype = exp_avg.dtype();
    t.rounding = {rounding_key(11, uint64_t(N)), 0};
    if (copy.defined()) t.copy = {copy.raw_data(), copy.dtype()};
    return t;
  }
  AdamWFp8Tensor fused(const AdamWStep& step) const {
    return {update(step),
            {q.data<uint8_t>(), scale_inv.data<float>(), q_t.data<uint8_t>(), scale_inv_t.data<float>(), B, N, K}};
  }
};

// Random weights; moments and copy in the given dtypes (copy f64: none); the FP8 buffers filled with garbage.
Weight make_weight(Rng& rng, int64_t B, int64_t N, int64_t K, DType moments, DType copy) {
  Weight w;
  w.B = B, w.N = N, w.K = K;
  w.param = random_tensor(rng, {B, N, K}, DType::f32, Device::cpu(), -0.5, 0.5);
  w.grad = random_tensor(rng, {B, N, K}, DType::f32, Device::cpu(), -3, 3);
  w.exp_avg = random_tensor(rng, {B, N, K}, DType::f32, Device::cpu(), -0.1, 0.1).to(moments);
  w.exp_avg_sq = random_tensor(rng, {B, N, K}, DType::f32, Device::cpu(), 0, 0.1).to(moments);
  if (copy != DType::f64) w.copy = Tensor::zeros({B, N, K}, copy);
  const int64_t nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K);
  w.q = Tensor::full({B, N, K}, 0x55, DType::u8);
  w.q_t = Tensor::full({B, K, N}, 0x55, DType::u8);
  w.scale_inv = Tensor::full({B, nbn, nbk}, 3.0, DType::f32);
  w.scale_inv_t = Tensor::full({B, nbk, nbn}, 3.0, DType::f32);
  return w;
}

// Sets element (b, n, k)'s weight, gradient and moments.
void set_element(Weight& w, int64_t b, int64_t n, int64_t k, float p, float g, float m, float v) {
  const int64_t i = (b * w.N + n) * w.K + k;
  w.param.data<float>()[i] = p;
  w.grad.data<float>()[i] = g;
  const bool narrow = w.exp_avg.dtype() == DType::bf16;
  if (narrow) {
    w.exp_avg.data<uint16_t>()[i] = f32_to_bf16_bits(m);
    w.exp_avg_sq.data<uint16_t>()[i] = f32_to_bf16_bits(v);
  } else {
    w.exp_avg.data<float>()[i] = m;
    w.exp_avg_sq.data<float>()[i] = v;
  }
}

// The oracle: the plain update, then the 128x128 quantize of the weights as the forward reads them.
Weight unfused(const Weight& before, const AdamWStep& step) {
  Weight w = before.to(Device::cpu());
  const AdamWTensor t = w.update(step);
  adamw_multi_cpu(&t, 1);
  const Tensor& read = w.copy.defined() ? w.copy : w.param;
  quantize_block_cpu(read.dtype(), read.raw_data(), w.B, w.N, w.K, w.q.data<uint8_t>(), w.scale_inv.data<float>(),
                     w.q_t.data<uint8_t>(), w.scale_inv_t.data<float>());
  return w;
}

// Bit for bit, but where both are NaN: the GPU writes the canonical NaN where x86 writes its own (the FP8 bytes
// and scales of a NaN block are canonical on both).
::testing::AssertionResult same_or_both_nan(const Tensor& got, const Tensor& want) {
  if (got.shape() != want.shape() || got.dtype() != want.dtype())
    return ::testing::AssertionFailure() << got.describe() << " vs " << want.describe();
  const std::vector<double> g = got.to_doubles(), w = want.to_doubles();
  const size_t es = dtype_size(got.dtype());
  const auto* pg = static_cast<const unsigned char*>(got.raw_data());
  const auto* pw = static_cast<const unsigned char*>(want.raw_data());
  for (size_t i = 0; i < g.size(); ++i)
    if (!(std::isnan(g[i]) && std::isnan(w[i])) && std::memcmp(pg + i * es, pw + i * es, es) != 0)
      return ::testing::AssertionFailure() << "element " << i << " differs: got " << g[i] << ", want " << w[i];
  return ::testing::AssertionSuccess();
}

// nan_bits: compare the weights, moments and copy as same_or_both_nan does (the GPU against the CPU).
void expect_same(const Weight& got, const Weight& want, bool nan_bits = false) {
  const Weight g = got.to(Device::cpu());
  const auto same = [&](const Tensor& a, const Tensor& b) {
    return nan_bits ? same_or_both_nan(a, b) : bit_equal(a, b);
  };
  EXPECT_TRUE(same(g.param, want.param)) << "param";
  EXPECT_TRUE(same(g.exp_avg, want.exp_avg)) << "exp_avg";
  EXPECT_TRUE(same(g.exp_avg_sq, want.exp_avg_sq)) << "exp_avg_sq";
  if (want.copy.defined()) {
    EXPECT_TRUE(same(g.copy, want.copy)) << "copy";
  }
  EXPECT_TRUE(bit_equal(g.q, want.q)) << "q";
  EXPECT_TRUE(bit_equal(g.scale_inv, want.scale_inv)) << "scale_inv";
  EXPECT_TRUE(bit_equal(g.q_t, want.q_t)) << "q_t";
  EXPECT_TRUE(bit_equal(g.scale_inv_t, want.scale_inv_t)) << "scale_inv_t";
}

AdamWStep test_step() {
  AdamWStep s;
  s.lr = 0.01f;
  s.weight_decay = 0.1f;
  s.grad_scale = 0.75f;
  s.bias_correction1 = 0.19f;
  s.bias_correction2 = 0.0199f;
  s.update = 2;
  return s;
}

struct Case {
  int64_t B, N, K;
  DType moments, copy;  // copy f64: none
};

// Whole blocks, tails in N, in K and in both, a row or a column thinner than a block, several matrices; N and K
// multiples of 4 or not (the CUDA kernel's 4-wide and element-wise accesses), with tails of either.
std::vector<Case> cases() {
  return {{1, 128, 128, DType::f32, DType::f64},  {2, 130, 200, DType::f32, DType::f64},
          {1, 5, 7, DType::bf16, DType::f64},     {3, 257, 129, DType::bf16, DType::bf16},
          {1, 256, 1, DType::f32, DType::f32},    {2, 1, 300, DType::f32, DType::bf16},
          {1, 384, 256, DType::bf16, DType::f64}, {1, 132, 136, DType::f32, DType::bf16},
          {2, 260, 68, DType::bf16, DType::f32}};
}

std::string describe(const Case& c) {
  std::ostringstream s;
  s << "[" << c.B << ", " << c.N << ", " << c.K << "] moments " << dtype_name(c.moments) << " copy "
    << (c.copy == DType::f64 ? "none" : dtype_name(c.copy));
  return s.str();
}

// Block (0, 0) all zero (it stays zero: scale 1), block (0, last) huge (about e4m3's and f32's top), and, where
// the weight has more than one row block, block (1, 0) with an infinite gradient (its weights turn NaN: NaN scale).
void add_edge_blocks(Weight& w) {
  const int64_t nbn = fp8_num_blocks(w.N), nbk = fp8_num_blocks(w.K);
  for (int64_t n = 0; n < std::min<int64_t>(w.N, 128); ++n)
    for (int64_t k = 0; k < std::min<int64_t>(w.K, 128); ++k) set_element(w, 0, n, k, 0.f, 0.f, 0.f, 0.f);
  if (nbk > 1)
    for (int64_t n = 0; n < std::min<int64_t>(w.N, 128); ++n)
      for (int64_t k = (nbk - 1) * 128; k < w.K; ++k)
        set_element(w, 0, n, k, (n + k) % 2 ? 3.0e38f : -448.f * float(n + 1), 1.f, 0.f, 1.f);
  if (nbn > 1) set_element(w, 0, 130 % w.N, 3 % w.K, 1.f, std::numeric_limits<float>::infinity(), 0.f, 0.f);
}

// check(w) on each case's random weights, then on them with the edge blocks.
template <class F>
void for_each_weight(F check) {
  Rng rng(test_seed());
  for (const Case& c : cases()) {
    SCOPED_TRACE(describe(c));
    for (bool edges : {false, true}) {
      Weight w = make_weight(rng, c.B, c.N, c.K, c.moments, c.copy);
      if (edges) add_edge_blocks(w);
      check(w);
    }
  }
}

}  // namespace

TEST(AdamWFp8, FusedEqualsUpdateThenQuantize) {
  for_each_weight([](Weight& w) {
    const Weight want = unfused(w, test_step());
    const AdamWFp8Tensor t = w.fused(test_step());
    adamw_fp8_cpu(&t, 1);
    expect_same(w, want);
  });
}

// A step with scalars: scheduled as adamw_multi_cpu schedules it; a skipped one (apply 0) moves nothing.
TEST(AdamWFp8, StepScalarsAndSkippedSteps) {
  Rng rng(test_seed());
  Weight w = make_weight(rng, 2, 130, 200, DType::f32, DType::f64);
  StepScalars control;
  control.lr = 0.02;
  control.grad_scale = 0.5;
  control.bias_correction1 = 0.1f;
  control.bias_correction2 = 0.01f;
  control.num_updates = 1;
  control.apply = 0;
  const Weight before = w.to(Device::cpu());
  AdamWFp8Tensor t = w.fused(test_step());
  adamw_fp8_cpu(&t, 1, &control);
  expect_same(w, before);
  control.apply = 1;
  const Weight want = unfused(w, scheduled_adamw_step(test_step(), control, 1.0));
  adamw_fp8_cpu(&t, 1, &control);
  expect_same(w, want);
}

// Ranges of whole block rows only, and those of a weight whose N is a multiple of 128.
TEST(AdamWFp8, RejectsRangesOffBlockRowsAndWrongShapes) {
  Rng rng(test_seed());
  const Weight w = make_weight(rng, 1, 130, 200, DType::f32, DType::f64);
  AdamWFp8Tensor t = w.fused(test_step());
  t.fp8.N = 129;
  EXPECT_THROW(adamw_fp8_cpu(&t, 1), ShapeError);
  t = w.fused(test_step());
  t.t.rounding.first_index = 128;
  EXPECT_THROW(adamw_fp8_cpu(&t, 1), ShapeError);  // past the end
  t.t.n = 128 * 200;
  t.t.rounding.first_index = 0;
  EXPECT_THROW(adamw_fp8_cpu(&t, 1), Error);  // N 130: the block rows are not all 128 K elements
  const Weight v = make_weight(rng, 1, 256, 200, DType::f32, DType::f64);
  t = v.fused(test_step());
  t.t.n = 128 * 200;
  t.t.rounding.first_index = 200;
  EXPECT_THROW(adamw_fp8_cpu(&t, 1), Error);  // starts off a block row
  t.t.rounding.first_index = 128 * 200;
  t.fp8.q_t = nullptr;
  EXPECT_THROW(adamw_fp8_cpu(&t, 1), Error);  // a transpose without its scales
  t.fp8.scale_inv_t = nullptr;
  EXPECT_NO_THROW(adamw_fp8_cpu(&t, 1));  // the second block row, without the transpose
}

namespace {

// The weights whose block rows the sharded optimizer splits (N a multiple of 128), tails in K, several matrices.
std::vector<Case> row_cases() {
  return {{1, 128, 128, DType::f32, DType::f64},
          {1, 256, 1, DType::f32, DType::f32},
          {2, 256, 200, DType::bf16, DType::bf16},
          {3, 128, 129, DType::f32, DType::f64},
          {1, 384, 260, DType::bf16, DType::f32}};
}

// w updated as the sharded optimizer's ranks update it: block rows [cuts[j], cuts[j + 1]) one range each, their
// buffers the range's alone, then the transpose rebuilt from the whole copy.
void update_by_ranges(Weight& w, const std::vector<int64_t>& cuts, Device dev) {
  const int64_t row = 128 * w.K;
  const int64_t moment_size = int64_t(dtype_size(w.exp_avg.dtype()));
  for (size_t j = 0; j + 1 < cuts.size(); ++j) {
    AdamWFp8Tensor t = w.fused(test_step());
    const int64_t first = cuts[j] * row;
    t.t.param += first;
    t.t.grad += first;
    t.t.exp_avg = static_cast<char*>(t.t.exp_avg) + first * moment_size;
    t.t.exp_avg_sq = static_cast<char*>(t.t.exp_avg_sq) + first * moment_size;
    if (t.t.copy.data) t.t.copy.data = static_cast<char*>(t.t.copy.data) + first * int64_t(dtype_size(t.t.copy.dtype));
    t.t.n = (cuts[j + 1] - cuts[j]) * row;
    t.t.rounding.first_index = first;
    t.fp8.q_t = nullptr;
    t.fp8.scale_inv_t = nullptr;
    if (dev.is_cpu())
      adamw_fp8_cpu(&t, 1);
    else
      adamw_fp8_cuda(&t, 1, nullptr, current_stream(dev.index));
  }
  w.q_t.fill_(0.0);
  w.scale_inv_t.fill_(0.0);
  const AdamWFp8Tensor whole = w.fused(test_step());
  if (dev.is_cpu())
    fp8_block_transpose_cpu(whole.fp8);
  else
    fp8_block_transpose_cuda(whole.fp8, current_stream(dev.index));
}

// Each block row a range of its own, and two ranges of about half.
std::vector<std::vector<int64_t>> row_cuts(const Weight& w) {
  const int64_t rows = w.B * w.N / 128;
  std::vector<int64_t> each(size_t(rows + 1));
  for (int64_t r = 0; r <= rows; ++r) each[size_t(r)] = r;
  return {each, {0, rows / 2, rows}};
}

}  // namespace

// The sharded optimizer's update: ranges of block rows, then the block transpose, are the whole tensor's fused
// update bit for bit (weights, moments, copy, data, scales and transpose), edge blocks included.
TEST(AdamWFp8, RangesOfBlockRowsEqualTheWholeTensor) {
  Rng rng(test_seed());
  for (const Case& c : row_cases()) {
    SCOPED_TRACE(describe(c));
    for (bool edges : {false, true}) {
      Weight w = make_weight(rng, c.B, c.N, c.K, c.moments, c.copy);
      if (edges) add_edge_blocks(w);
      Weight want = w.to(Device::cpu());
      const AdamWFp8Tensor t = want.fused(test_step());
      adamw_fp8_cpu(&t, 1);
      for (const std::vector<int64_t>& cuts : row_cuts(w)) {
        Weight got = w.to(Device::cpu());
        update_by_ranges(got, cuts, Device::cpu());
        expect_same(got, want);
      }
    }
  }
}

// The block transpose alone: each block's bytes and the scale grid, as the fused update writes them, tails too.
TEST(AdamWFp8, BlockTransposeEqualsTheFusedTranspose) {
  for_each_weight([](Weight& w) {
    const AdamWFp8Tensor t = w.fused(test_step());
    adamw_fp8_cpu(&t, 1);
    const Tensor q_t = w.q_t.clone(), scale_inv_t = w.scale_inv_t.clone();
    w.q_t.fill_(0.0);
    w.scale_inv_t.fill_(0.0);
    fp8_block_transpose_cpu(t.fp8);
    EXPECT_TRUE(bit_equal(w.q_t, q_t));
    EXPECT_TRUE(bit_equal(w.scale_inv_t, scale_inv_t));
  });
}

namespace {

// w with its gradient moved one element into a longer buffer: not 16-byte aligned, where the CUDA kernel falls back
// to element-wise accesses although K is a multiple of 4.
Weight misalign_grad(Weight w) {
  const int64_t n = w.grad.numel();
  Tensor g = Tensor::zeros({n + 1}, DType::f32);
  std::memcpy(g.data<float>() + 1, w.grad.data<float>(), size_t(n) * sizeof(float));
  w.grad = g;
  w.grad_offset = 1;
  return w;
}

// Weights for one call: more of one moment and copy dtype than a CUDA launch takes (16), each mix of moment and copy
// dtypes, an empty weight, one with edge blocks and one with a misaligned gradient.
std::vector<Weight> many_weights(Rng& rng) {
  std::vector<Weight> ws;
  for (int64_t i = 0; i < 18; ++i)
    ws.push_back(make_weight(rng, 1 + i % 2, 40 + 17 * i, 36 + 12 * i, DType::bf16, DType::bf16));
  for (DType moments : {DType::f32, DType::bf16})
    for (DType copy : {DType::f64, DType::f32, DType::bf16}) ws.push_back(make_weight(rng, 2, 130, 132, moments, copy));
  ws.push_back(make_weight(rng, 1, 0, 128, DType::f32, DType::f64));
  ws.push_back(make_weight(rng, 1, 260, 264, DType::f32, DType::f64));
  add_edge_blocks(ws.back());
  ws.push_back(misalign_grad(make_weight(rng, 1, 136, 264, DType::f32, DType::bf16)));
  return ws;
}

std::vector<AdamWFp8Tensor> fused_all(const std::vector<Weight>& ws) {
  std::vector<AdamWFp8Tensor> ts;
  for (const Weight& w : ws) ts.push_back(w.fused(test_step()));
  return ts;
}

}  // namespace

// Many weights in one call: each updated as it is alone.
TEST(AdamWFp8, ManyWeightsInOneCallEqualEachAlone) {
  Rng rng(test_seed());
  std::vector<Weight> ws = many_weights(rng);
  std::vector<Weight> want;
  for (const Weight& w : ws) want.push_back(unfused(w, test_step()));
  const std::vector<AdamWFp8Tensor> ts = fused_all(ws);
  adamw_fp8_cpu(ts.data(), int64_t(ts.size()));
  for (size_t i = 0; i < ws.size(); ++i) {
    SCOPED_TRACE("weight " + std::to_string(i));
    expect_same(ws[i], want[i]);
  }
}

TEST(AdamWFp8Cuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  for_each_weight([](Weight& cpu) {
    const Weight gpu = cpu.to(Device::cuda(0));
    const AdamWFp8Tensor tc = cpu.fused(test_step()), tg = gpu.fused(test_step());
    adamw_fp8_cpu(&tc, 1);
    adamw_fp8_cuda(&tg, 1, nullptr, current_stream(0));
    expect_same(gpu, cpu, true);
  });
}

TEST(AdamWFp8Cuda, RangesAndBlockTransposeMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (const Case& c : row_cases()) {
    SCOPED_TRACE(describe(c));
    Weight cpu = make_weight(rng, c.B, c.N, c.K, c.moments, c.copy);
    add_edge_blocks(cpu);
    const std::vector<int64_t> cuts = row_cuts(cpu)[1];
    Weight gpu = cpu.to(Device::cuda(0));
    update_by_ranges(cpu, cuts, Device::cpu());
    update_by_ranges(gpu, cuts, Device::cuda(0));
    expect_same(gpu, cpu, true);
  }
}

// One call over many weights: several launches of mixed dtypes on the GPU, each weight as the CPU updates it.
TEST(AdamWFp8Cuda, ManyWeightsInOneCallMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  std::vector<Weight> cpu = many_weights(rng), gpu;
  for (const Weight& w : cpu) gpu.push_back(w.to(Device::cuda(0)));
  const std::vector<AdamWFp8Tensor> tc = fused_all(cpu), tg = fused_all(gpu);
  adamw_fp8_cpu(tc.data(), int64_t(tc.size()));
  adamw_fp8_cuda(tg.data(), int64_t(tg.size()), nullptr, current_stream(0));
  for (size_t i = 0; i < cpu.size(); ++i) {
    SCOPED_TRACE("weight " + std::to_string(i));
    expect_same(gpu[i], cpu[i], true);
  }
}
