// The MoE layer's token chunks (parallel.exchange_chunks, layers/moe.cpp) over the world as one
// expert-parallel group with the zero-sync exchange. Chunked, the layer's forward and backward equal the
// layer's tokens at once to f32 rounding (the expert weight gradients sum chunk by chunk), and the chunks'
// exchanges on the comm stream (engine/comm_lane.h) equal them on the compute stream bit for bit: the same
// sums in the same order. On the CPU under mpirun (the lane's tickets and the walk's order, one stream),
// and with nccl and a GPU per rank on the GPUs (the comm stream beside the compute stream).
#include "parallel/backends.h"
#include "tests/moe_test_config.h"
#include "tests/mpi/comm_test_util.h"
#include "tests/test_util.h"

namespace flowmoe::test {
namespace {

// Rank-coded inputs: each rank's tokens differ, and 37 tokens split unevenly into 2 or 3 chunks.
struct Inputs {
  Tensor x, dy;
};
Inputs rank_inputs(int rank, int64_t tokens, int64_t hidden) {
  Rng rng(1000 + uint64_t(rank));
  return {rng.normal({tokens, hidden}, 0, 1), rng.normal({tokens, hidden}, 0, 1)};
}

MoeOptions chunked(std::shared_ptr<Communicator> group, MoeRecipe recipe, int chunks, bool comm_stream) {
  MoeOptions o;
  o.recipe = recipe;
  o.expert_parallel = std::move(group);
  o.ep_dispatch = EpDispatch::zero_sync;
  o.exchange_chunks = chunks;
  o.exchange_comm_stream = comm_stream;
  o.exchange_sms = 0;  // the GEMMs' grid stays as the unchunked layer's, so their sums do too
  return o;
}

void check_chunks(std::shared_ptr<Communicator> group, Device device, DType compute, double rel_tol) {
  const ModelConfig c = moe_test_config(8, 2, 128, 128, 1, 0.05);
  const Inputs in = rank_inputs(group->rank(), 37, 128);
  for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_flow}) {
    SCOPED_TRACE(moe_recipe_name(recipe));
    const LayerRun one = run_layer(c, chunked(group, recipe, 1, true), in.x, in.dy, device, compute);
    for (int chunks : {2, 3}) {
      SCOPED_TRACE(std::to_string(chunks) + " chunks");
      const LayerRun lane = run_layer(c, chunked(group, recipe, chunks, true), in.x, in.dy, device, compute);
      const LayerRun inline_ = run_layer(c, chunked(group, recipe, chunks, false), in.x, in.dy, device, compute);
      EXPECT_TRUE(bit_equal(lane.y, inline_.y)) << "y";
      EXPECT_TRUE(bit_equal(lane.dx, inline_.dx)) << "dx";
      ASSERT_EQ(lane.grads.size(), inline_.grads.size());
      for (size_t i = 0; i < lane.grads.size(); ++i)
        EXPECT_TRUE(bit_equal(lane.grads[i], inline_.grads[i])) << "gradient " << i;
      // Against the unchunked layer: each token's rows see the same GEMMs; the expert weight gradients are
      // summed per chunk, and in FP8 their column-wise 1x128 blocks group other rows (other scales).
      const double grad_tol = recipe == MoeRecipe::bf16 ? rel_tol : 1e-2;
      EXPECT_LE(rel_error(lane.y, one.y), rel_tol) << "y against the unchunked layer";
      EXPECT_LE(rel_error(lane.dx, one.dx), rel_tol) << "dx against the unchunked layer";
      for (size_t i = 0; i < lane.grads.size(); ++i)
        EXPECT_LE(rel_error(lane.grads[i], one.grads[i]), grad_tol) << "gradient " << i << " against one chunk";
    }
  }
}

TEST(ExchangeChunks, ChunkedLayerEqualsTheLayerAtOnce) {
  Communicator& world = test_world();
  if (world.size() < 2) GTEST_SKIP() << "one rank exchanges nothing: chunks do not apply";
  check_chunks(test_runtime().world, Device::cpu(), DType::f32, 1e-6);
}

TEST(ExchangeChunks, OneRankOrTheSyncExchangeTakesTheTokensAtOnce) {
  const ModelConfig c = moe_test_config(8, 2, 128, 128, 0, 0.05);
  const Inputs in = rank_inputs(test_world().rank(), 5, 128);
  MoeOptions o;
  o.exchange_chunks = 4;  // no group: nothing to overlap, and the layer is the plain one
  const LayerRun four = run_layer(c, o, in.x, in.dy, Device::cpu(), DType::f32);
  o.exchange_chunks = 1;
  const LayerRun one = run_layer(c, o, in.x, in.dy, Device::cpu(), DType::f32);
  EXPECT_TRUE(bit_equal(four.y, one.y));
  o.exchange_chunks = 0;
  EXPECT_TRUE(throws_naming<ConfigError>([&] { run_layer(c, o, in.x, in.dy, Device::cpu(), DType::f32); },
                                         {"parallel.exchange_chunks", "at least 1"}));
}

TEST(ExchangeChunksCuda, CommStreamEqualsTheComputeStreamBitForBit) {
  const std::string why = why_no_nccl_gpu_per_rank();
  if (!why.empty()) GTEST_SKIP() << why;
  Communicator& world = test_world();
  std::shared_ptr<Communicator> nccl = make_nccl_communicator(test_runtime().world, world.rank());
  if (!nccl->device_puts()) GTEST_SKIP() << "the GPUs do not reach each other: zero_sync reads its tables on the host";
  check_chunks(nccl, Device::cuda(world.rank()), DType::bf16, 1e-2);
}

}  // namespace
}  // namespace flowmoe::test
