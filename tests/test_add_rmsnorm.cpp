// add_rmsnorm: the fused residual add + RMSNorm (+ rowwise FP8 quantize) against the unfused composition (add, then
// rmsnorm, then quantize_rowwise) bit for bit on each backend, h, y, data and scales, in its three forms (y; q; y and
// q) on random and edge rows; the autograd node (its gradients are the composition's bit for bit, with cotangents on
// h, y and q; the graph keeps h alone; central differences of h + y in f64; one cast counted at its site, none without
// one); errors; CUDA against its own composition bit for bit and against the CPU within the bound of
// tests/test_rmsnorm_quant.cpp (h exact: one f32 add rounded once on both).
#include <vector>

#include "engine/allocator.h"
#include "engine/cast_stats.h"
#include "engine/ops/add_rmsnorm.h"
#include "engine/ops/ops.h"
#include "engine/ops/quantize.h"
#include "kernels/add_rmsnorm.h"
#include "kernels/common/device_api.h"
#include "kernels/elementwise.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"
#include "kernels/rmsnorm.h"
#include "tests/support/checks.h"
#include "tests/support/fp8_rows_check.h"
#include "tests/support/norm_inputs.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

constexpr double kEps = 1e-6;

// What the fused op is asked for: the norm's y, its FP8 copy, or both.
struct Mode {
  bool y, q;
};
const Mode kModes[] = {{true, false}, {false, true}, {true, true}};

struct Out {
  Tensor h, y;  // y undefined unless asked
  Fp8Rows q;    // empty unless asked
};

// The kernels on the CPU in T: fused, or binary_cpu's add, rmsnorm_forward_cpu and quantize_rowwise_cpu.
template <class T>
Out run_cpu(const Tensor& x_in, const Tensor& a_in, const Tensor& w_in, Mode m, bool fused) {
  const DType dt = std::is_same_v<T, float> ? DType::f32 : DType::f64;
  const Tensor x = x_in.to(dt), a = a_in.to(dt), w = w_in.to(dt);
  const int64_t rows = x.size(0), hidden = x.size(1);
  Tensor h = Tensor::empty({rows, hidden}, dt), y = Tensor::empty({rows, hidden}, dt);
  Tensor q = Tensor::empty({rows, hidden}, DType::e4m3), s = Tensor::empty({rows, fp8_num_blocks(hidden)}, DType::f32);
  auto* qp = static_cast<uint8_t*>(q.raw_data());
  if (fused) {
    add_rmsnorm_forward_cpu<T>(h.data<T>(), m.y ? y.data<T>() : nullptr, m.q ? qp : nullptr, s.data<float>(),
                               x.data<T>(), a.data<T>(), w.data<T>(), rows, hidden, kEps);
  } else {
    binary_cpu<T>(BinaryOp::add, h.data<T>(), x.data<T>(), a.data<T>(), rows * hidden);
    rmsnorm_forward_cpu<T>(y.data<T>(), h.data<T>(), w.data<T>(), rows, hidden, kEps);
    const Tensor y32 = y.to(DType::f32);
    quantize_rowwise_cpu(DType::f32, y32.raw_data(), rows, hidden, qp, s.data<float>());
  }
  return {h, m.y ? y : Tensor(), m.q ? fp8_of(q, s) : Fp8Rows{}};
}

// The same on the GPU in dtype, with binary_cuda, rmsnorm_forward_cuda and quantize_rowwise_cuda unfused.
Out run_cuda(const Tensor& x_in, const Tensor& a_in, const Tensor& w_in, DType dtype, Mode m, bool fused) {
  const Device dev = Device::cuda(0);
  const Tensor x = x_in.to(dtype).to(dev), a = a_in.to(dtype).to(dev), w = w_in.to(dtype).to(dev);
  const int64_t rows = x.size(0), hidden = x.size(1);
  Tensor h = Tensor::empty({rows, hidden}, dtype, dev), y = Tensor::empty({rows, hidden}, dtype, dev);
  Tensor q = Tensor::empty({rows, hidden}, DType::e4m3, dev);
  Tensor s = Tensor::empty({rows, fp8_num_blocks(hidden)}, DType::f32, dev);
  auto* qp = static_cast<uint8_t*>(q.raw_data());
  cudaStream_t stream = current_stream(0);
  if (fused) {
    add_rmsnorm_forward_cuda(dtype, h.raw_data(), m.y ? y.raw_data() : nullptr, m.q ? qp : nullptr, s.data<float>(),
                             x.raw_data(), a.raw_data(), w.raw_data(), rows, hidden, kEps, stream);
  } else {
    binary_cuda(BinaryOp::add, dtype, h.raw_data(), x.raw_data(), a.raw_data(), rows * hidden, stream);
    rmsnorm_forward_cuda(dtype, y.raw_data(), h.raw_data(), w.raw_data(), rows, hidden, kEps, stream);
    quantize_rowwise_cuda(dtype, y.raw_data(), rows, hidden, qp, s.data<float>(), stream);
  }
  return {h.to(Device::cpu()), m.y ? y.to(Device::cpu()) : Tensor(), m.q ? fp8_of(q, s) : Fp8Rows{}};
}

// Everything the fused run wrote against the composition, bit for bit.
void expect_same(const Out& got, const Out& ref, Mode m, int64_t hidden) {
  EXPECT_TRUE(bit_equal(got.h, ref.h));
  if (m.y) {
    EXPECT_TRUE(bit_equal(got.y, ref.y));
  }
  if (m.q) {
    EXPECT_TRUE(bytes_equal(got.q, ref.q, hidden));
  }
}

Out reference_of(const Out& all, Mode m) { return {all.h, m.y ? all.y : Tensor(), m.q ? all.q : Fp8Rows{}}; }

}  // namespace

// ---- the CPU reference is the composition ---------------------------------------------------------

TEST(AddRmsnorm, CpuMatchesComposition) {
  Rng rng(test_seed());
  for (const NormCase& c : kNormCases)
    for (Mode m : kModes) {
      SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " hidden " << c.hidden << " y " << m.y << " q " << m.q);
      const Tensor x = edge_rows(rng, c), a = edge_rows(rng, c), w = norm_weight(rng, c.hidden);
      expect_same(run_cpu<float>(x, a, w, m, true), reference_of(run_cpu<float>(x, a, w, m, false), m), m, c.hidden);
      expect_same(run_cpu<double>(x, a, w, m, true), reference_of(run_cpu<double>(x, a, w, m, false), m), m, c.hidden);
    }
}

// ---- the autograd node --------------------------------------------------------------------------

namespace {

struct NodeRun {
  Tensor h, y, q, s, d_x, d_a, d_w;
  CastCounts casts;
};

// Forward (fused, or add, rmsnorm and quantize_rowwise), then backward with cotangents c_h on h, c_y on y and c_q
// on q (through the identity-gradient dequantize), each where the mode has the output; results on the CPU.
NodeRun run_node(const std::vector<Tensor>& in, const std::vector<Tensor>& cot, Mode m, bool fused, Device dev,
                 DType dtype) {
  Variable x(in[0].to(dtype).to(dev), true), a(in[1].to(dtype).to(dev), true), w(in[2].to(dtype).to(dev), true);
  const std::string site = m.q ? "block: x" : "";
  reset_cast_counts();
  AddNormed r;
  if (fused) {
    r = add_rmsnorm(x, a, w, kEps, site, m.y);
  } else {
    r.h = add(x, a);
    const Variable y = rmsnorm(r.h, w, kEps);
    if (m.y) r.n.y = y;
    if (m.q) r.n.q = quantize_rowwise(reshape(y, {-1, x.size(-1)}), site);
  }
  NodeRun out;
  out.casts = cast_counts();
  std::vector<Variable> outs = {r.h};
  std::vector<Tensor> cots = {cot[0].to(dtype).to(dev)};
  out.h = r.h.data().to(Device::cpu());
  if (m.y) {
    out.y = r.n.y.data().to(Device::cpu());
    outs.push_back(r.n.y);
    cots.push_back(cot[1].to(dtype).to(dev));
  }
  if (m.q) {
    out.q = r.n.q.data().to(Device::cpu());
    out.s = r.n.q.data().fp8_scales()->scale_inv.to(Device::cpu());
    outs.push_back(dequantize(r.n.q, dtype, "test"));
    cots.push_back(cot[2].to(dtype).to(dev));
  }
  backward(outs, cots);
  out.d_x = x.grad().to(Device::cpu());
  out.d_a = a.grad().to(Device::cpu());
  out.d_w = w.grad().to(Device::cpu());
  return out;
}

void node_matches_composition(Device dev, DType dtype) {
  Rng rng(test_seed());
  for (const NormCase& c : {NormCase{6, 256}, NormCase{32, 1024}, NormCase{3, 129}})
    for (Mode m : kModes) {
      SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " hidden " << c.hidden << " y " << m.y << " q " << m.q);
      const std::vector<Tensor> in = {edge_rows(rng, c), edge_rows(rng, c), norm_weight(rng, c.hidden)};
      std::vector<Tensor> cot;
      for (int i = 0; i < 3; ++i) cot.push_back(random_tensor(rng, {c.rows, c.hidden}));
      const NodeRun ref = run_node(in, cot, m, false, dev, dtype), got = run_node(in, cot, m, true, dev, dtype);
      for (auto [g, r] : {std::pair{&got.h, &ref.h},
                          {&got.y, &ref.y},
                          {&got.q, &ref.q},
                          {&got.s, &ref.s},
                          {&got.d_x, &ref.d_x},
                          {&got.d_a, &ref.d_a},
                          {&got.d_w, &ref.d_w}})
        if (r->defined()) {
          EXPECT_TRUE(bit_equal(*g, *r));
        }
      EXPECT_EQ(got.casts.by_site, ref.casts.by_site);
      EXPECT_EQ(got.casts.quantize, m.q ? 1 : 0);
    }
}

}  // namespace

TEST(AddRmsnorm, NodeMatchesComposition) { node_matches_composition(Device::cpu(), DType::f32); }

// The graph keeps h and the weight of the node, not y and q (their readers keep them if they need them): after the
// outputs are dropped, what stays live is about h.
TEST(AddRmsnorm, KeepsOnlyH) {
  Rng rng(1);
  const Variable x(random_tensor(rng, {512, 1024}), true), a(random_tensor(rng, {512, 1024}), true);
  const Variable w(norm_weight(rng, 1024), true);
  const size_t base = memory_stats(Device::cpu()).live_bytes, h_bytes = 512 * 1024 * 4;
  AddNormed r = add_rmsnorm(x, a, w, kEps, "x", /*keep_y=*/true);
  r.n = NormQuantized();
  const size_t kept = memory_stats(Device::cpu()).live_bytes - base;
  EXPECT_GE(kept, h_bytes);
  EXPECT_LT(kept, h_bytes + h_bytes / 4) << "the node keeps " << kept << " bytes, h is " << h_bytes;
  r.h.backward(Tensor::full({512, 1024}, 1.0, DType::f32));
  EXPECT_TRUE(x.grad().defined() && w.grad().defined());
}

// h + y by central differences in f64 (q is piecewise constant; its straight-through gradient is the
// composition's, above).
TEST(AddRmsnorm, Gradcheck) {
  Rng rng(test_seed());
  auto fn = [](const std::vector<Variable>& v) {
    const AddNormed r = add_rmsnorm(v[0], v[1], v[2], 1e-5, "x", true);
    return add(r.h, r.n.y);
  };
  const Tensor x = random_tensor(rng, {3, 130}, DType::f64), a = random_tensor(rng, {3, 130}, DType::f64);
  const Tensor w = random_tensor(rng, {130}, DType::f64, Device::cpu(), 0.5, 1.5);
  EXPECT_TRUE(gradcheck(fn, {x, a, w}));
}

TEST(AddRmsnorm, Errors) {
  const Variable x(Tensor::zeros({2, 256}, DType::f32)), w(Tensor::zeros({256}, DType::f32));
  EXPECT_THROW(add_rmsnorm(x, Variable(Tensor::zeros({2, 128}, DType::f32)), w, kEps), ShapeError);
  EXPECT_THROW(add_rmsnorm(x, Variable(Tensor::zeros({2, 256}, DType::f64)), w, kEps), DTypeError);
  EXPECT_THROW(add_rmsnorm(x, x, Variable(Tensor::zeros({128}, DType::f32)), kEps), ShapeError);
  EXPECT_TRUE(throws_naming<DTypeError>(  // bf16 is the GPU's
      [] {
        const Variable xb(Tensor::zeros({2, 256}, DType::bf16));
        add_rmsnorm(xb, xb, Variable(Tensor::zeros({256}, DType::bf16)), kEps, "mlp: x");
      },
      {"add_rmsnorm at 'mlp: x'", "bf16"}));
  std::vector<float> v(1);
  std::vector<uint8_t> q(1);
  EXPECT_THROW(
      add_rmsnorm_forward_cpu<float>(v.data(), nullptr, nullptr, v.data(), v.data(), v.data(), v.data(), 1, 1, kEps),
      Error);
  EXPECT_THROW(
      add_rmsnorm_forward_cpu<float>(v.data(), v.data(), q.data(), v.data(), v.data(), v.data(), v.data(), -1, 1, kEps),
      ShapeError);
}

// ---- CUDA ----------------------------------------------------------------------------------------

TEST(AddRmsnormCuda, MatchesUnfusedBitwise) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (DType dtype : {DType::bf16, DType::f32})
    for (const NormCase& c : kNormCases)
      for (Mode m : kModes) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " rows " << c.rows << " hidden " << c.hidden << " y "
                                          << m.y << " q " << m.q);
        const Tensor x = edge_rows(rng, c), a = edge_rows(rng, c), w = norm_weight(rng, c.hidden);
        expect_same(run_cuda(x, a, w, dtype, m, true), reference_of(run_cuda(x, a, w, dtype, m, false), m), m,
                    c.hidden);
      }
}

TEST(AddRmsnormCuda, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Mode both{true, true};
  for (const NormCase& c : kNormCases) {
    SCOPED_TRACE(::testing::Message() << "rows " << c.rows << " hidden " << c.hidden);
    const Tensor x = edge_rows(rng, c), a = edge_rows(rng, c), w = norm_weight(rng, c.hidden);
    const Out ref = run_cpu<float>(x, a, w, both, true), got = run_cuda(x, a, w, DType::f32, both, true);
    EXPECT_TRUE(bit_equal(got.h, ref.h));
    EXPECT_TRUE(all_close(got.y, ref.y, 1e-5, 0));
    EXPECT_TRUE(fp8_close(got.q, ref.q, c.hidden, 1e-3));
  }
}

TEST(AddRmsnormCuda, NodeMatchesComposition) {
  FLOWMOE_REQUIRE_CUDA();
  node_matches_composition(Device::cuda(0), DType::bf16);
  node_matches_composition(Device::cuda(0), DType::f32);
}
