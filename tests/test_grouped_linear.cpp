// grouped_linear: the CPU reference against a composition of per-expert linear() calls, gradient
// checks in f64 (an expert with no rows and tail rows included), the layout permute_pad produces,
// read_counts_once, error messages, and CUDA vs CPU on fresh random inputs over edge shapes.
//
// Tolerances (rel_error per expert segment, so one wrong expert cannot hide in a norm): bf16 y and
// d_x < 1e-2 against an f32 CPU reference on the bf16-rounded inputs (the GPU rounds outputs to
// bf16, ~1e-3); d_weight < 1e-4, because it leaves the GEMM in fp32 (a bf16 round trip would show
// ~1e-3); f32 everywhere < 1e-5. Experts with no rows and tail rows must be exactly zero.
#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "engine/ops/grouped_linear.h"
#include "engine/ops/permute.h"
#include "kernels/grouped_linear.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

int64_t total_rows(const std::vector<int64_t>& rows) { return std::accumulate(rows.begin(), rows.end(), int64_t(0)); }

struct Result {
  Tensor y, dx, dw;
};
// y = grouped_linear(x, w, rows) and its gradients for the cotangent dy, on the inputs' device.
Result run_grouped(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows, const Tensor& dy) {
  Variable vx(x, true), vw(w, true);
  Variable y = grouped_linear(vx, vw, rows);
  y.backward(dy);
  return {y.data(), vx.grad(), vw.grad()};
}

// The same thing as one linear() per expert on row slices (the composition the op must equal);
// tail rows of y and dx and the weight gradient of an expert with no rows are zeros.
Result run_composed(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows, const Tensor& dy) {
  const int64_t m_total = x.size(0), n = w.size(1), k = w.size(2);
  Tensor y = Tensor::zeros({m_total, n}, x.dtype()), dx = Tensor::zeros({m_total, k}, x.dtype());
  Tensor dw = Tensor::zeros(w.shape(), w.dtype());
  int64_t off = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    int64_t r = rows[e];
    if (r > 0) {
      Variable vx(x.slice(0, off, off + r).contiguous(), true);
      Variable vw(w.slice(0, int64_t(e), int64_t(e) + 1).reshape({n, k}), true);
      Variable ye = linear(vx, vw);
      ye.backward(dy.slice(0, off, off + r).contiguous());
      y.slice(0, off, off + r).copy_(ye.data());
      dx.slice(0, off, off + r).copy_(vx.grad());
      dw.slice(0, int64_t(e), int64_t(e) + 1).copy_(vw.grad().reshape({1, n, k}));
    }
    off += r;
  }
  return {y, dx, dw};
}

// Compares per expert segment (rows of y / dx, slices of dw); experts with no rows and the tail
// rows must be exactly zero.
void expect_segments_close(const Result& got, const Result& want, const std::vector<int64_t>& rows, double tol_y,
                           double tol_dx, double tol_dw) {
  ASSERT_EQ(got.y.shape(), want.y.shape());
  ASSERT_EQ(got.dx.shape(), want.dx.shape());
  ASSERT_EQ(got.dw.shape(), want.dw.shape());
  Tensor gy = got.y.to(Device::cpu()), gdx = got.dx.to(Device::cpu()), gdw = got.dw.to(Device::cpu());
  int64_t off = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    SCOPED_TRACE(testing::Message() << "expert " << e << " (" << rows[e] << " rows at " << off << ")");
    int64_t r = rows[e], ei = int64_t(e);
    if (r > 0) {
      EXPECT_LT(rel_error(gy.slice(0, off, off + r), want.y.slice(0, off, off + r)), tol_y) << "y";
      EXPECT_LT(rel_error(gdx.slice(0, off, off + r), want.dx.slice(0, off, off + r)), tol_dx) << "dx";
      EXPECT_LT(rel_error(gdw.slice(0, ei, ei + 1), want.dw.slice(0, ei, ei + 1)), tol_dw) << "dw";
    } else {
      EXPECT_TRUE(all_close(gdw.slice(0, ei, ei + 1), want.dw.slice(0, ei, ei + 1), 0, 0)) << "dw of an empty expert";
    }
    off += r;
  }
  const int64_t m_total = gy.size(0);
  SCOPED_TRACE(testing::Message() << "tail rows [" << off << ", " << m_total << ")");
  EXPECT_TRUE(all_close(gy.slice(0, off, m_total), Tensor::zeros({m_total - off, gy.size(1)}, DType::f64), 0, 0));
  EXPECT_TRUE(all_close(gdx.slice(0, off, m_total), Tensor::zeros({m_total - off, gdx.size(1)}, DType::f64), 0, 0));
}

// Counts for num_experts experts: each uniform in [0, max_rows], rounded down to a multiple of
// `multiple`; zero_every > 0 empties every zero_every-th expert.
std::vector<int64_t> random_counts(std::mt19937_64& gen, int64_t num_experts, int64_t max_rows, int64_t multiple,
                                   int64_t zero_every = 0) {
  std::uniform_int_distribution<int64_t> dist(0, max_rows);
  std::vector<int64_t> rows;
  for (int64_t e = 0; e < num_experts; ++e) {
    int64_t r = dist(gen) / multiple * multiple;
    if (zero_every > 0 && e % zero_every == 0) r = 0;
    rows.push_back(r);
  }
  return rows;
}

}  // namespace

// ---- CPU reference ----------------------------------------------------------------------------

TEST(GroupedLinearCpu, MatchesPerExpertLinear) {
  Rng rng(test_seed());
  std::mt19937_64 gen(test_seed());
  struct Case {
    std::vector<int64_t> rows;
    int64_t tail, n, k;
  };
  const Case cases[] = {{{5}, 0, 3, 4},
                        {{3, 0, 4}, 2, 5, 7},
                        {{0, 0, 6, 0}, 0, 8, 3},
                        {{0, 0}, 3, 2, 2},
                        {{}, 4, 3, 2},
                        {{16, 1, 0, 33}, 5, 24, 40},
                        {random_counts(gen, 32, 40, 1, 7), 9, 17, 29}};
  for (const Case& c : cases) {
    int64_t e = int64_t(c.rows.size()), m_total = total_rows(c.rows) + c.tail;
    SCOPED_TRACE(testing::Message() << "E " << e << " M_total " << m_total << " N " << c.n << " K " << c.k);
    Tensor x = random_tensor(rng, {m_total, c.k}, DType::f64), w = random_tensor(rng, {e, c.n, c.k}, DType::f64);
    Tensor dy = random_tensor(rng, {m_total, c.n}, DType::f64);
    Result got = run_grouped(x, w, c.rows, dy);
    Result want = run_composed(x, w, c.rows, dy);
    EXPECT_EQ(got.y.dtype(), DType::f64);
    EXPECT_EQ(got.dw.dtype(), DType::f64);
    expect_segments_close(got, want, c.rows, 1e-12, 1e-12, 1e-12);
  }
}

TEST(GroupedLinearCpu, WgradAccumulatesAndKeepsEmptyExperts) {
  Rng rng(test_seed());
  const std::vector<int64_t> rows = {3, 0, 2};
  const int64_t m_total = 6, n = 4, k = 5, e = 3;
  Tensor x = random_tensor(rng, {m_total, k}, DType::f64), dy = random_tensor(rng, {m_total, n}, DType::f64);
  Tensor dw0 = random_tensor(rng, {e, n, k}, DType::f64), dw = dw0.clone(),
         fresh = Tensor::empty({e, n, k}, DType::f64);
  grouped_linear_wgrad_cpu<double>(x.data<double>(), dy.data<double>(), dw.data<double>(), rows.data(), e, n, k, true);
  grouped_linear_wgrad_cpu<double>(x.data<double>(), dy.data<double>(), fresh.data<double>(), rows.data(), e, n, k,
                                   false);
  EXPECT_TRUE(all_close(dw, tensor_add(dw0, fresh), 1e-12, 1e-12));
  EXPECT_TRUE(all_close(dw.slice(0, 1, 2), dw0.slice(0, 1, 2), 0, 0));  // the empty expert kept its gradient
  EXPECT_TRUE(all_close(fresh.slice(0, 1, 2), Tensor::zeros({1, n, k}, DType::f64), 0, 0));
}

TEST(GroupedLinear, Gradcheck) {
  Rng rng(test_seed());
  auto r = [&](const Shape& s) { return random_tensor(rng, s, DType::f64); };
  auto with_rows = [](std::vector<int64_t> rows) {
    return [rows](const std::vector<Variable>& v) { return grouped_linear(v[0], v[1], rows); };
  };
  EXPECT_TRUE(gradcheck(with_rows({2, 0, 3}), {r({6, 4}), r({3, 3, 4})}));  // an empty expert and a tail row
  EXPECT_TRUE(gradcheck(with_rows({4}), {r({4, 3}), r({1, 2, 3})}));
  EXPECT_TRUE(gradcheck(with_rows({0, 5, 0}), {r({5, 2}), r({3, 3, 2})}));  // one hot expert
  EXPECT_TRUE(gradcheck(with_rows({0, 0}), {r({2, 3}), r({2, 2, 3})}));     // nothing routed: all zero
}

// The op on permute_pad's buffer: row row_map[t,j] of the output is linear(x[t], w[e]) for the
// expert e of (t, j); pad and tail rows are zero. This is the layout contract of the MoE layer.
TEST(GroupedLinearCpu, OnPermutePadBuffer) {
  Rng rng(test_seed());
  std::mt19937_64 gen(test_seed());
  const int64_t num_tokens = 37, hidden = 12, n = 10;
  const int top_k = 3, num_experts = 6, align = 16;
  std::vector<int64_t> idx;
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<int> pool = {0, 1, 2, 3, 5};  // expert 4 gets no token
    std::shuffle(pool.begin(), pool.end(), gen);
    for (int j = 0; j < top_k; ++j) idx.push_back(pool[size_t(j)]);
  }
  Tensor topk_idx = Tensor::from_ints(idx, {num_tokens, top_k});
  Tensor x = random_tensor(rng, {num_tokens, hidden}), w = random_tensor(rng, {num_experts, n, hidden});
  PermuteResult p = permute_pad(Variable(x), topk_idx, Variable(), num_experts, align);  // worst-case rows: a tail
  const uint64_t syncs_before = num_host_syncs();
  std::vector<int64_t> rows = read_counts_once(p.padded_tokens_per_expert);
  EXPECT_EQ(num_host_syncs(), syncs_before) << "a CPU tensor needs no host sync";
  ASSERT_EQ(rows.size(), size_t(num_experts));
  EXPECT_EQ(rows[4], 0);
  Tensor y = grouped_linear(p.rows, Variable(w), rows).data();
  ASSERT_EQ(y.shape(), (Shape{p.rows.size(0), n}));

  std::vector<int64_t> row_map = p.row_map.to_ints(), seg = p.segment_starts.to_ints();
  for (int e = 0; e < num_experts; ++e) EXPECT_EQ(seg[size_t(e) + 1] - seg[size_t(e)], rows[size_t(e)]) << e;
  std::vector<bool> routed(size_t(y.size(0)), false);
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int j = 0; j < top_k; ++j) {
      int64_t e = idx[size_t(t * top_k + j)], row = row_map[size_t(t * top_k + j)];
      routed[size_t(row)] = true;
      Tensor want = linear(Variable(x.slice(0, t, t + 1)), Variable(w.slice(0, e, e + 1).reshape({n, hidden}))).data();
      EXPECT_TRUE(all_close(y.slice(0, row, row + 1), want, 1e-5, 1e-5)) << "token " << t << " slot " << j;
    }
  for (int64_t row = 0; row < y.size(0); ++row) {
    if (routed[size_t(row)]) continue;
    EXPECT_TRUE(all_close(y.slice(0, row, row + 1), Tensor::zeros({1, n}, DType::f32), 0, 0)) << "pad row " << row;
  }
}

TEST(GroupedLinear, ErrorsNameTheShapes) {
  auto v = [](const Shape& s, DType t = DType::f32) { return Variable(Tensor::zeros(s, t)); };
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        grouped_linear(v({8, 4}), v({2, 3, 4}), {5, 4});
      },
      {"grouped_linear", "sum to 9", "8 rows"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        grouped_linear(v({8, 4}), v({2, 3, 5}), {4, 4});
      },
      {"grouped_linear", "[8, 4]", "[2, 3, 5]"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { grouped_linear(v({8, 4}), v({3, 4}), {4, 4}); }, {"[8, 4]", "[3, 4]"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        grouped_linear(v({8, 4}), v({2, 3, 4}), {8});
      },
      {"1 entries", "[2, 3, 4]", "2 experts"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { grouped_linear(v({8, 4}), v({2, 3, 4}), {-1, 4}); }, {"expert 0", "-1"}));
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] {
        grouped_linear(v({8, 4}), v({2, 3, 4}, DType::f64), {4, 4});
      },
      {"f32", "f64"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { read_counts_once(Tensor::zeros({4}, DType::f32)); }, {"f32[4]"}));
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] {
        grouped_linear(v({8, 4}, DType::bf16), v({2, 3, 4}, DType::bf16), {4, 4});
      },
      {"bf16"}));
}

// ---- CUDA vs CPU ------------------------------------------------------------------------------

TEST(GroupedLinearCuda, MatchesCpuBf16) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  std::mt19937_64 gen(test_seed());
  struct Case {
    const char* what;
    std::vector<int64_t> rows;
    int64_t tail, n, k;
  };
  const Case cases[] = {
      {"E=1", {48}, 0, 200, 136},
      {"E=4 with an empty expert and a tail", {32, 0, 16, 64}, 16, 136, 200},
      {"E=4, one hot expert with all rows", {0, 0, 256, 0}, 0, 200, 136},
      {"E=4, odd counts", {17, 1, 0, 33}, 3, 200, 136},
      {"E=32, multiples of 16", random_counts(gen, 32, 128, 16, 9), 32, 384, 256},
      {"E=32, odd counts", random_counts(gen, 32, 50, 1, 5), 7, 136, 200},
      {"E=4, 512 rows each", {512, 512, 512, 512}, 0, 1024, 1024},
      {"E=3, nothing routed", {0, 0, 0}, 16, 136, 200},
  };
  for (const Case& c : cases) {
    int64_t e = int64_t(c.rows.size()), m_total = total_rows(c.rows) + c.tail;
    SCOPED_TRACE(testing::Message() << c.what << ": M_total " << m_total << " N " << c.n << " K " << c.k);
    // bf16-representable values, so the reference sees exactly what the GPU sees (the weight stays an
    // f32 master: the op's cast to bf16 is then exact).
    auto draw = [&](const Shape& s) { return random_tensor(rng, s).to(DType::bf16).to(DType::f32); };
    Tensor x = draw({m_total, c.k}), w = draw({e, c.n, c.k}), dy = draw({m_total, c.n});
    Result want = run_grouped(x, w, c.rows, dy);
    const Device gpu = Device::cuda();
    Result got = run_grouped(x.to(DType::bf16).to(gpu), w.to(gpu), c.rows, dy.to(DType::bf16).to(gpu));
    EXPECT_EQ(got.y.dtype(), DType::bf16);
    EXPECT_EQ(got.dx.dtype(), DType::bf16);
    EXPECT_EQ(got.dw.dtype(), DType::f32);  // the master's gradient stays fp32
    expect_segments_close(got, want, c.rows, 1e-2, 1e-2, 1e-4);
  }
}

TEST(GroupedLinearCuda, MatchesCpuF32) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const std::vector<int64_t> rows = {7, 0, 40, 1};
  const int64_t m_total = 50, n = 72, k = 136;
  Tensor x = random_tensor(rng, {m_total, k}), w = random_tensor(rng, {4, n, k}), dy = random_tensor(rng, {m_total, n});
  Result want = run_grouped(x, w, rows, dy);
  Result got = run_grouped(x.to(Device::cuda()), w.to(Device::cuda()), rows, dy.to(Device::cuda()));
  EXPECT_EQ(got.y.dtype(), DType::f32);
  expect_segments_close(got, want, rows, 1e-5, 1e-5, 1e-5);
}

// A bf16 weight (a sharded optimizer's model weight) gets its gradient in f32 straight from the GEMM, with
// the f32 master's accuracy: nothing rounds it to bf16 (Variable::store_as keeps the leaf's in f32).
TEST(GroupedLinearCuda, Bf16WeightGetsF32Gradient) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const std::vector<int64_t> rows = {16, 0, 32};
  auto draw = [&](const Shape& s) { return random_tensor(rng, s).to(DType::bf16).to(DType::f32); };
  Tensor x = draw({48, 136}), w = draw({3, 200, 136}), dy = draw({48, 200});
  Result want = run_grouped(x, w, rows, dy);
  auto gpu = [](const Tensor& t) { return t.to(DType::bf16).to(Device::cuda()); };
  Result got = run_grouped(gpu(x), gpu(w), rows, gpu(dy));
  EXPECT_EQ(got.dw.dtype(), DType::f32);
  expect_segments_close(got, want, rows, 1e-2, 1e-2, 1e-4);
  const Device dev = Device::cuda();
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] { grouped_linear(Variable(x.to(dev)), Variable(w.to(DType::bf16).to(dev)), rows); }, {"weight", "bf16"}));
}

TEST(GroupedLinearCuda, ReadCountsOnceCountsOneSync) {
  FLOWMOE_REQUIRE_CUDA();
  Tensor counts = Tensor::from_ints({32, 0, 16, 48}, {4}, DType::i32, Device::cuda());
  const uint64_t before = num_host_syncs();
  EXPECT_EQ(read_counts_once(counts), (std::vector<int64_t>{32, 0, 16, 48}));
  EXPECT_EQ(num_host_syncs(), before + 1);
  // Forward and backward of the op add no sync of their own.
  Tensor x = Tensor::zeros({96, 8}, DType::bf16, Device::cuda()),
         w = Tensor::zeros({4, 8, 8}, DType::f32, Device::cuda());
  Variable vw(w, true);
  grouped_linear(Variable(x, true), vw, {32, 0, 16, 48}).backward(Tensor::zeros({96, 8}, DType::bf16, Device::cuda()));
  EXPECT_EQ(num_host_syncs(), before + 1);
}

// Training brings new per-expert counts every step: gemm_cuda builds a plan per new count, borrowing
// its bucket's algorithm; every step must still match the CPU.
TEST(GroupedLinearCuda, NewCountsEveryStepMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  std::mt19937_64 gen(test_seed());
  const int64_t e = 6, n = 136, k = 200;
  for (int step = 0; step < 4; ++step) {
    std::vector<int64_t> rows = random_counts(gen, e, 90, 1, step == 2 ? 4 : 0);
    const int64_t m_total = total_rows(rows) + 5;
    SCOPED_TRACE(testing::Message() << "step " << step << ": M_total " << m_total);
    auto draw = [&](const Shape& s) { return random_tensor(rng, s).to(DType::bf16).to(DType::f32); };
    Tensor x = draw({m_total, k}), w = draw({e, n, k}), dy = draw({m_total, n});
    Result want = run_grouped(x, w, rows, dy);
    const Device gpu = Device::cuda();
    Result got = run_grouped(x.to(DType::bf16).to(gpu), w.to(gpu), rows, dy.to(DType::bf16).to(gpu));
    expect_segments_close(got, want, rows, 1e-2, 1e-2, 1e-4);
  }
}

namespace {
// Sets the launchers' stream count for one scope.
struct ScopedGroupedStreams {
  explicit ScopedGroupedStreams(int n) : saved(grouped_linear_streams()) { set_grouped_linear_streams(n); }
  ~ScopedGroupedStreams() { set_grouped_linear_streams(saved); }
  int saved;
};
}  // namespace

// Spreading the expert GEMMs over side streams changes no bit of y, dx or dw (each GEMM keeps its
// algorithm and gets its own workspace), and the results are complete once the launcher's stream is:
// the copy to the host below synchronises only that stream.
TEST(GroupedLinearCuda, SideStreamsAreBitIdentical) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const std::vector<int64_t> rows = {48, 0, 17, 64, 1, 33, 0, 20};
  const int64_t e = int64_t(rows.size()), m_total = total_rows(rows) + 7, n = 136, k = 200;
  const Device gpu = Device::cuda();
  auto draw = [&](const Shape& s) { return random_tensor(rng, s).to(DType::bf16).to(gpu); };
  Tensor x = draw({m_total, k}), dy = draw({m_total, n}), w = draw({e, n, k});
  Tensor main_grad = random_tensor(rng, {e, n, k}).to(gpu);
  cudaStream_t stream = current_stream(0);
  auto run = [&](int num_streams) {
    ScopedGroupedStreams scoped(num_streams);
    Tensor y = Tensor::empty({m_total, n}, DType::bf16, gpu), dx = Tensor::empty({m_total, k}, DType::bf16, gpu);
    Tensor dw = Tensor::empty({e, n, k}, DType::f32, gpu), acc = main_grad.clone();
    grouped_linear_forward_cuda(DType::bf16, x.raw_data(), w.raw_data(), y.raw_data(), rows.data(), e, m_total, n, k,
                                stream);
    grouped_linear_dgrad_cuda(DType::bf16, dy.raw_data(), w.raw_data(), dx.raw_data(), rows.data(), e, m_total, n, k,
                              stream);
    grouped_linear_wgrad_cuda(DType::bf16, x.raw_data(), dy.raw_data(), dw.data<float>(), rows.data(), e, m_total, n, k,
                              false, stream);
    grouped_linear_wgrad_cuda(DType::bf16, x.raw_data(), dy.raw_data(), acc.data<float>(), rows.data(), e, m_total, n,
                              k, true, stream);
    return std::vector<Tensor>{y.to(Device::cpu()), dx.to(Device::cpu()), dw.to(Device::cpu()), acc.to(Device::cpu())};
  };
  const std::vector<Tensor> one = run(1);
  for (int num_streams : {2, 4, 8}) {
    SCOPED_TRACE(testing::Message() << num_streams << " streams");
    const std::vector<Tensor> many = run(num_streams);
    const char* names[] = {"y", "dx", "dw", "dw accumulated"};
    for (size_t i = 0; i < one.size(); ++i) EXPECT_TRUE(bit_equal(many[i], one[i])) << names[i];
  }
  EXPECT_EQ(grouped_linear_streams(), 1);
  EXPECT_TRUE(throws_naming<Error>([] { set_grouped_linear_streams(0); }, {"set_grouped_linear_streams", "0"}));
  EXPECT_TRUE(throws_naming<Error>([] { set_grouped_linear_streams(9); }, {"9"}));
}

// The wgrad launcher with accumulate adds into an existing fp32 main grad (beta = 1) and leaves the
// experts with no rows untouched, bit for bit.
TEST(GroupedLinearCuda, WgradLauncherAccumulatesIntoFp32) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const std::vector<int64_t> rows = {48, 0, 17, 0, 64};
  const int64_t e = 5, m_total = 140, n = 136, k = 200;
  auto draw = [&](const Shape& s) { return random_tensor(rng, s).to(DType::bf16); };
  Tensor x = draw({m_total, k}), dy = draw({m_total, n}), main_grad = random_tensor(rng, {e, n, k});
  Tensor gx = x.to(Device::cuda()), gdy = dy.to(Device::cuda()), gmain = main_grad.to(Device::cuda());
  grouped_linear_wgrad_cuda(DType::bf16, gx.raw_data(), gdy.raw_data(), gmain.data<float>(), rows.data(), e, m_total, n,
                            k, true, current_stream(0));
  Tensor got = gmain.to(Device::cpu());
  Tensor xf = x.to(DType::f32), dyf = dy.to(DType::f32), want = main_grad.clone();
  grouped_linear_wgrad_cpu<float>(xf.data<float>(), dyf.data<float>(), want.data<float>(), rows.data(), e, n, k, true);
  for (int64_t i = 0; i < e; ++i) {
    SCOPED_TRACE(testing::Message() << "expert " << i << " (" << rows[size_t(i)] << " rows)");
    if (rows[size_t(i)] == 0)
      EXPECT_TRUE(bit_equal(got.slice(0, i, i + 1).contiguous(), main_grad.slice(0, i, i + 1).contiguous()));
    else
      EXPECT_LT(rel_error(got.slice(0, i, i + 1), want.slice(0, i, i + 1)), 1e-5);
  }
}
