// Counted rows (kernels/common/counted_rows.h): swiglu and swiglu_quant over a worst-case buffer with the
// expert GEMMs' device counts compute the rows the counts cover, bit for bit as without counts, and leave
// the rest unwritten. Cases: counts summing to part of the rows (with an empty expert), to none, and to more
// than the buffer (clamped); F = 136 (the general kernels) and 256 (the 128-aligned FP8 expert kernels).
#include <algorithm>
#include <cfenv>
#include <cmath>
#include <cstring>
#include <functional>

#include "engine/ops/ops.h"
#include "engine/ops/swiglu_quant.h"
#include "kernels/fp8.h"
#include "kernels/swiglu.h"
#include "kernels/swiglu_quant.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

constexpr int64_t kRows = 40;

Tensor counts_on(const std::vector<int64_t>& counts, Device device) {
  return Tensor::from_ints(counts, {int64_t(counts.size())}, DType::i32, device);
}

int64_t covered(const std::vector<int64_t>& counts) {
  int64_t sum = 0;
  for (int64_t c : counts) sum += c;
  return std::min(sum, kRows);
}

// The first `rows` rows of t, on the CPU.
Tensor head(const Tensor& t, int64_t rows) { return t.to(Device::cpu()).slice(0, 0, rows).contiguous(); }

const std::vector<std::vector<int64_t>> kCounts = {{16, 0, 8}, {0, 0}, {32, 16}};

void check_swiglu(Device device, DType dtype, int64_t F) {
  Rng rng(7);
  const Tensor x = random_tensor(rng, {kRows, 2 * F}, dtype, device, -3, 3);
  const Tensor dy = random_tensor(rng, {kRows, F}, dtype, device);
  Variable full(x, true);
  Variable y_full = swiglu(full);
  y_full.backward(dy);
  for (const auto& c : kCounts) {
    SCOPED_TRACE(testing::Message() << "counts sum " << covered(c) << ", F " << F << ", " << device.str());
    Variable part(x, true);
    Variable y = swiglu(part, counts_on(c, device));
    y.backward(dy);
    const int64_t rows = covered(c);
    EXPECT_TRUE(bit_equal(head(y.data(), rows), head(y_full.data(), rows)));
    EXPECT_TRUE(bit_equal(head(part.grad(), rows), head(full.grad(), rows)));
  }
}

void check_swiglu_quant(Device device, DType dtype, int64_t F) {
  Rng rng(11);
  const Tensor h = random_tensor(rng, {kRows, 2 * F}, dtype, device, -3, 3);
  const Tensor p = random_tensor(rng, {kRows}, DType::f32, device, 0, 1);
  const Tensor da = random_tensor(rng, {kRows, F}, dtype, device);
  Variable h_full(h, true), p_full(p, true);
  Variable a_full = swiglu_quant(h_full, p_full, true);
  a_full.backward(da);
  for (const auto& c : kCounts) {
    SCOPED_TRACE(testing::Message() << "counts sum " << covered(c) << ", F " << F << ", " << device.str());
    Variable hv(h, true), pv(p, true);
    Variable a = swiglu_quant(hv, pv, true, counts_on(c, device));
    a.backward(da);
    const int64_t rows = covered(c);
    EXPECT_TRUE(bit_equal(head(a.data(), rows), head(a_full.data(), rows)));
    EXPECT_TRUE(
        bit_equal(head(a.data().fp8_scales()->scale_inv, rows), head(a_full.data().fp8_scales()->scale_inv, rows)));
    EXPECT_TRUE(bit_equal(head(hv.grad(), rows), head(h_full.grad(), rows)));
    EXPECT_TRUE(
        bit_equal(head(hv.grad().fp8_scales()->scale_inv, rows), head(h_full.grad().fp8_scales()->scale_inv, rows)));
    EXPECT_TRUE(bit_equal(head(pv.grad().view({kRows, 1}), rows), head(p_full.grad().view({kRows, 1}), rows)));
  }
}

// Bytes of t's rows [from, kRows) all equal to `fill`.
bool tail_is(const Tensor& t, int64_t from, unsigned char fill) {
  const Tensor c = t.to(Device::cpu()).contiguous();
  const size_t row = c.nbytes() / size_t(kRows);
  const auto* b = static_cast<const unsigned char*>(c.raw_data());
  for (size_t i = size_t(from) * row; i < c.nbytes(); ++i)
    if (b[i] != fill) return false;
  return true;
}

}  // namespace

TEST(CountedRows, SwigluComputesTheCountedRowsAsWithoutCounts) {
  for (int64_t F : {136, 256}) check_swiglu(Device::cpu(), DType::f32, F);
}

TEST(CountedRows, SwigluQuantComputesTheCountedRowsAsWithoutCounts) {
  for (int64_t F : {136, 256}) check_swiglu_quant(Device::cpu(), DType::f32, F);
}

// On the CPU too the rows past the counts are not computed: tail rows whose SwiGLU would raise the IEEE invalid
// flag (gate +inf, up 0: silu(inf) * 0) leave it clear in the forward and in the backward, of swiglu and of
// swiglu_quant, while the counted rows' values are finite. (Their bytes are as allocated, so the comparisons above,
// of the counted rows only, cannot tell.)
TEST(CountedRows, RowsPastTheCountsAreNotComputedOnTheCpu) {
  const int64_t F = 136, rows = 24;
  const Tensor counts = counts_on({16, 0, 8}, Device::cpu());
  Rng rng(5);
  Tensor h = random_tensor(rng, {kRows, 2 * F}, DType::f32, Device::cpu(), -3, 3);
  float* tail = h.data<float>() + rows * 2 * F;
  for (int64_t r = rows; r < kRows; ++r, tail += 2 * F) {
    std::fill(tail, tail + F, INFINITY);
    std::fill(tail + F, tail + 2 * F, 0.0f);
  }
  const Tensor p = random_tensor(rng, {kRows}, DType::f32, Device::cpu(), 0, 1);
  const Tensor dy = random_tensor(rng, {kRows, F});
  const auto invalid_raised = [](const std::function<void()>& f) {
    std::feclearexcept(FE_ALL_EXCEPT);
    f();
    return std::fetestexcept(FE_INVALID) != 0;
  };
  ASSERT_TRUE(invalid_raised([&] { swiglu(Variable(h, false)); })) << "the tail rows do raise it when computed";
  {
    Variable x(h, true);
    Variable y;
    EXPECT_FALSE(invalid_raised([&] { y = swiglu(x, counts); })) << "swiglu forward";
    EXPECT_FALSE(invalid_raised([&] { y.backward(dy); })) << "swiglu backward";
  }
  {
    Variable x(h, true), pv(p, true);
    Variable a;
    EXPECT_FALSE(invalid_raised([&] { a = swiglu_quant(x, pv, true, counts); })) << "swiglu_quant forward";
    EXPECT_FALSE(invalid_raised([&] { a.backward(dy); })) << "swiglu_quant backward";
  }
}

TEST(CountedRows, BadCountsAreShapeErrors) {
  Variable x(Tensor::zeros({4, 8}, DType::f32), false);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { swiglu(x, Tensor::zeros({2}, DType::f32)); }, {"row counts", "i32"}));
  Variable x3(Tensor::zeros({2, 2, 8}, DType::f32), false);
  EXPECT_TRUE(throws_naming<ShapeError>([&] { swiglu(x3, counts_on({1}, Device::cpu())); }, {"2-D"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { swiglu_quant(x, Variable(), true, Tensor::zeros({2}, DType::f32)); },
                                        {"row counts", "i32"}));
}

TEST(CountedRowsCuda, SwigluAndSwigluQuantComputeTheCountedRowsAsWithoutCounts) {
  FLOWMOE_REQUIRE_CUDA();
  for (int64_t F : {136, 256}) {
    check_swiglu(Device::cuda(0), DType::bf16, F);
    check_swiglu_quant(Device::cuda(0), DType::bf16, F);
  }
}

// The kernels leave every row past the counts as it was: forward, backward, both SwiGLU+quantize backwards.
TEST(CountedRowsCuda, RowsPastTheCountsAreNotWritten) {
  FLOWMOE_REQUIRE_CUDA();
  const Device dev = Device::cuda(0);
  const Tensor counts = counts_on({16, 0, 8}, dev);
  const CountedRows counted{counts.data<int32_t>(), 3};
  const int64_t rows = 24;
  cudaStream_t stream = current_stream(0);
  for (int64_t F : {136, 256}) {
    SCOPED_TRACE(testing::Message() << "F " << F);
    Rng rng(3);
    const Tensor h = random_tensor(rng, {kRows, 2 * F}, DType::bf16, dev);
    const Tensor da = random_tensor(rng, {kRows, F}, DType::bf16, dev);
    const Tensor p = random_tensor(rng, {kRows}, DType::f32, dev, 0, 1);
    auto filled = [&](Shape shape, DType dtype) {
      Tensor t = Tensor::empty(shape, dtype, dev);
      cuda_memset(t.raw_data(), 0x5a, t.nbytes(), 0);  // on the stream the kernels run on
      return t;
    };
    Tensor out = filled({kRows, F}, DType::bf16), d_in = filled({kRows, 2 * F}, DType::bf16);
    swiglu_forward_cuda(DType::bf16, out.raw_data(), h.raw_data(), kRows, F, stream, counted);
    swiglu_backward_cuda(DType::bf16, d_in.raw_data(), da.raw_data(), h.raw_data(), kRows, F, stream, counted);
    Tensor q = filled({kRows, F}, DType::e4m3), s = filled({kRows, fp8_num_blocks(F)}, DType::f32);
    swiglu_quant_forward_cuda(DType::bf16, h.raw_data(), p.data<float>(), kRows, F, static_cast<uint8_t*>(q.raw_data()),
                              s.data<float>(), stream, counted);
    Tensor dq = filled({kRows, 2 * F}, DType::e4m3), ds = filled({kRows, fp8_num_blocks(2 * F)}, DType::f32);
    Tensor dp = filled({kRows, 1}, DType::f32);
    swiglu_quant_backward_cuda(DType::bf16, da.raw_data(), h.raw_data(), p.data<float>(), kRows, F,
                               static_cast<uint8_t*>(dq.raw_data()), ds.data<float>(), nullptr, dp.data<float>(),
                               stream, counted);
    for (const Tensor* t : {&out, &d_in, &q, &s, &dq, &ds, &dp}) {
      EXPECT_TRUE(tail_is(*t, rows, 0x5a));
      EXPECT_FALSE(tail_is(*t, 0, 0x5a));  // the counted rows were written
    }
  }
}
