// split_rows, concat_rows and concat_last (engine/ops/rows.cpp): the chunks' values and FP8 scales, empty chunks, the
// gradients (finite differences), bad bounds, and on a GPU the same results as on the CPU.
#include <gtest/gtest.h>

#include "engine/ops/ops.h"
#include "engine/ops/quantize.h"
#include "tests/support/checks.h"

namespace flowmoe::test {
namespace {

TEST(Rows, SplitGivesRowViewsAndConcatStacksThemBack) {
  Rng rng(test_seed());
  const Tensor x = rng.normal({7, 3}, 0, 1);
  for (const std::vector<int64_t>& bounds : {std::vector<int64_t>{0, 4, 7}, {0, 0, 7, 7}, {0, 3, 5, 7}}) {
    const std::vector<Variable> parts = split_rows(Variable(x), bounds);
    ASSERT_EQ(parts.size(), bounds.size() - 1);
    for (size_t i = 0; i < parts.size(); ++i)
      EXPECT_TRUE(bit_equal(parts[i].data().contiguous(), x.slice(0, bounds[i], bounds[i + 1]).contiguous()));
    EXPECT_TRUE(bit_equal(concat_rows(parts).data(), x));
  }
  EXPECT_EQ(even_row_bounds(37, 2), (std::vector<int64_t>{0, 19, 37}));
  EXPECT_EQ(even_row_bounds(1, 3), (std::vector<int64_t>{0, 1, 1, 1}));
  EXPECT_EQ(even_row_bounds(0, 2), (std::vector<int64_t>{0, 0, 0}));
}

TEST(Rows, Fp8ChunksKeepTheirRowsScales) {
  Rng rng(test_seed());
  const Tensor q = quantize_rowwise_tensor(rng.normal({5, 256}, 0, 3), "");
  const std::vector<Variable> parts = split_rows(Variable(q), {0, 2, 5});
  const Tensor& s = q.fp8_scales()->scale_inv;
  ASSERT_TRUE(parts[1].data().fp8_scales() != nullptr);
  EXPECT_TRUE(bit_equal(parts[1].data().fp8_scales()->scale_inv.contiguous(), s.slice(0, 2, 5).contiguous()));
  EXPECT_TRUE(bit_equal(parts[1].data().contiguous(), q.slice(0, 2, 5).contiguous()));
}

TEST(Rows, GradientsMatchFiniteDifferences) {
  Rng rng(test_seed());
  const Tensor x = rng.normal({6, 2}, 0, 1).to(DType::f64), y = rng.normal({3, 2}, 0, 1).to(DType::f64);
  // Each chunk scaled differently, so a chunk's gradient landing on the wrong rows is caught.
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Variable>& v) {
        const std::vector<Variable> p = split_rows(v[0], {0, 1, 1, 6});
        return concat_rows({scale(p[2], 3.0), p[0], scale(p[1], 2.0)});
      },
      {x}));
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return concat_rows({v[1], scale(v[0], -1.5)}); }, {x, y}));
  // A chunk nobody uses gets zero rows.
  Variable xv(x, true);
  const std::vector<Variable> p = split_rows(xv, {0, 2, 6});
  sum(p[1]).backward();
  const std::vector<double> g = xv.grad().to_doubles();
  for (size_t i = 0; i < g.size(); ++i) EXPECT_EQ(g[i], i < 4 ? 0.0 : 1.0) << "element " << i;
}

TEST(Rows, ConcatLastPutsAThenBInEachRow) {
  Rng rng(test_seed());
  const Tensor a = rng.normal({2, 3, 4}, 0, 1), b = rng.normal({2, 3, 4}, 0, 1);
  const Tensor y = concat_last(Variable(a), Variable(b)).data();
  ASSERT_EQ(y.shape(), (Shape{2, 3, 8}));
  const std::vector<double> av = a.to_doubles(), bv = b.to_doubles(), yv = y.to_doubles();
  for (size_t r = 0; r < 6; ++r)
    for (size_t j = 0; j < 4; ++j) {
      EXPECT_EQ(yv[r * 8 + j], av[r * 4 + j]) << "row " << r << " column " << j;
      EXPECT_EQ(yv[r * 8 + 4 + j], bv[r * 4 + j]) << "row " << r << " column " << 4 + j;
    }
  // Each half scaled differently, so a gradient sent to the wrong input is caught.
  const Tensor x64 = a.to(DType::f64), z64 = b.to(DType::f64);
  EXPECT_TRUE(gradcheck([](const std::vector<Variable>& v) { return concat_last(scale(v[0], 2.0), scale(v[1], -0.5)); },
                        {x64, z64}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        concat_last(Variable(a), Variable(Tensor::zeros({2, 3, 5}, DType::f32)));
      },
      {"concat_last", "share shape"}));
}

// MLA's parts (layers/mla.h): columns of different widths joined and split, values and gradients.
TEST(Rows, ConcatLastOfWidthsAndSplitLastAreInverse) {
  Rng rng(test_seed());
  const Tensor a = rng.normal({2, 3, 2}, 0, 1), b = rng.normal({2, 3, 5}, 0, 1), c = rng.normal({2, 3, 1}, 0, 1);
  const Tensor y = concat_last({Variable(a), Variable(b), Variable(c)}).data();
  ASSERT_EQ(y.shape(), (Shape{2, 3, 8}));
  const std::vector<double> av = a.to_doubles(), bv = b.to_doubles(), cv = c.to_doubles(), yv = y.to_doubles();
  for (size_t r = 0; r < 6; ++r) {
    for (size_t j = 0; j < 2; ++j) EXPECT_EQ(yv[r * 8 + j], av[r * 2 + j]) << "row " << r << " column " << j;
    for (size_t j = 0; j < 5; ++j) EXPECT_EQ(yv[r * 8 + 2 + j], bv[r * 5 + j]) << "row " << r << " column " << 2 + j;
    EXPECT_EQ(yv[r * 8 + 7], cv[r]) << "row " << r;
  }
  const std::vector<Variable> parts = split_last(Variable(y), {2, 5, 1});
  ASSERT_EQ(parts.size(), 3u);
  EXPECT_TRUE(bit_equal(parts[0].data(), a));
  EXPECT_TRUE(bit_equal(parts[1].data(), b));
  EXPECT_TRUE(bit_equal(parts[2].data(), c));
  // Each part scaled differently, so a gradient sent to the wrong columns is caught; one split part unused.
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Variable>& v) {
        return concat_last({scale(v[0], 2.0), scale(v[1], -0.5), scale(v[2], 3.0)});
      },
      {a.to(DType::f64), b.to(DType::f64), c.to(DType::f64)}));
  EXPECT_TRUE(gradcheck(
      [](const std::vector<Variable>& v) {
        const std::vector<Variable> p = split_last(v[0], {3, 2, 3});
        return concat_last({scale(p[2], -2.0), scale(p[0], 0.5)});
      },
      {y.to(DType::f64)}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { split_last(Variable(y), {2, 5}); }, {"split_last", "adding up to 7"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        concat_last({Variable(a), Variable(Tensor::zeros({2, 4, 5}, DType::f32))});
      },
      {"concat_last", "does not join"}));
}

TEST(Rows, BadBoundsAndShapesAreNamed) {
  const Variable x(Tensor::zeros({4, 2}, DType::f32));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { split_rows(x, {0, 3}); }, {"bounds", "4 rows"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { split_rows(x, {0, 3, 2, 4}); }, {"must not decrease"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        concat_rows({x, Variable(Tensor::zeros({4, 3}, DType::f32))});
      },
      {"concat_rows", "does not stack"}));
}

TEST(RowsCuda, ConcatLastSameAsTheCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Tensor a = rng.normal({5, 6}, 0, 1).to(DType::bf16), b = rng.normal({5, 6}, 0, 1).to(DType::bf16);
  const Tensor dy = rng.normal({5, 12}, 0, 1).to(DType::bf16);
  std::vector<Tensor> outs;
  for (Device device : {Device::cpu(), Device::cuda(0)}) {
    Variable av(a.to(device), true), bv(b.to(device), true);
    Variable y = concat_last(av, bv);
    y.backward(dy.to(device));
    outs.push_back(y.data().to(Device::cpu()));
    outs.push_back(av.grad().to(Device::cpu()));
    outs.push_back(bv.grad().to(Device::cpu()));
  }
  for (size_t i = 0; i < 3; ++i) EXPECT_TRUE(bit_equal(outs[3 + i], outs[i])) << "output " << i;
}

TEST(RowsCuda, ConcatLastOfWidthsAndSplitLastSameAsTheCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Tensor a = rng.normal({5, 3}, 0, 1).to(DType::bf16), b = rng.normal({5, 6}, 0, 1).to(DType::bf16);
  const Tensor dz = rng.normal({5, 4}, 0, 1).to(DType::bf16);
  std::vector<Tensor> outs;
  for (Device device : {Device::cpu(), Device::cuda(0)}) {
    Variable av(a.to(device), true), bv(b.to(device), true);
    Variable y = concat_last({av, bv});
    const std::vector<Variable> p = split_last(y, {5, 4});
    p[1].backward(dz.to(device));
    outs.push_back(y.data().to(Device::cpu()));
    outs.push_back(p[0].data().to(Device::cpu()));
    outs.push_back(av.grad().to(Device::cpu()));
    outs.push_back(bv.grad().to(Device::cpu()));
  }
  for (size_t i = 0; i < 4; ++i) EXPECT_TRUE(bit_equal(outs[4 + i], outs[i])) << "output " << i;
}

TEST(RowsCuda, SameAsTheCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const Tensor x = rng.normal({9, 5}, 0, 1).to(DType::bf16), dy = rng.normal({9, 5}, 0, 1).to(DType::bf16);
  for (Device device : {Device::cpu(), Device::cuda(0)}) {
    SCOPED_TRACE(device.str());
    Variable xv(x.to(device), true);
    const std::vector<Variable> p = split_rows(xv, {0, 4, 4, 9});
    Variable y = concat_rows({p[2], p[0], p[1]});
    y.backward(dy.to(device));
    const Tensor want = Tensor::zeros({9, 5}, DType::bf16);
    want.slice(0, 0, 5).copy_(x.slice(0, 4, 9));
    want.slice(0, 5, 9).copy_(x.slice(0, 0, 4));
    EXPECT_TRUE(bit_equal(y.data().to(Device::cpu()), want));
    const Tensor dx = Tensor::zeros({9, 5}, DType::bf16);
    dx.slice(0, 4, 9).copy_(dy.slice(0, 0, 5));
    dx.slice(0, 0, 4).copy_(dy.slice(0, 5, 9));
    EXPECT_TRUE(bit_equal(xv.grad().to(Device::cpu()), dx));
  }
}

}  // namespace
}  // namespace flowmoe::test
