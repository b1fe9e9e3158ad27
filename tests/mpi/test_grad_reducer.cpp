// The overlapped gradient reduction (parallel/grad_reducer.h) on the world this test runs in: a real
// model's backward, at every expert-parallel size the world allows, reduced with the buckets launched
// during the backward must give the gradients the plain schedule gives, bit for bit (the same buckets,
// the same sums); gradient accumulation reduces once, after the last micro-batch; a parameter only some
// ranks have a gradient for is summed as zero where it is missing and one no rank has keeps none, the
// ranks telling each other which they have through the host side. The checks themselves are
// grad_reducer_cases.h's.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>

#include "kernels/common/device_api.h"
#include "layers/transformer.h"
#include "parallel/backends.h"
#include "parallel/grad_reducer.h"
#include "parallel/process_group.h"
#include "tests/mpi/comm_test_util.h"
#include "tests/mpi/grad_reducer_cases.h"
#include "train/train_options.h"

namespace flowmoe::test {
namespace {

// Whether n ranks split into expert-parallel groups of e over kExperts experts: the one rule both
// layout loops below follow (check_parallel_sizes refuses the others).
bool layout_fits(int n, int e) { return n % e == 0 && kExperts % e == 0; }

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
    if (!layout_fits(n, e)) continue;
    SCOPED_TRACE("expert_parallel_size " + std::to_string(e));
    check(make_parallel_state(test_runtime().world, e, kExperts));
  }
}

TEST(GradientReducer, OverlappedBucketsGiveThePlainSumsBitForBit) {
  for_each_layout([](const ParallelState& ps) {
    for (int micro_batches : {1, 2}) {
      SCOPED_TRACE(std::to_string(micro_batches) + " micro-batches");
      ReduceRun run;
      run.micro_batches = micro_batches;
      check_overlap_gives_plain_sums(ps, run);
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
      ReduceRun run;
      run.overlap = overlap;
      const std::vector<std::vector<float>> got = reduced_gradients(ps, run).grads;
      ASSERT_EQ(got.size(), want.mean.size());
      for (size_t p = 0; p < got.size(); ++p) {
        ASSERT_EQ(got[p].size(), want.mean[p].size()) << "parameter " << p;
        for (size_t j = 0; j < got[p].size(); ++j)
          ASSERT_NEAR(got[p][j], want.mean[p][j], 1e-6 * want.scale[p]) << "parameter " << p << " element " << j;
      }
    }
  });
}

TEST(GradientReducer, LoneGradientsReduceWhereTheyLieToThePlainSums) {
  for_each_layout([](const ParallelState& ps) { check_lone_gradients(ps, Device::cpu()); });
}

// Runs check on an nccl world of a GPU per rank, at expert-parallel size 1 and the world's where it fits.
template <class F>
void for_each_nccl_layout(F&& check) {
  const int me = test_world().rank(), n = test_world().size();
  cuda_set_device(me);
  {
    const std::shared_ptr<Communicator> nccl = make_nccl_communicator(test_runtime().world, me);
    for (int e : {1, n}) {
      if (!layout_fits(n, e)) continue;
      SCOPED_TRACE("expert_parallel_size " + std::to_string(e));
      check(make_parallel_state(nccl, e, kExperts), Device::cuda(me));
    }
    nccl->barrier();
  }
  cuda_set_device(0);
}

// The same through nccl, a GPU per rank: the buckets reduced on the reducer's own stream while the
// backward goes on, against the same buckets reduced after it; also with the reduction's thread blocks
// bounded (parallel.grad_reduce_sms), which both schedules then share.
TEST(GradientReducer, OverlapOnItsOwnStreamThroughNcclGivesThePlainSums) {
  if (const std::string why = why_no_nccl_gpu_per_rank(); !why.empty()) GTEST_SKIP() << why;
  for_each_nccl_layout([](const ParallelState& ps, Device gpu) {
    for (int max_ctas : {0, 2}) {
      SCOPED_TRACE("max_ctas " + std::to_string(max_ctas));
      ReduceRun run;
      run.device = gpu;
      run.max_ctas = max_ctas;
      check_overlap_gives_plain_sums(ps, run);
    }
  });
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

TEST(GradientReducer, MissingGradientsCountAsZeroAndNoneStaysNone) {
  const ParallelState ps = make_parallel_state(test_runtime().world, 1, kExperts);
  for (bool shard : {false, true}) {
    SCOPED_TRACE(shard ? "sharded" : "whole");
    check_missing_gradients(ps, Device::cpu(), shard);
  }
}

// The world with the collectives of its own side counted (nccl's GPU collectives stand for them here) and
// its host side the world's own, uncounted.
class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* backend_name() const override { return "counting"; }
  Device native_device() const override { return inner_->native_device(); }
  Communicator& host_communicator() override { return inner_->host_communicator(); }
  int64_t num_collectives = 0;

 protected:
  void do_all_to_all(const Tensor& send, const std::vector<int64_t>& send_rows, const Tensor& recv,
                     const std::vector<int64_t>& recv_rows, size_t) override {
    ++num_collectives;
    inner_->all_to_all(send, send_rows, recv, recv_rows);
  }
  void do_all_to_all_chunks(const Tensor& send, const std::vector<RowChunk>& send_chunks, const Tensor& recv,
                            const std::vector<RowChunk>& recv_chunks, size_t) override {
    ++num_collectives;
    inner_->all_to_all_chunks(send, send_chunks, recv, recv_chunks);
  }
  void do_all_reduce(const Tensor& t, ReduceOp op) override {
    ++num_collectives;
    inner_->all_reduce(t, op);
  }
  void do_all_gather(const Tensor& send, const Tensor& recv, size_t) override {
    ++num_collectives;
    inner_->all_gather(send, recv);
  }
  void do_reduce_scatter_in_place(const Tensor& t, ReduceOp op) override {
    ++num_collectives;
    inner_->reduce_scatter_in_place(t, op);
  }
  void do_all_gather_in_place(const Tensor& t, size_t) override {
    ++num_collectives;
    inner_->all_gather_in_place(t);
  }
  void do_broadcast(const Tensor& t, int root) override {
    ++num_collectives;
    inner_->broadcast(t, root);
  }
  void do_barrier() override { inner_->barrier(); }
  std::shared_ptr<Communicator> do_split(int color, int key, int max_ctas) override {
    return inner_->split(color, key, max_ctas);
  }

 private:
  std::shared_ptr<Communicator> inner_;
};

// A rank missing a gradient learns which parameters any rank has through the host side: the host booleans
// never become a device collective (which a rank holding every gradient would have to join with a device
// copy, and one lacking some would have to read back), so the only collectives of the world's own side are
// the buckets' reductions. The sums are the ones above.
TEST(GradientReducer, PresenceTravelsThroughTheHostSide) {
  const auto counting = std::make_shared<CountingCommunicator>(test_runtime().world);
  const ParallelState ps = make_parallel_state(counting, 1, kExperts);
  for (bool shard : {false, true}) {
    SCOPED_TRACE(shard ? "sharded" : "whole");
    counting->num_collectives = 0;
    check_missing_gradients(ps, Device::cpu(), shard);
    // check_missing_gradients' reducer has 3 buckets of at most 16 floats (parameters 3 and 2, then 1, then 0),
    // reduced once each.
    EXPECT_EQ(counting->num_collectives, 3) << "collectives on the world's own side";
  }
}

}  // namespace
}  // namespace flowmoe::test
