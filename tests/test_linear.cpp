// matmul / linear: the Eigen reference against plain loops, gradient checks of the reference, CUDA
// vs CPU on fresh random inputs over edge shapes (f32 and bf16, forward and backward), the cuBLASLt
// launcher's strides / fp32 accumulation, and the error messages.
//
// Tolerances (rel_error = ||got - ref|| / ||ref||): f32 < 1e-5 (both sides fp32 math, no TF32);
// bf16 < 1e-2 against an f32 CPU reference computed on the bf16-rounded inputs (the GPU rounds its
// output to bf16: ~2^-9 per element).
#include <string>
#include <tuple>

#include "kernels/linear.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// op(a)·op(b) by plain loops in double: the readable definition the Eigen reference must match.
std::vector<double> loop_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const std::vector<double>& a,
                              const std::vector<double>& b) {
  std::vector<double> c(size_t(m * n), 0.0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p)
        s += a[size_t(ta ? p * m + i : i * k + p)] * b[size_t(tb ? j * k + p : p * n + j)];
      c[size_t(i * n + j)] = s;
    }
  return c;
}

struct LinearResult {
  Tensor y, dx, dw, db;
};
// y = linear(x, w, bias) and its gradients for the cotangent dy, on the inputs' device.
LinearResult run_linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& dy) {
  Variable vx(x, true), vw(w, true), vb = bias.defined() ? Variable(bias, true) : Variable();
  Variable y = linear(vx, vw, vb);
  y.backward(dy);
  return {y.data(), vx.grad(), vw.grad(), bias.defined() ? vb.grad() : Tensor()};
}

Shape with_last(Shape s, int64_t last) {
  s.back() = last;
  return s;
}

}  // namespace

// ---- CPU reference ----------------------------------------------------------------------------

TEST(LinearCpu, GemmMatchesLoops) {
  Rng rng(test_seed());
  for (auto [m, n, k] :
       {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {5, 7, 3}, {37, 53, 129}, {0, 4, 3}, {4, 0, 3}, {4, 3, 0}})
    for (bool ta : {false, true})
      for (bool tb : {false, true})
        for (bool accumulate : {false, true}) {
          SCOPED_TRACE(testing::Message() << "m " << m << " n " << n << " k " << k << " ta " << ta << " tb " << tb
                                          << " accumulate " << accumulate);
          Tensor a = random_tensor(rng, ta ? Shape{k, m} : Shape{m, k}, DType::f64);
          Tensor b = random_tensor(rng, tb ? Shape{n, k} : Shape{k, n}, DType::f64);
          Tensor c0 = random_tensor(rng, {m, n}, DType::f64), c = c0.clone();
          gemm_cpu<double>(ta, tb, m, n, k, a.data<double>(), b.data<double>(), c.data<double>(), accumulate);
          std::vector<double> want = loop_gemm(ta, tb, m, n, k, a.to_doubles(), b.to_doubles());
          if (accumulate)
            for (size_t i = 0; i < want.size(); ++i) want[i] += c0.to_doubles()[i];
          EXPECT_TRUE(all_close(c, Tensor::from_doubles(want, {m, n}), 1e-12, 1e-12));
        }
}

TEST(LinearCpu, BiasAddAndGradMatchLoops) {
  Rng rng(test_seed());
  for (auto [m, n] : {std::pair<int64_t, int64_t>{5, 3}, {0, 4}, {300, 7}}) {
    SCOPED_TRACE(testing::Message() << "m " << m << " n " << n);
    Tensor c = random_tensor(rng, {m, n}, DType::f64), bias = random_tensor(rng, {n}, DType::f64);
    std::vector<double> cv = c.to_doubles(), bv = bias.to_doubles(), sums(size_t(n), 0.0);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        sums[size_t(j)] += cv[size_t(i * n + j)];
        cv[size_t(i * n + j)] += bv[size_t(j)];
      }
    Tensor d_bias = Tensor::empty({n}, DType::f64);
    bias_grad_cpu<double>(d_bias.data<double>(), c.data<double>(), m, n);
    EXPECT_TRUE(all_close(d_bias, Tensor::from_doubles(sums, {n}), 1e-12, 1e-12));
    add_bias_cpu<double>(c.data<double>(), bias.data<double>(), m, n);
    EXPECT_TRUE(all_close(c, Tensor::from_doubles(cv, {m, n}), 1e-12, 1e-12));
  }
}

TEST(Linear, Gradcheck) {
  Rng rng(test_seed());
  auto mm = [](const std::vector<Variable>& v) { return matmul(v[0], v[1]); };
  auto lin = [](const std::vector<Variable>& v) { return linear(v[0], v[1]); };
  auto lin_bias = [](const std::vector<Variable>& v) { return linear(v[0], v[1], v[2]); };
  auto r = [&](const Shape& s) { return random_tensor(rng, s, DType::f64); };
  EXPECT_TRUE(gradcheck(mm, {r({3, 4}), r({4, 5})}));
  EXPECT_TRUE(gradcheck(mm, {r({1, 1}), r({1, 1})}));
  EXPECT_TRUE(gradcheck(lin, {r({3, 4}), r({5, 4})}));
  EXPECT_TRUE(gradcheck(lin_bias, {r({3, 4}), r({5, 4}), r({5})}));
  EXPECT_TRUE(gradcheck(lin_bias, {r({2, 3, 4}), r({5, 4}), r({5})}));  // 3-D x
  EXPECT_TRUE(gradcheck(lin, {r({4}), r({2, 4})}));                     // 1-D x
}

TEST(Linear, TransposedViewOperandsMatchCopies) {
  Rng rng(test_seed());
  Tensor a = random_tensor(rng, {6, 4}, DType::f64).transpose(0, 1);  // [4, 6], not contiguous
  Tensor b = random_tensor(rng, {5, 6}, DType::f64).transpose(0, 1);  // [6, 5]
  Tensor got = matmul(Variable(a), Variable(b)).data();
  Tensor want = matmul(Variable(a.contiguous()), Variable(b.contiguous())).data();
  EXPECT_TRUE(all_close(got, want, 1e-12, 1e-12));
}

TEST(Linear, EmptyShapesOnCpu) {
  Rng rng(test_seed());
  // M = 0: an empty output; the weight gradient is an empty sum (zeros).
  LinearResult r = run_linear(random_tensor(rng, {0, 7}), random_tensor(rng, {5, 7}), random_tensor(rng, {5}),
                              Tensor::zeros({0, 5}, DType::f32));
  EXPECT_EQ(r.y.shape(), (Shape{0, 5}));
  EXPECT_EQ(r.dx.shape(), (Shape{0, 7}));
  EXPECT_TRUE(bit_equal(r.dw, Tensor::zeros({5, 7}, DType::f32)));
  EXPECT_TRUE(bit_equal(r.db, Tensor::zeros({5}, DType::f32)));
  // K = 0: y is the bias on every row.
  Tensor bias = random_tensor(rng, {3});
  Tensor y =
      linear(Variable(Tensor::zeros({2, 0}, DType::f32)), Variable(Tensor::zeros({3, 0}, DType::f32)), Variable(bias))
          .data();
  std::vector<float> bv = bias.to_floats();
  EXPECT_TRUE(bit_equal(y, Tensor::from_floats({bv[0], bv[1], bv[2], bv[0], bv[1], bv[2]}, {2, 3})));
  EXPECT_TRUE(
      bit_equal(matmul(Variable(Tensor::zeros({2, 0}, DType::f32)), Variable(Tensor::zeros({0, 3}, DType::f32))).data(),
                Tensor::zeros({2, 3}, DType::f32)));
}

TEST(Linear, ErrorsNameBothShapes) {
  auto v = [](const Shape& s, DType t = DType::f32) { return Variable(Tensor::zeros(s, t)); };
  EXPECT_TRUE(throws_naming<ShapeError>([&] { matmul(v({2, 3}), v({4, 5})); }, {"matmul", "[2, 3]", "[4, 5]"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { matmul(v({2, 3, 4}), v({4, 5})); }, {"[2, 3, 4]", "[4, 5]"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { linear(v({2, 3, 5}), v({4, 6})); }, {"linear", "[2, 3, 5]", "[4, 6]"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { linear(v({2, 6}), v({4, 6}), v({7})); }, {"[7]", "[4, 6]"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { linear(v({2, 6}), v({6})); }, {"[2, 6]", "[6]"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { matmul(v({2, 3}), v({3, 4}, DType::f64)); }, {"f32", "f64"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { linear(v({2, 6}), v({4, 6}), v({4}, DType::f64)); }, {"f32", "f64"}));
  // bf16 math is GPU-only: the CPU refuses clearly.
  EXPECT_TRUE(throws_naming<DTypeError>([&] { matmul(v({2, 3}, DType::bf16), v({3, 4}, DType::bf16)); }, {"bf16"}));
}

// ---- CUDA vs CPU ------------------------------------------------------------------------------

TEST(LinearCuda, MatchesCpuForwardAndBackward) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  struct Case {
    Shape x;  // [..., K]
    int64_t n;
    bool bias;
  };
  const Case cases[] = {{{0, 7}, 5, true},        {{5, 0}, 7, true},      {{4, 6}, 0, true},
                        {{1, 1}, 1, true},        {{1, 1}, 1, false},     {{37, 129}, 53, true},
                        {{2, 19, 33}, 24, false}, {{64, 256}, 128, true}, {{1024, 1024}, 4096, true}};
  for (DType dtype : {DType::f32, DType::bf16})
    for (const Case& c : cases) {
      SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " x " << shape_str(c.x) << " n " << c.n
                                      << (c.bias ? " with bias" : ""));
      int64_t k = c.x.back();
      // The reference sees exactly the values the GPU sees: inputs rounded to the GPU dtype first.
      auto draw = [&](const Shape& s) { return random_tensor(rng, s).to(dtype).to(DType::f32); };
      Tensor x = draw(c.x), w = draw({c.n, k}), bias = c.bias ? draw({c.n}) : Tensor(), dy = draw(with_last(c.x, c.n));
      auto gpu = [&](const Tensor& t) { return t.defined() ? t.to(dtype).to(Device::cuda()) : t; };
      LinearResult want = run_linear(x, w, bias, dy);
      LinearResult got = run_linear(gpu(x), gpu(w), gpu(bias), gpu(dy));
      double tol = dtype == DType::f32 ? 1e-5 : 1e-2;
      const std::pair<const char*, std::pair<Tensor, Tensor>> outs[] = {
          {"y", {got.y, want.y}}, {"dx", {got.dx, want.dx}}, {"dw", {got.dw, want.dw}}, {"db", {got.db, want.db}}};
      for (const auto& [name, gw] : outs) {
        const auto& [g, r] = gw;
        if (!r.defined()) continue;
        ASSERT_EQ(g.shape(), r.shape()) << name;
        EXPECT_EQ(g.dtype(), dtype) << name;
        EXPECT_LT(rel_error(g, r), tol) << name;
      }
    }
}

TEST(LinearCuda, MatmulMatchesCpuForwardAndBackward) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (DType dtype : {DType::f32, DType::bf16})
    for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{0, 5, 7}, {5, 7, 0}, {1, 1, 1}, {37, 53, 129}}) {
      SCOPED_TRACE(testing::Message() << dtype_name(dtype) << " m " << m << " n " << n << " k " << k);
      auto draw = [&](const Shape& s) { return random_tensor(rng, s).to(dtype).to(DType::f32); };
      Tensor a = draw({m, k}), b = draw({k, n}), dc = draw({m, n});
      auto run = [&](Device d) {
        auto put = [&](const Tensor& t) { return d.is_cpu() ? t : t.to(dtype).to(d); };
        Variable va(put(a), true), vb(put(b), true);
        Variable c = matmul(va, vb);
        c.backward(put(dc));
        return std::make_tuple(c.data(), va.grad(), vb.grad());
      };
      auto [c_ref, da_ref, db_ref] = run(Device::cpu());
      auto [c_got, da_got, db_got] = run(Device::cuda());
      double tol = dtype == DType::f32 ? 1e-5 : 1e-2;
      EXPECT_LT(rel_error(c_got, c_ref), tol);
      EXPECT_LT(rel_error(da_got, da_ref), tol);
      EXPECT_LT(rel_error(db_got, db_ref), tol);
    }
}

// A row slice starts mid-allocation (2-byte aligned here): the plan cache must key on alignment.
TEST(LinearCuda, MisalignedRowSlice) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  Tensor x_all = random_tensor(rng, {38, 129}).to(DType::bf16), w = random_tensor(rng, {53, 129}).to(DType::bf16);
  Tensor x = x_all.slice(0, 1, 38);
  Tensor got = linear(Variable(x.to(Device::cuda())), Variable(w.to(Device::cuda()))).data();
  Tensor got_sliced = linear(Variable(x_all.to(Device::cuda()).slice(0, 1, 38)), Variable(w.to(Device::cuda()))).data();
  Tensor want = linear(Variable(x.to(DType::f32)), Variable(w.to(DType::f32))).data();
  EXPECT_LT(rel_error(got, want), 1e-2);
  EXPECT_LT(rel_error(got_sliced, want), 1e-2);
}

// The launcher directly: padded row strides, a bf16 GEMM accumulated into fp32 with a bias, and
// padding columns left untouched; then the bias gradient over several chunks, bit-reproducible.
TEST(LinearCuda, LauncherStridesAndFp32Accumulate) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const int64_t m = 37, n = 53, k = 129, lda = k + 8, ldb = k + 3, ldc = n + 5;
  Tensor a_pad = random_tensor(rng, {m, lda}).to(DType::bf16), b_pad = random_tensor(rng, {n, ldb}).to(DType::bf16);
  Tensor c_pad = random_tensor(rng, {m, ldc}), bias = random_tensor(rng, {n});
  Tensor ga = a_pad.to(Device::cuda()), gb = b_pad.to(Device::cuda()), gc = c_pad.to(Device::cuda());
  Tensor gbias = bias.to(Device::cuda());
  gemm_cuda(false, true, m, n, k, DType::bf16, ga.raw_data(), lda, gb.raw_data(), ldb, DType::f32, gc.raw_data(), ldc,
            gbias.raw_data(), true, current_stream(0));
  Tensor got = gc.to(Device::cpu());

  Tensor a = a_pad.slice(1, 0, k).to(DType::f32).contiguous(), b = b_pad.slice(1, 0, k).to(DType::f32).contiguous();
  Tensor want = c_pad.slice(1, 0, n).contiguous();
  gemm_cpu<float>(false, true, m, n, k, a.data<float>(), b.data<float>(), want.data<float>(), true);
  add_bias_cpu<float>(want.data<float>(), bias.data<float>(), m, n);
  EXPECT_LT(rel_error(got.slice(1, 0, n).contiguous(), want), 1e-5);
  EXPECT_TRUE(bit_equal(got.slice(1, n, ldc).contiguous(), c_pad.slice(1, n, ldc).contiguous()));

  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const int64_t rows = 3 * kBiasGradRows + 17, cols = 70;
    Tensor dy = random_tensor(rng, {rows, cols}).to(dtype), g_dy = dy.to(Device::cuda());
    Tensor partial = Tensor::empty({bias_grad_num_chunks(rows), cols}, DType::f32, Device::cuda());
    Tensor d1 = Tensor::empty({cols}, dtype, Device::cuda()), d2 = Tensor::empty({cols}, dtype, Device::cuda());
    bias_grad_cuda(dtype, d1.raw_data(), g_dy.raw_data(), rows, cols, partial.data<float>(), current_stream(0));
    bias_grad_cuda(dtype, d2.raw_data(), g_dy.raw_data(), rows, cols, partial.data<float>(), current_stream(0));
    Tensor dyf = dy.to(DType::f32), ref = Tensor::empty({cols}, DType::f32);
    bias_grad_cpu<float>(ref.data<float>(), dyf.data<float>(), rows, cols);
    EXPECT_LT(rel_error(d1, ref), dtype == DType::f32 ? 1e-5 : 1e-2);
    EXPECT_TRUE(bit_equal(d1, d2));
  }
}

namespace {

// One gemm_cuda on fresh packed random operands against gemm_cpu (+ add_bias_cpu) on the same values;
// a second call into another buffer (a cached plan) must give the same bits.
void expect_gemm_matches_cpu(Rng& rng, bool ta, bool tb, int64_t m, int64_t n, int64_t k, DType ab_dtype, DType c_dtype,
                             bool with_bias) {
  SCOPED_TRACE(testing::Message() << "ta " << ta << " tb " << tb << " m " << m << " n " << n << " k " << k << " "
                                  << dtype_name(ab_dtype) << " -> " << dtype_name(c_dtype)
                                  << (with_bias ? " with bias" : ""));
  auto draw = [&](const Shape& s, DType t) { return random_tensor(rng, s).to(t).to(DType::f32); };
  Tensor a = draw(ta ? Shape{k, m} : Shape{m, k}, ab_dtype), b = draw(tb ? Shape{n, k} : Shape{k, n}, ab_dtype);
  Tensor bias = with_bias ? draw({n}, c_dtype) : Tensor();
  const Device gpu = Device::cuda();
  Tensor ga = a.to(ab_dtype).to(gpu), gb = b.to(ab_dtype).to(gpu), gbias = with_bias ? bias.to(c_dtype).to(gpu) : bias;
  Tensor c1 = Tensor::empty({m, n}, c_dtype, gpu), c2 = Tensor::empty({m, n}, c_dtype, gpu);
  for (Tensor* c : {&c1, &c2})
    gemm_cuda(ta, tb, m, n, k, ab_dtype, ga.raw_data(), ta ? m : k, gb.raw_data(), tb ? k : n, c_dtype, c->raw_data(),
              n, with_bias ? gbias.raw_data() : nullptr, false, current_stream(0));
  Tensor want = Tensor::empty({m, n}, DType::f32);
  gemm_cpu<float>(ta, tb, m, n, k, a.data<float>(), b.data<float>(), want.data<float>(), false);
  if (with_bias) add_bias_cpu<float>(want.data<float>(), bias.data<float>(), m, n);
  EXPECT_LT(rel_error(c1, want), c_dtype == DType::f32 ? 1e-5 : 1e-2);
  EXPECT_TRUE(bit_equal(c1, c2)) << "a repeat call with a cached plan";
}

}  // namespace

// gemm_cuda's plan cache: every exact problem gets its own plan, whose algorithm usually comes from
// its bucket (the row count, m or a wgrad's k, rounded up a quarter octave: 17 -> 20, 1040 -> 1280).
// Counts near bucket edges, in the three shapes grouped_linear issues (fprop with a fused bias,
// dgrad, wgrad into fp32 with k = rows), must each match the CPU; calling them all again builds and
// queries nothing.
TEST(LinearCuda, PlanCacheAcrossRowCounts) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const int64_t n = 72, feat = 136;
  const int64_t counts[] = {1, 2, 15, 16, 17, 31, 33, 100, 127, 129, 255, 257, 1000, 1023, 1040};
  auto run_all = [&] {
    for (DType dtype : {DType::f32, DType::bf16})
      for (int64_t rows : counts) {
        expect_gemm_matches_cpu(rng, false, true, rows, n, feat, dtype, dtype, true);        // fprop + bias
        expect_gemm_matches_cpu(rng, false, false, rows, feat, n, dtype, dtype, false);      // dgrad
        expect_gemm_matches_cpu(rng, true, false, n, feat, rows, dtype, DType::f32, false);  // wgrad, k = rows
      }
  };
  run_all();
  const GemmPlanStats before = gemm_cuda_plan_stats();
  run_all();
  const GemmPlanStats after = gemm_cuda_plan_stats();
  EXPECT_EQ(after.plans_built, before.plans_built);
  EXPECT_EQ(after.heuristic_queries, before.heuristic_queries);
}

// A new row count in a bucket already seen costs no heuristic query, unless the bucket's algorithm
// is refused for it (then the stats count one reject per extra query). Shapes unused elsewhere.
TEST(LinearCuda, NewRowCountsReuseTheirBucket) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const int64_t n = 96, feat = 264;
  for (bool wgrad : {false, true}) {
    SCOPED_TRACE(wgrad ? "wgrad (k = rows)" : "fprop (m = rows)");
    for (int64_t rows = 1025; rows <= 1040; ++rows) {  // all in bucket 1280
      const GemmPlanStats before = gemm_cuda_plan_stats();
      if (wgrad) {
        expect_gemm_matches_cpu(rng, true, false, n, feat, rows, DType::bf16, DType::f32, false);
      } else {
        expect_gemm_matches_cpu(rng, false, true, rows, n, feat, DType::bf16, DType::bf16, false);
      }
      const GemmPlanStats after = gemm_cuda_plan_stats();
      EXPECT_EQ(after.plans_built - before.plans_built, 1u) << rows << " rows";
      if (rows > 1025) {  // the first one may have queried its bucket
        EXPECT_EQ(after.heuristic_queries - before.heuristic_queries, after.bucket_rejects - before.bucket_rejects)
            << rows << " rows";
      }
    }
  }
}

// One cached plan (same shape and alignments) serves calls with different bias buffers: the fused
// epilogue must read each call's own bias.
TEST(LinearCuda, CachedPlanUsesEachCallsBias) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const int64_t m = 33, n = 40, k = 24;
  Tensor a = random_tensor(rng, {m, k}), b = random_tensor(rng, {n, k});
  Tensor biases[] = {random_tensor(rng, {n}), random_tensor(rng, {n})};
  Tensor ga = a.to(Device::cuda()), gb = b.to(Device::cuda());
  Tensor gbiases[] = {biases[0].to(Device::cuda()), biases[1].to(Device::cuda())};
  for (int i : {0, 1, 0}) {
    SCOPED_TRACE(testing::Message() << "bias " << i);
    Tensor c = Tensor::empty({m, n}, DType::f32, Device::cuda());
    gemm_cuda(false, true, m, n, k, DType::f32, ga.raw_data(), k, gb.raw_data(), k, DType::f32, c.raw_data(), n,
              gbiases[i].raw_data(), false, current_stream(0));
    Tensor want = Tensor::empty({m, n}, DType::f32);
    gemm_cpu<float>(false, true, m, n, k, a.data<float>(), b.data<float>(), want.data<float>(), false);
    add_bias_cpu<float>(want.data<float>(), biases[i].data<float>(), m, n);
    EXPECT_LT(rel_error(c, want), 1e-5);
  }
}
