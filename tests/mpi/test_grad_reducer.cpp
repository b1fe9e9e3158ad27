// The overlapped gradient reduction (train/grad_reducer.h) on the world this test runs in: a real
// model's backward, at every expert-parallel size the world allows, reduced with the buckets launched
// during the backward must give the gradients the plain schedule gives, bit for bit (the same buckets,
// the same sums); gradient accumulation reduces once, after the last micro-batch; a parameter only some
// ranks have a gradient for is summed as zero where it is missing and one no rank has keeps none.
// The data encodes the rank, so every rank's gradients differ.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/common/device_api.h"
#include "parallel/backends.h"
#include "parallel/process_group.h"
#include "tests/mpi/comm_test_util.h"
#include "train/config.h"
#include "train/grad_reducer.h"
#include "train/trainer.h"

namespace flowmoe::test {
namespace {

constexpr int64_t kExperts = 4;

Config moe_config() {
  return parse_config(
      "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 3, num_attention_heads: 2,"
      " intermediate_size: 64, max_position_embeddings: 16, n_routed_experts: 4, num_experts_per_tok: 2,"
      " n_shared_experts: 1, moe_intermediate_size: 16, first_k_dense_replace: 1}\n"
      "data: {seq_len: 16}\n"
      "train: {device: cpu}\n",
      "reducer_test.yaml");
}

// Rank r's micro-batch a: token ids that depend on both.
Tensor coded_ids(int rank, int a) {
  std::vector<int64_t> ids(2 * 16);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t((rank * 13 + a * 7 + int(i) * 5) % 64);
  return Tensor::from_ints(ids, {2, 16}, DType::i32);
}

// 16 KiB buckets: a dozen of them, so that the overlap has something to launch early.
constexpr size_t kTestBucketBytes = 16 << 10;

// The gradients after `micro_batches` forward/backward passes on `device`, reduced by a fresh reducer with
// buckets of bucket_bytes (in_place: how many it reduced in their one gradient's own buffer).
std::vector<std::vector<float>> reduced_gradients(const ParallelState& ps, bool overlap, int micro_batches,
                                                  int64_t* launched_early, int64_t* buckets,
                                                  Device device = Device::cpu(), size_t bucket_bytes = kTestBucketBytes,
                                                  int64_t* in_place = nullptr) {
  const Config cfg = moe_config();
  Transformer model(cfg.model, device, device.is_cuda() ? DType::bf16 : DType::f32, 7, moe_options(cfg, ps));
  GradientReducer reducer(ps, model.parameters(), model.parameter_shards(), overlap, bucket_bytes);
  const int me = ps.world->rank();
  for (int a = 0; a < micro_batches; ++a) {
    const Tensor ids = coded_ids(me, a), targets = coded_ids(me, a + 1);
    if (a + 1 == micro_batches) reducer.begin();
    model.loss(ids, targets).backward();
  }
  reducer.finish();
  *launched_early = reducer.num_launched_in_backward();
  *buckets = reducer.num_buckets();
  if (in_place) *in_place = reducer.num_reduced_in_place();
  std::vector<std::vector<float>> out;
  for (const Variable& p : model.parameters())
    out.push_back(p.grad().defined() ? p.grad().to_floats() : std::vector<float>{});
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// got[j] and want[j] sum the same terms over `ranks` ranks: bit for bit at 2, where a + b is one sum; at more,
// MPI may add them in another order, off by ulps of the terms (scale: the largest), which may be far larger
// than the sum.
::testing::AssertionResult same_sums(const float* got, const float* want, size_t n, double scale, int ranks) {
  for (size_t j = 0; j < n; ++j) {
    const bool same = ranks <= 2 ? got[j] == want[j] : std::abs(double(got[j]) - want[j]) <= 1e-6 * scale;
    if (!same) return ::testing::AssertionFailure() << "element " << j << ": " << got[j] << " against " << want[j];
  }
  return ::testing::AssertionSuccess();
}

double largest_magnitude(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}

// What the reduction must give, computed here without the reducer: each rank's own gradients (the backward of
// reduced_gradients), gathered over the group that reduces a parameter (the world for dense ones, the ranks
// holding the same experts for expert weights at expert-parallel size > 1), summed in double and divided by the
// world's size (the loss is the mean over the world's batch); with the largest term's magnitude (the scale of
// the sums' rounding).
struct MeanGradients {
  std::vector<std::vector<double>> mean;
  std::vector<double> scale;
};
MeanGradients mean_of_ranks_gradients(const ParallelState& ps, int micro_batches) {
  const Config cfg = moe_config();
  Transformer model(cfg.model, Device::cpu(), DType::f32, 7, moe_options(cfg, ps));
  const int me = ps.world->rank();
  for (int a = 0; a < micro_batches; ++a) model.loss(coded_ids(me, a), coded_ids(me, a + 1)).backward();
  MeanGradients out;
  const std::vector<Variable>& params = model.parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const bool expert = model.parameter_shards()[i].expert && ps.expert_parallel_size > 1;
    Communicator& group = expert ? *ps.expert_data_parallel : *ps.world;
    const Tensor g = params[i].grad().defined() ? params[i].grad() : Tensor::zeros(params[i].shape(), DType::f32);
    const int64_t n = g.numel();
    const std::vector<float> all = group.all_gather(g.contiguous().reshape({1, n})).to_floats();
    std::vector<double> sum(size_t(n), 0.0);
    double scale = 0;
    for (size_t k = 0; k < all.size(); ++k) {
      sum[k % size_t(n)] += all[k];
      scale = std::max(scale, double(std::abs(all[k])));
    }
    for (double& v : sum) v /= double(ps.world->size());
    out.mean.push_back(std::move(sum));
    out.scale.push_back(scale);
  }
  return out;
}

// Runs check on the test's world at every expert-parallel size it allows.
template <class F>
void for_each_layout(F&& check) {
  const int n = test_world().size();
  for (int e = 1; e <= n; ++e) {
    if (n % e != 0 || kExperts % e != 0) continue;
    SCOPED_TRACE("expert_parallel_size " + std::to_string(e));
    check(make_parallel_state(test_runtime().world, e, kExperts));
  }
}

TEST(GradientReducer, OverlappedBucketsGiveThePlainSumsBitForBit) {
  for_each_layout([](const ParallelState& ps) {
    for (int micro_batches : {1, 2}) {
      SCOPED_TRACE(std::to_string(micro_batches) + " micro-batches");
      int64_t early_plain = 0, early_overlap = 0, buckets = 0;
      const auto plain = reduced_gradients(ps, false, micro_batches, &early_plain, &buckets);
      const auto overlapped = reduced_gradients(ps, true, micro_batches, &early_overlap, &buckets);
      EXPECT_EQ(early_plain, 0);
      // The backward finishes the buckets one after another and launches each as it does, down to the
      // embedding's, final last: none is left for finish().
      EXPECT_GT(buckets, 4);
      EXPECT_EQ(early_overlap, buckets);
      ASSERT_EQ(plain.size(), overlapped.size());
      for (size_t p = 0; p < plain.size(); ++p) {
        EXPECT_FALSE(plain[p].empty()) << "parameter " << p;
        EXPECT_TRUE(same_bits(plain[p], overlapped[p])) << "parameter " << p;
      }
    }
  });
}

// The tests above compare schedules of the reducer with each other; this one compares what it computes with the
// mean of the ranks' own gradients, plain and overlapped (the sharded segments are compared with the plain sums
// above). At one rank the mean is the rank's own gradient: a mean that is a sum shows from 2 ranks on.
TEST(GradientReducer, ReducedGradientsAreTheMeanOverTheRanks) {
  for_each_layout([](const ParallelState& ps) {
    const MeanGradients want = mean_of_ranks_gradients(ps, 2);
    for (bool overlap : {false, true}) {
      SCOPED_TRACE(overlap ? "overlapped" : "plain");
      int64_t early = 0, buckets = 0;
      const auto got = reduced_gradients(ps, overlap, 2, &early, &buckets);
      ASSERT_EQ(got.size(), want.mean.size());
      for (size_t p = 0; p < got.size(); ++p) {
        ASSERT_EQ(got[p].size(), want.mean[p].size()) << "parameter " << p;
        for (size_t j = 0; j < got[p].size(); ++j)
          ASSERT_NEAR(got[p][j], want.mean[p][j], 1e-6 * want.scale[p]) << "parameter " << p << " element " << j;
      }
    }
  });
}

// A bucket of one parameter reduces that gradient where it lies, with no copy into a flat buffer: the
// same sums as the gradients copied side by side into one bucket per group (bit for bit at 2 ranks,
// where a + b is one sum; MPI may order 4 ranks' sums otherwise for messages of other sizes).
TEST(GradientReducer, LoneGradientsReduceWhereTheyLieToThePlainSums) {
  for_each_layout([](const ParallelState& ps) {
    int64_t early = 0, lone_buckets = 0, whole_buckets = 0, lone_in_place = 0, whole_in_place = 0;
    // 4-byte buckets: one parameter each. 1 GiB buckets: one per group, every gradient copied into it.
    const auto lone = reduced_gradients(ps, true, 2, &early, &lone_buckets, Device::cpu(), 4, &lone_in_place);
    const auto whole =
        reduced_gradients(ps, true, 2, &early, &whole_buckets, Device::cpu(), size_t(1) << 30, &whole_in_place);
    EXPECT_EQ(size_t(lone_buckets), lone.size());
    EXPECT_EQ(lone_in_place, lone_buckets) << "every lone gradient is a fresh tensor here";
    EXPECT_LE(whole_buckets, 2);
    EXPECT_EQ(whole_in_place, 0);
    ASSERT_EQ(lone.size(), whole.size());
    for (size_t p = 0; p < lone.size(); ++p) {
      ASSERT_EQ(lone[p].size(), whole[p].size()) << "parameter " << p;
      ASSERT_TRUE(
          same_sums(lone[p].data(), whole[p].data(), lone[p].size(), largest_magnitude(whole[p]), ps.world->size()))
          << "parameter " << p;
    }
  });
}

// Runs check on an nccl world of a GPU per rank, at expert-parallel size 1 and the world's.
template <class F>
void for_each_nccl_layout(F&& check) {
  const int me = test_world().rank(), n = test_world().size();
  cuda_set_device(me);
  {
    const std::shared_ptr<Communicator> nccl = make_nccl_communicator(test_runtime().world, me);
    for (int e : {1, n}) {
      SCOPED_TRACE("expert_parallel_size " + std::to_string(e));
      check(make_parallel_state(nccl, e, kExperts), Device::cuda(me));
    }
    nccl->barrier();
  }
  cuda_set_device(0);
}

// The same through nccl, a GPU per rank: the buckets reduced on the reducer's own stream while the
// backward goes on, against the same buckets reduced after it.
TEST(GradientReducer, OverlapOnItsOwnStreamThroughNcclGivesThePlainSums) {
  if (const std::string why = why_no_nccl_gpu_per_rank(); !why.empty()) GTEST_SKIP() << why;
  for_each_nccl_layout([](const ParallelState& ps, Device gpu) {
    int64_t early_plain = 0, early_overlap = 0, buckets = 0;
    const auto plain = reduced_gradients(ps, false, 2, &early_plain, &buckets, gpu);
    const auto overlapped = reduced_gradients(ps, true, 2, &early_overlap, &buckets, gpu);
    EXPECT_EQ(early_overlap, buckets);
    ASSERT_EQ(plain.size(), overlapped.size());
    for (size_t p = 0; p < plain.size(); ++p) EXPECT_TRUE(same_bits(plain[p], overlapped[p])) << "parameter " << p;
  });
}

// The sharded form: rank r's segment of each bucket holds the plain reduction's sums (bit for
// bit at 2 ranks, where a + b is one sum; MPI's reduce-scatter may order 4 ranks' otherwise), the
// segments of a group cover each parameter exactly once, and gather_weights() gives every rank of the
// group the values each owner wrote into its segment.
// bucket_bytes 4: a parameter per bucket, its gradient reduce-scattered where it lies wherever the group's
// size divides it.
void check_sharded_reduction(const ParallelState& ps, Device device, size_t bucket_bytes = kTestBucketBytes) {
  const Config cfg = moe_config();
  int64_t early = 0, buckets = 0;
  const auto plain = reduced_gradients(ps, false, 2, &early, &buckets, device);
  Transformer model(cfg.model, device, device.is_cuda() ? DType::bf16 : DType::f32, 7, moe_options(cfg, ps));
  const std::vector<Variable>& params = model.parameters();
  GradientReducer reducer(ps, params, model.parameter_shards(), true, bucket_bytes, 0, /*shard=*/true);
  ASSERT_TRUE(reducer.sharded());
  const int me = ps.world->rank();
  for (int a = 0; a < 2; ++a) {
    if (a == 1) reducer.begin();
    model.loss(coded_ids(me, a), coded_ids(me, a + 1)).backward();
  }
  reducer.finish();
  if (bucket_bytes < 16) {
    EXPECT_GT(reducer.num_reduced_in_place(), 0);
  }
  const auto& ranges = reducer.owned_ranges();
  const auto group = [&](size_t i) -> Communicator& {
    return model.parameter_shards()[i].expert && ps.expert_parallel_size > 1 ? *ps.expert_data_parallel : *ps.world;
  };
  for (size_t i = 0; i < params.size(); ++i) {
    const auto [begin, end] = ranges[i];
    Tensor owned = Tensor::from_floats({float(end - begin)}, {1}).to(group(i).native_device());
    group(i).all_reduce(owned, ReduceOp::sum);
    EXPECT_EQ(owned.to_floats()[0], float(params[i].data().numel())) << "parameter " << i << " is not covered once";
    // The full gradient is released; the range's lives on in the bucket's segment.
    EXPECT_FALSE(params[i].grad().defined()) << "parameter " << i << " kept its whole gradient";
    const Tensor& mine = reducer.range_grads()[i];
    ASSERT_EQ(mine.defined(), end > begin) << "parameter " << i;
    if (end == begin) continue;
    ASSERT_EQ(mine.numel(), end - begin) << "parameter " << i;
    const std::vector<float> got = mine.to_floats();
    ASSERT_TRUE(
        same_sums(got.data(), plain[i].data() + begin, got.size(), largest_magnitude(plain[i]), ps.world->size()))
        << "parameter " << i << ", its range from element " << begin;
  }
  reducer.release_grads();
  EXPECT_TRUE(reducer.range_grads().empty()) << "the segments are released once read";
  // Each owner writes p * 1000 + j into its elements, NaN elsewhere; the gather fills in the rest.
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<float> w(size_t(params[i].data().numel()), NAN);
    for (int64_t j = ranges[i].first; j < ranges[i].second; ++j) w[size_t(j)] = float(int64_t(i) * 1000 + j % 1000);
    Tensor data = params[i].data();  // a handle on the parameter's storage
    data.copy_(Tensor::from_floats(w, params[i].shape()));
  }
  reducer.gather_weights();
  reducer.wait_weights();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::vector<float> w = params[i].data().to_floats();
    for (size_t j = 0; j < w.size(); ++j)
      ASSERT_EQ(w[j], float(int64_t(i) * 1000 + int64_t(j) % 1000)) << "parameter " << i << " element " << j;
  }
}

TEST(GradientReducer, ShardedSegmentsHoldThePlainSumsAndGatherEveryWeight) {
  for_each_layout([](const ParallelState& ps) {
    check_sharded_reduction(ps, Device::cpu());
    SCOPED_TRACE("a parameter per bucket");
    check_sharded_reduction(ps, Device::cpu(), 4);
  });
}

TEST(GradientReducer, ShardedThroughNcclOnItsOwnStream) {
  if (const std::string why = why_no_nccl_gpu_per_rank(); !why.empty()) GTEST_SKIP() << why;
  for_each_nccl_layout([](const ParallelState& ps, Device gpu) { check_sharded_reduction(ps, gpu); });
}

// Ranks whose backward gives a parameter no gradient: zero there in the sum, none where no rank had one.
// Sharded, the same sums in this rank's ranges (range_grads), and the parameters keep no gradient.
TEST(GradientReducer, MissingGradientsCountAsZeroAndNoneStaysNone) {
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  const ParallelState ps = make_parallel_state(test_runtime().world, 1, kExperts);
  for (bool shard : {false, true}) {
    SCOPED_TRACE(shard ? "sharded" : "whole");
    std::vector<Variable> params;
    for (int64_t size : {3, 200, 2, 4}) params.emplace_back(Tensor::zeros({size}, DType::f32), true);
    const std::vector<ParamShard> shards(params.size());
    GradientReducer reducer(ps, params, shards, true, 16 * sizeof(float), 0, shard);
    reducer.begin();
    for (size_t p = 0; p < params.size(); ++p) {
      if ((p == 2 && me != 0) || p == 3) continue;  // only rank 0 has parameter 2; nobody has 3
      std::vector<float> g(size_t(params[p].shape()[0]));
      for (size_t j = 0; j < g.size(); ++j) g[j] = float((me + 1) * 1000 + int(p) * 100 + int(j) % 97);
      params[p].set_grad(Tensor::from_floats(g, {int64_t(g.size())}));
    }
    reducer.finish();  // no backward reported anything: every bucket goes in finish(), in order
    EXPECT_EQ(reducer.num_launched_in_backward(), 0);
    for (size_t p = 0; p < 3; ++p) {
      int64_t begin = 0;
      std::vector<float> got;
      if (shard) {
        EXPECT_FALSE(params[p].grad().defined()) << "parameter " << p;
        const auto [first, last] = reducer.owned_ranges()[p];
        ASSERT_EQ(reducer.range_grads()[p].defined(), last > first) << "parameter " << p;
        if (last > first) got = reducer.range_grads()[p].to_floats();
        begin = first;
      } else {
        ASSERT_TRUE(params[p].grad().defined()) << "parameter " << p;
        got = params[p].grad().to_floats();
      }
      for (size_t k = 0; k < got.size(); ++k) {
        const int64_t j = begin + int64_t(k);
        double sum = 0;
        for (int r = 0; r < n; ++r)
          if (p != 2 || r == 0) sum += (r + 1) * 1000 + int(p) * 100 + int(j) % 97;
        ASSERT_EQ(got[k], float(sum / n)) << "parameter " << p << " element " << j;
      }
    }
    EXPECT_FALSE(params[3].grad().defined()) << "a gradient no rank had stays undefined";
    if (shard) {
      EXPECT_FALSE(reducer.range_grads()[3].defined()) << "a gradient no rank had stays undefined";
    }
    EXPECT_THROW(reducer.finish(), Error);  // finish() without begin()
  }
}

}  // namespace
}  // namespace flowmoe::test
