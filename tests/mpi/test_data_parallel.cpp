// The reductions of data-parallel training (parallel/data_parallel.h) on the world this test runs in:
// buckets of several tensors and lone large ones, the mean of the gradients, gradients that only some
// ranks have, and the step's host values. Every value is a small integer times a power of two, so the
// sums are exact in any order and compared exactly.
#include "parallel/data_parallel.h"
#include "tests/mpi/comm_test_util.h"

namespace flowmoe::test {
namespace {

// Element j of tensor t on rank r: distinct per rank and tensor, exact in f32.
float code(int r, size_t t, int64_t j) { return float((r + 1) * 1000 + int64_t(t) * 100 + j % 97); }

std::vector<Tensor> coded_tensors(int rank, const std::vector<int64_t>& sizes) {
  std::vector<Tensor> out;
  for (size_t t = 0; t < sizes.size(); ++t) {
    std::vector<float> v(size_t(sizes[t]));
    for (int64_t j = 0; j < sizes[t]; ++j) v[size_t(j)] = code(rank, t, j);
    out.push_back(Tensor::from_floats(v, {sizes[t]}));
  }
  return out;
}

TEST(DataParallelReductions, AllReduceFlatBucketsSumAndScale) {
  Communicator& world = test_world();
  const int n = world.size();
  // 64-float buckets: tensors 0-2 share one, 300 goes alone, 7 and 64 each start a bucket.
  const std::vector<int64_t> sizes = {5, 1, 40, 300, 7, 64};
  for (double scale : {1.0, 1.0 / double(n)}) {
    SCOPED_TRACE("scale " + std::to_string(scale));
    std::vector<Tensor> mine = coded_tensors(world.rank(), sizes);
    all_reduce_flat(world, mine, ReduceOp::sum, scale, 64 * sizeof(float));
    for (size_t t = 0; t < sizes.size(); ++t) {
      const std::vector<float> got = mine[t].to_floats();
      for (int64_t j = 0; j < sizes[t]; ++j) {
        double want = 0;
        for (int r = 0; r < n; ++r) want += code(r, t, j);
        ASSERT_EQ(got[size_t(j)], float(want * scale)) << "tensor " << t << " element " << j;
      }
    }
  }
  // Integer counts (the experts' loads) in one bucket, and max.
  Tensor counts = Tensor::from_ints({world.rank(), 2 * world.rank(), 7}, {3}, DType::i32);
  Tensor more = Tensor::from_ints({1, 1}, {2}, DType::i32);
  all_reduce_flat(world, {counts, more}, ReduceOp::sum);
  EXPECT_EQ(counts.to_ints(), (std::vector<int64_t>{n * (n - 1) / 2, n * (n - 1), 7 * n}));
  EXPECT_EQ(more.to_ints(), (std::vector<int64_t>{n, n}));
  Tensor most = Tensor::from_ints({world.rank()}, {1}, DType::i64);
  all_reduce_flat(world, {most}, ReduceOp::max);
  EXPECT_EQ(most.to_ints()[0], n - 1);
  EXPECT_THROW(all_reduce_flat(world, {counts, Tensor::zeros({1}, DType::f32)}, ReduceOp::sum), DTypeError);
}

TEST(DataParallelReductions, GradientsBecomeTheMeanAndMissingOnesCountAsZero) {
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  std::vector<Variable> params;
  for (int64_t size : {3, 200, 2, 4}) params.emplace_back(Tensor::zeros({size}, DType::f32), true);
  for (size_t p = 0; p < params.size(); ++p) {
    std::vector<float> g(size_t(params[p].shape()[0]));
    for (size_t j = 0; j < g.size(); ++j) g[j] = code(me, p, int64_t(j));
    if (p == 2 && me != 0) continue;  // only rank 0 has this gradient
    if (p == 3) continue;             // no rank has this one
    params[p].set_grad(Tensor::from_floats(g, {int64_t(g.size())}));
  }
  all_reduce_gradients(world, params, 16 * sizeof(float));
  for (size_t p = 0; p < 3; ++p) {
    ASSERT_TRUE(params[p].grad().defined()) << "parameter " << p;
    const std::vector<float> got = params[p].grad().to_floats();
    for (size_t j = 0; j < got.size(); ++j) {
      double sum = 0;
      for (int r = 0; r < n; ++r) sum += p == 2 && r != 0 ? 0.0 : code(r, p, int64_t(j));
      ASSERT_EQ(got[j], float(sum / n)) << "parameter " << p << " element " << j;
    }
  }
  EXPECT_FALSE(params[3].grad().defined()) << "a gradient no rank had stays undefined";
}

TEST(DataParallelReductions, HostValuesSumAndMax) {
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  EXPECT_EQ(all_reduce_values(world, {1.0, double(me), 0.5}, ReduceOp::sum),
            (std::vector<double>{double(n), n * (n - 1) / 2.0, 0.5 * n}));
  EXPECT_EQ(all_reduce_values(world, {double(me), -double(me)}, ReduceOp::max), (std::vector<double>{n - 1.0, 0.0}));
}

}  // namespace
}  // namespace flowmoe::test
