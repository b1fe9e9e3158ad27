// A one-rank NCCL world on one GPU: make_nccl_communicator over a none bootstrap runs the real NCCL calls,
// and through them what the CPU tests cannot reach: the gradient reducer's split communicators, its own
// stream and events, and the step captured as a CUDA graph (the reducer's checks are
// grad_reducer_cases.h's, each eagerly and captured), and the training step over that world with the
// sharded optimizer, graphed against eager. GPU only: every test skips without a device.
//
// The reducer tests run with a test hook (GradientReducer::set_stream_hook) that holds the streams back:
// the compute stream spins 2 ms before each bucket's copy, and the reduction's stream spins 1 ms before
// each collective and then doubles the bucket. At one rank a collective changes nothing, so the doubling
// stands in for what a second rank would add: a reduction that ran before its bucket's copy (the reduction
// stream not waiting for the compute stream: the copy lands after the doubling) and a buffer read before
// its reduction ended (the compute stream not waiting for the reduction stream: read undoubled) are both
// wrong sums against twice the plain schedule's, which runs on the compute stream and is not doubled.
// Negative control, a one-line change: delete `grads_ready_->wait(stream_->get());` in
// GradientReducer::launch and the Overlap, Sharded, LoneGradients and MissingGradientsCountAsZero tests
// fail, eagerly with undoubled sums (1200 for 2400) and captured with "dependency created on uncaptured
// work in another stream" (seen on an H100); or delete `if (stream_) reduced_->wait(current_stream(...));`
// in GradientReducer::finish and the same four fail (seen on an H100: the sums read before the reduction
// stream wrote them), while MissingGradientsReadNothingToTheHost and the graphed training run still pass. The weight
// gathers are only delayed: at one rank an all-gather moves nothing, so a missing wait around one cannot show here.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>

#include "config/config.h"
#include "engine/device.h"
#include "kernels/common/device_api.h"
#include "parallel/backends.h"
#include "parallel/grad_reducer.h"
#include "parallel/process_group.h"
#include "tests/mpi/grad_reducer_cases.h"
#include "tests/mpi/stream_delay.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"
#include "train/trainer.h"

namespace flowmoe::test {
namespace {

using HookPoint = GradientReducer::HookPoint;

// The delays and the doubling described above. The plain schedule reduces on the compute stream, which
// the hook tells apart from the reduction's: it is only delayed.
void delay_and_double(HookPoint point, cudaStream_t stream, const Tensor& buffer) {
  const bool reduction_stream = stream != current_stream(buffer.device().index);
  switch (point) {
    case HookPoint::bucket_copy:
      spin_on_stream(stream, 2000);
      break;
    case HookPoint::reduction:
      if (!reduction_stream) break;
      spin_on_stream(stream, 1000);
      scale_on_stream(stream, buffer.data<float>(), buffer.numel(), 2.0f);
      break;
    case HookPoint::gather:
      spin_on_stream(stream, 1000);
      break;
  }
}

// The same delays, the values left alone: for whole training runs.
void delay_only(HookPoint point, cudaStream_t stream, const Tensor&) {
  spin_on_stream(stream, point == HookPoint::bucket_copy ? 2000 : 1000);
}

// A one-rank NCCL world on cuda:0 with the hook installed for the test's length.
class NcclOneRank : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!built_with_nccl() || !cuda_available()) GTEST_SKIP() << "needs NCCL and a CUDA device";
    cuda_set_device(0);
    world_ = make_nccl_communicator(make_none_communicator(), 0);
    GradientReducer::set_stream_hook(&delay_and_double);
  }
  void TearDown() override { GradientReducer::set_stream_hook(nullptr); }
  ParallelState state() const { return make_parallel_state(world_, 1, kExperts); }

  std::shared_ptr<Communicator> world_;
  const Device gpu_ = Device::cuda(0);
};

// Buckets of 4 bytes: a parameter each, most reduced where the backward left the gradient.
TEST_F(NcclOneRank, OverlapOnItsOwnStreamGivesThePlainSums) {
  for (bool captured : {false, true})
    for (size_t bucket_bytes : {kTestBucketBytes, size_t(4)})
      for (int max_ctas : {0, 2}) {
        SCOPED_TRACE(std::string(captured ? "captured" : "eager") + ", buckets of " + std::to_string(bucket_bytes) +
                     " bytes, max_ctas " + std::to_string(max_ctas));
        ReduceRun run;
        run.device = gpu_;
        run.bucket_bytes = bucket_bytes;
        run.max_ctas = max_ctas;
        run.captured = captured;
        check_overlap_gives_plain_sums(state(), run, 2.0f);
      }
}

TEST_F(NcclOneRank, ShardedSegmentsHoldThePlainSums) {
  for (bool captured : {false, true}) {
    SCOPED_TRACE(captured ? "captured" : "eager");
    check_sharded_reduction(state(), gpu_, kTestBucketBytes, captured, 2.0f);
    SCOPED_TRACE("a parameter per bucket");
    check_sharded_reduction(state(), gpu_, 4, captured, 2.0f);
  }
}

TEST_F(NcclOneRank, LoneGradientsReduceWhereTheyLie) {
  for (bool captured : {false, true}) {
    SCOPED_TRACE(captured ? "captured" : "eager");
    check_lone_gradients(state(), gpu_, captured);
  }
}

// A parameter this rank has no gradient for: the presence exchange does nothing a capture cannot hold.
TEST_F(NcclOneRank, MissingGradientsCountAsZeroAndNoneStaysNone) {
  for (bool captured : {false, true})
    for (bool shard : {false, true}) {
      SCOPED_TRACE(std::string(captured ? "captured" : "eager") + (shard ? ", sharded" : ", whole"));
      check_missing_gradients(state(), gpu_, shard, captured, 2.0f);
    }
}

// A rank missing a gradient reads nothing to the host in finish(): nothing a graph could not replay, and
// nothing that keeps train.cuda_graph: auto from capturing the step.
TEST_F(NcclOneRank, MissingGradientsReadNothingToTheHost) {
  std::vector<Variable> params;
  for (int64_t size : {3, 200}) params.emplace_back(Tensor::zeros({size}, DType::f32, gpu_), true);
  GradientReducer reducer(state(), params, std::vector<ParamShard>(params.size()), true, 16 * sizeof(float));
  reducer.begin();
  params[1].set_grad(Tensor::zeros({200}, DType::f32, gpu_));  // parameter 0 has none
  const uint64_t syncs = num_host_syncs();
  reducer.finish();
  EXPECT_EQ(num_host_syncs(), syncs);
  EXPECT_FALSE(params[0].grad().defined());
}

// configs/gpu_small.yaml for a few steps through the one-rank world with the sharded optimizer (so its
// reducer reduce-scatters and all-gathers through NCCL on its own stream), the step captured as one CUDA
// graph against the eager step, both with the streams held back: the same weights bit for bit, and no
// host synchronisation in any step.
TEST_F(NcclOneRank, GraphedShardedTrainingMatchesEager) {
  GradientReducer::set_stream_hook(&delay_only);
  const std::filesystem::path d = fresh_dir("nccl_one_rank");
  auto run = [&](const std::string& mode) {
    const Config c = load_config(
        std::string(FLOWMOE_SOURCE_DIR) + "/configs/gpu_small.yaml",
        {"train.steps=4", "train.batch_size=4", "train.eval_every=0", "checkpoint.every=0", "optimizer.warmup_steps=2",
         "parallel.shard_optimizer=true", "train.cuda_graph=" + mode, "logging.out_dir=" + (d / mode).string()});
    TrainOptions o = quiet();
    o.world = world_;
    o.device = gpu_;
    TrainResult r = train(c, o);
    return std::make_pair(r, read_metrics(r.metrics_file));
  };
  const auto [graph, graph_rows] = run("on");  // on: a step that cannot be captured fails the run
  const auto [eager, eager_rows] = run("off");
  ASSERT_EQ(graph_rows.size(), 4u);
  ASSERT_EQ(eager_rows.size(), 4u);
  for (size_t i = 0; i < graph_rows.size(); ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_EQ(graph_rows[i].loss, eager_rows[i].loss);
    EXPECT_EQ(graph_rows[i].grad_norm, eager_rows[i].grad_norm);
    EXPECT_EQ(graph_rows[i].host_syncs, 0);
    EXPECT_EQ(eager_rows[i].host_syncs, 0);
  }
  EXPECT_TRUE(same_model_weights(graph.last_checkpoint, eager.last_checkpoint));
  std::filesystem::remove_all(d);
}

}  // namespace
}  // namespace flowmoe::test
