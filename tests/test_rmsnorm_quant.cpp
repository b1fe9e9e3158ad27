// rmsnorm_quantize: the fused RMSNorm + rowwise FP8 quantize against the unfused composition (rmsnorm then
// quantize_rowwise) bit for bit on each backend, y, data and scales, on random rows and edge rows (zeros,
// huge and tiny magnitudes, one spike); the autograd node (its gradient is the composition's, bit for bit; a
// finite-difference check of its y in f64; one cast counted at its site); errors; CUDA vs its own composition
// bit for bit and against the CPU within the bound below.
// CUDA vs CPU: the GPU sums x^2 in f32 in a tree and takes rsqrtf (<= 2 ulp), the CPU sums in double, so y
// differs by a few f32 ulps; after the quantize a code may move by one e4m3 step (rarely), and a block's
// scale by a factor 2 where its amax sits on a power-of-two boundary (tests/support/fp8_rows_check.h fp8_close).
#include <cmath>
#include <limits>
#include <vector>

#include "engine/cast_stats.h"
#include "engine/ops/ops.h"
#include "engine/ops/quantize.h"
#include "engine/ops/rmsnorm_quant.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"
#include "kernels/rmsnorm.h"
#include "kernels/rmsnorm_quant.h"
#include "tests/support/checks.h"
#include "tests/support/fp8_rows_check.h"
#include "tests/support/norm_inputs.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

constexpr double kEps = 1e-6;

struct Fused {
  Tensor y;  // x's dtype
  Fp8Rows q;
};

// The kernels themselves: fused (with or without y) or the composition, on the CPU in T = float/double.
template <class T>
Fused run_cpu(const Tensor& x_in, const Tensor& w_in, bool fused, bool with_y) {
  const DType dt = std::is_same_v<T, float> ? DType::f32 : DType::f64;
  const Tensor x = x_in.to(dt), w = w_in.to(dt);
  const int64_t rows = x.size(0), hidden = x.size(1);
  Tensor y = Tensor::empty({rows, hidden}, dt), q = Tensor::empty({rows, hidden}, DType::e4m3);
  Tensor s = Tensor::empty({rows, fp8_num_blocks(hidden)}, DType::f32);
  auto* qp = static_cast<uint8_t*>(q.raw_data());
  if (fused) {
    rmsnorm_quant_forward_cpu<T>(with_y ? y.data<T>() : nullptr, qp, s.data<float>(), x.data<T>(), w.data<T>(), rows,
                                 hidden, kEps);
  } else {
    rmsnorm_forward_cpu<T>(y.data<T>(), x.data<T>(), w.data<T>(), rows, hidden, kEps);
    const Tensor y32 = y.to(DType::f32);
    quantize_rowwise_cpu(DType::f32, y32.raw_data(), rows, hidden, qp, s.data<float>());
  }
  return {with_y || !fused ? y : Tensor(), fp8_of(q, s)};
}

// The same on the GPU in dtype (f32 or bf16), results on the host.
Fused run_cuda(const Tensor& x_in, const Tensor& w_in, DType dtype, bool fused, bool with_y) {
  const Device dev = Device::cuda(0);
  const Tensor x = x_in.to(dtype).to(dev), w = w_in.to(dtype).to(dev);
  const int64_t rows = x.size(0), hidden = x.size(1);
  Tensor y = Tensor::empty({rows, hidden}, dtype, dev), q = Tensor::empty({rows, hidden}, DType::e4m3, dev);
  Tensor s = Tensor::empty({rows, fp8_num_blocks(hidden)}, DType::f32, dev);
  auto* qp = static_cast<uint8_t*>(q.raw_data());
  cudaStream_t stream = current_stream(0);
  if (fused) {
    rmsnorm_quant_forward_cuda(dtype, with_y ? y.raw_data() : nullptr, qp, s.data<float>(), x.raw_data(), w.raw_data(),
                               rows, hidden, kEps, stream);
  } else {
    rmsnorm_forward_cuda(dtype, y.raw_data(), x.raw_data(), w.raw_data(), rows, hidden, kEps, stream);
    quantize_rowwise_cuda(dtype, y.raw_data(), rows, hidden, qp, s.data<float>(), stream);
  }
  return {with_y || !fused ? y.to(Device::cpu()) : Tensor(), fp8_of(q, s)};
}

// Bitwise equality of everything the fused run wrote against the composition.
void expect_same(const Fused& got, const Fused& ref, int64_t hidden) {
  if (got.y.defined()) {
    EXPECT_TRUE(bit_equal(got.y, ref.y));
  }
  EXPECT_TRUE(bytes_equal(got.q, ref.q, hidden));
}

}  // namespace

// ---- the CPU reference is the composition ---------------------------------------------------------

TEST(RmsnormQuant, CpuMatchesComposition) {
  Rng rng(test_seed());
  for (const NormCase& c : kNormCases) {
    SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " hidden " << c.hidden);
    const Tensor x = edge_rows(rng, c), w = norm_weight(rng, c.hidden);
    const Fused ref = run_cpu<float>(x, w, false, true);
    expect_same(run_cpu<float>(x, w, true, true), ref, c.hidden);
    expect_same(run_cpu<float>(x, w, true, false), ref, c.hidden);
    const Fused ref64 = run_cpu<double>(x, w, false, true);
    expect_same(run_cpu<double>(x, w, true, true), ref64, c.hidden);
    expect_same(run_cpu<double>(x, w, true, false), ref64, c.hidden);
  }
}

// A zero row quantizes to zeros with scale 1; the huge and tiny rows normalize to finite values and
// finite positive scales like any other row.
TEST(RmsnormQuant, EdgeRows) {
  Rng rng(test_seed());
  const NormCase c{5, 256};
  const Tensor x = edge_rows(rng, c), w = norm_weight(rng, c.hidden);
  const Fused f = run_cpu<float>(x, w, true, true);
  for (int64_t j = 0; j < c.hidden; ++j) EXPECT_EQ(f.q.q[size_t(j)] & 0x7F, 0) << j;  // +-0 (w's sign)
  EXPECT_EQ(f.q.s[0], 1.f);
  EXPECT_EQ(f.q.s[1], 1.f);
  for (float s : f.q.s) EXPECT_TRUE(std::isfinite(s) && s > 0);
}

// ---- the autograd node --------------------------------------------------------------------------

namespace {

struct NodeRun {
  Tensor q, s, y, d_x, d_w;
  CastCounts casts;
};

// Forward (fused, or rmsnorm then quantize_rowwise), then backward with cotangents c_q on q (through the
// identity-gradient dequantize) and c_y on y (when keep_y); results on the CPU.
NodeRun run_node(const Tensor& x_in, const Tensor& w_in, const Tensor& c_q, const Tensor& c_y, bool fused, bool keep_y,
                 Device dev, DType dtype) {
  Variable x(x_in.to(dtype).to(dev), true), w(w_in.to(dtype).to(dev), true);
  reset_cast_counts();
  NormQuantized n;
  if (fused) {
    n = rmsnorm_quantize(x, w, kEps, "block: x", keep_y);
  } else {
    const Variable y = rmsnorm(x, w, kEps);
    n.q = quantize_rowwise(reshape(y, {-1, x.size(-1)}), "block: x");
    if (keep_y) n.y = y;
  }
  NodeRun r;
  r.casts = cast_counts();
  const Tensor& q = n.q.data();
  r.q = q.to(Device::cpu());
  r.s = q.fp8_scales()->scale_inv.to(Device::cpu());
  std::vector<Variable> outs = {dequantize(n.q, dtype, "test")};
  std::vector<Tensor> cots = {c_q.to(dtype).to(dev)};
  if (keep_y) {
    r.y = n.y.data().to(Device::cpu());
    outs.push_back(n.y);
    cots.push_back(c_y.to(dtype).to(dev));
  }
  backward(outs, cots);
  r.d_x = x.grad().to(Device::cpu());
  r.d_w = w.grad().to(Device::cpu());
  return r;
}

void expect_node_same(const NodeRun& got, const NodeRun& ref) {
  EXPECT_TRUE(bit_equal(got.q, ref.q));
  EXPECT_TRUE(bit_equal(got.s, ref.s));
  if (ref.y.defined()) {
    EXPECT_TRUE(bit_equal(got.y, ref.y));
  }
  EXPECT_TRUE(bit_equal(got.d_x, ref.d_x));
  EXPECT_TRUE(bit_equal(got.d_w, ref.d_w));
  EXPECT_EQ(got.casts.by_site, ref.casts.by_site);
}

void node_matches_composition(Device dev, DType dtype) {
  Rng rng(test_seed());
  for (const NormCase& c : {NormCase{6, 256}, NormCase{32, 1024}, NormCase{3, 129}}) {
    for (bool keep_y : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " hidden " << c.hidden << " keep_y " << keep_y);
      const Tensor x2 = edge_rows(rng, c), w = norm_weight(rng, c.hidden);
      const Tensor c_q = random_tensor(rng, {c.rows, c.hidden}), c_y = random_tensor(rng, {c.rows, c.hidden});
      const NodeRun ref = run_node(x2, w, c_q, c_y, false, keep_y, dev, dtype);
      const NodeRun got = run_node(x2, w, c_q, c_y, true, keep_y, dev, dtype);
      expect_node_same(got, ref);
      EXPECT_EQ(got.casts.quantize, 1);
      EXPECT_EQ(got.casts.by_site.count("quantize block: x"), 1u);
    }
  }
}

}  // namespace

// The node's q, y, gradients and cast are the composition's, bit for bit.
TEST(RmsnormQuant, NodeMatchesComposition) { node_matches_composition(Device::cpu(), DType::f32); }

// A [B, T, H] x gives q [B·T, H] and y [B, T, H].
TEST(RmsnormQuant, LeadingDims) {
  Rng rng(test_seed());
  const Variable x(random_tensor(rng, {2, 3, 256})), w(norm_weight(rng, 256));
  const NormQuantized n = rmsnorm_quantize(x, w, kEps, "x", true);
  EXPECT_EQ(n.q.shape(), (Shape{6, 256}));
  EXPECT_EQ(n.q.data().fp8_scales()->scale_inv.shape(), (Shape{6, 2}));
  EXPECT_EQ(n.y.shape(), (Shape{2, 3, 256}));
  EXPECT_TRUE(bit_equal(n.y.data(), rmsnorm(x, w, kEps).data()));
  EXPECT_FALSE(rmsnorm_quantize(x, w, kEps, "x", false).y.defined());
}

// y's gradient by central differences in f64 (q is piecewise constant; its straight-through gradient is the
// composition's, above).
TEST(RmsnormQuant, Gradcheck) {
  Rng rng(test_seed());
  auto fn = [](const std::vector<Variable>& v) { return rmsnorm_quantize(v[0], v[1], 1e-5, "x", true).y; };
  const Tensor x = random_tensor(rng, {3, 130}, DType::f64);
  const Tensor w = random_tensor(rng, {130}, DType::f64, Device::cpu(), 0.5, 1.5);
  EXPECT_TRUE(gradcheck(fn, {x, w}));
}

TEST(RmsnormQuant, Errors) {
  const Variable x(Tensor::zeros({2, 256}, DType::f32)), w(Tensor::zeros({256}, DType::f32));
  EXPECT_THROW(rmsnorm_quantize(x, Variable(Tensor::zeros({128}, DType::f32)), kEps, "x", false), ShapeError);
  EXPECT_THROW(rmsnorm_quantize(x, Variable(Tensor::zeros({256}, DType::f64)), kEps, "x", false), DTypeError);
  EXPECT_THROW(rmsnorm_quantize(x, w, -1.0, "x", false), Error);
  EXPECT_TRUE(throws_naming<DTypeError>(  // bf16 is the GPU's
      [] {
        rmsnorm_quantize(Variable(Tensor::zeros({2, 256}, DType::bf16)), Variable(Tensor::zeros({256}, DType::bf16)),
                         kEps, "attn: x", false);
      },
      {"rmsnorm_quantize at 'attn: x'", "bf16"}));
  std::vector<uint8_t> q(1);
  std::vector<float> s(1), v(1);
  EXPECT_THROW(rmsnorm_quant_forward_cpu<float>(nullptr, q.data(), s.data(), v.data(), v.data(), -1, 1, kEps),
               ShapeError);
}

// ---- CUDA ----------------------------------------------------------------------------------------

// The fused kernel against rmsnorm_forward_cuda then quantize_rowwise_cuda: every y, byte and scale.
TEST(RmsnormQuantCuda, MatchesUnfusedBitwise) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (DType dtype : {DType::bf16, DType::f32})
    for (const NormCase& c : kNormCases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " rows " << c.rows << " hidden " << c.hidden);
      const Tensor x = edge_rows(rng, c), w = norm_weight(rng, c.hidden);
      const Fused ref = run_cuda(x, w, dtype, false, true);
      expect_same(run_cuda(x, w, dtype, true, true), ref, c.hidden);
      expect_same(run_cuda(x, w, dtype, true, false), ref, c.hidden);
    }
}

// Against the CPU within the bound of the header (f32 in; bf16 in against the CPU's y rounded to bf16, which
// is what the GPU quantizes). Edge rows too.
TEST(RmsnormQuantCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (const NormCase& c : kNormCases) {
    SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " hidden " << c.hidden);
    const Tensor x = edge_rows(rng, c), w = norm_weight(rng, c.hidden);
    const Fused ref = run_cpu<float>(x, w, true, true);
    const Fused got = run_cuda(x, w, DType::f32, true, true);
    EXPECT_TRUE(all_close(got.y, ref.y, 1e-5, 0));
    EXPECT_TRUE(fp8_close(got.q, ref.q, c.hidden, 1e-3));

    const Tensor xb = x.to(DType::bf16).to(DType::f32), wb = w.to(DType::bf16).to(DType::f32);
    const Fused ref_b = run_cpu<float>(xb, wb, true, true);
    const Tensor y_b = ref_b.y.to(DType::bf16);
    Tensor q = Tensor::empty({c.rows, c.hidden}, DType::e4m3);
    Tensor s = Tensor::empty({c.rows, fp8_num_blocks(c.hidden)}, DType::f32);
    quantize_rowwise_cpu(DType::bf16, y_b.raw_data(), c.rows, c.hidden, static_cast<uint8_t*>(q.raw_data()),
                         s.data<float>());
    const Fused got_b = run_cuda(x, w, DType::bf16, true, true);
    EXPECT_TRUE(all_close(got_b.y.to(DType::f32), y_b.to(DType::f32), 8e-3, 0));
    EXPECT_TRUE(fp8_close(got_b.q, fp8_of(q, s), c.hidden, 2e-2));
  }
}

// The node on the GPU: the composition's q, y, gradients and casts bit for bit (bf16 and f32).
TEST(RmsnormQuantCuda, NodeMatchesComposition) {
  FLOWMOE_REQUIRE_CUDA();
  node_matches_composition(Device::cuda(0), DType::bf16);
  node_matches_composition(Device::cuda(0), DType::f32);
}

TEST(RmsnormQuantCuda, Errors) {
  FLOWMOE_REQUIRE_CUDA();
  const Device dev = Device::cuda(0);
  const Variable x(Tensor::zeros({2, 256}, DType::f64, dev)), w(Tensor::zeros({256}, DType::f64, dev));
  EXPECT_THROW(rmsnorm_quantize(x, w, kEps, "x", false), DTypeError);
}
