// The MoE layer's token chunks (parallel.exchange_chunks, layers/moe.cpp) over the world as one
// expert-parallel group with the zero-sync exchange. Chunked, the layer's forward and backward equal the
// layer's tokens at once to f32 rounding (the expert weight gradients sum chunk by chunk), and the chunks'
// exchanges on the comm stream (engine/stream_lane.h) equal them on the compute stream bit for bit: the same
// sums in the same order. On the CPU under mpirun (the lane's tickets and the walk's order, one stream),
// and with nccl and a GPU per rank on the GPUs (the comm stream beside the compute stream).
#include "parallel/backends.h"
#include "tests/mpi/comm_test_util.h"
#include "tests/support/checks.h"
#include "tests/support/moe_config.h"

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
  return o;
}

// chunks=1 (the reference), then 2 and 3 chunks with the exchanges on the comm stream and inline.
template <class Run>
void check_chunked_runs(const Run& run, MoeRecipe recipe, double rel_tol) {
  const LayerRun one = run(1, true);
  for (int chunks : {2, 3}) {
    SCOPED_TRACE(std::to_string(chunks) + " chunks");
    const LayerRun lane = run(chunks, true), inline_ = run(chunks, false);
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

// The cases: 37 tokens per rank (uneven chunks); 1 token (empty chunks); 37 tokens all routed to experts 0
// and 1 (a routing bias far above the scores: one rank's experts get every row, the others none).
struct Case {
  const char* name;
  int64_t tokens;
  bool hot;
};
constexpr Case kCases[] = {{"37 tokens", 37, false}, {"1 token", 1, false}, {"hot experts 0 and 1", 37, true}};

void check_chunks(std::shared_ptr<Communicator> group, Device device, DType compute, double rel_tol) {
  const ModelConfig c = moe_test_config(8, 2, 128, 128, 1, 0.05);
  for (const Case& k : kCases)
    for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_flow}) {
      SCOPED_TRACE(std::string(k.name) + ", " + moe_recipe_name(recipe));
      const Inputs in = rank_inputs(group->rank(), k.tokens, 128);
      Tensor bias;
      if (k.hot) bias = Tensor::from_floats({100, 100, 0, 0, 0, 0, 0, 0}, {8}, DType::f32, device);
      const auto run = [&](int chunks, bool comm_stream) {
        return run_layer(c, chunked(group, recipe, chunks, comm_stream), in.x, in.dy, device, compute, 11, bias);
      };
      check_chunked_runs(run, recipe, rel_tol);
      if (!k.hot) continue;
      // The bias did route every row to experts 0 and 1: the other experts' fc1 gradients are zero.
      const Tensor fc1 = run(2, true).grads[1];  // [L, 2F, H]: this rank's experts
      const int64_t L = fc1.size(0), first = int64_t(group->rank()) * L;
      for (int64_t e = 0; e < L; ++e) {
        const std::vector<double> g = fc1.slice(0, e, e + 1).contiguous().to_doubles();
        double sq = 0;
        for (double v : g) sq += v * v;
        EXPECT_EQ(sq == 0, first + e >= 2) << "expert " << first + e;
      }
    }
}

TEST(ExchangeChunks, ChunkedLayerEqualsTheLayerAtOnce) {
  Communicator& world = test_world();
  if (world.size() < 2) GTEST_SKIP() << "one rank exchanges nothing: chunks do not apply";
  check_chunks(test_runtime().world, Device::cpu(), DType::f32, 1e-6);
}

// Token chunks overlap a zero-sync exchange only: with no group (one rank) or over the sync exchange, which would
// read each chunk's counts to the host, exchange_chunks 4 gives a layer of one chunk, the same forward and
// backward bit for bit as exchange_chunks 1. A count below 1 is refused.
TEST(ExchangeChunks, OneRankOrTheSyncExchangeTakesTheTokensAtOnce) {
  const ModelConfig c = moe_test_config(8, 2, 128, 128, 0, 0.05);
  const Inputs in = rank_inputs(test_world().rank(), 5, 128);
  MoeOptions no_group, sync;
  sync.expert_parallel = test_runtime().world;
  sync.ep_dispatch = EpDispatch::sync;
  for (MoeOptions o : {no_group, sync}) {
    SCOPED_TRACE(o.expert_parallel ? "the sync exchange" : "no group");
    o.exchange_chunks = 4;
    {
      ParamFactory f(11, Device::cpu());
      EXPECT_EQ(MoeLayer(f, c, "mlp", o, Device::cpu()).num_chunks(), 1);
    }
    const LayerRun four = run_layer(c, o, in.x, in.dy, Device::cpu(), DType::f32);
    o.exchange_chunks = 1;
    const LayerRun one = run_layer(c, o, in.x, in.dy, Device::cpu(), DType::f32);
    EXPECT_TRUE(bit_equal(four.y, one.y)) << "y";
    EXPECT_TRUE(bit_equal(four.dx, one.dx)) << "dx";
    ASSERT_EQ(four.grads.size(), one.grads.size());
    for (size_t i = 0; i < one.grads.size(); ++i)
      EXPECT_TRUE(bit_equal(four.grads[i], one.grads[i])) << "gradient " << i;
    o.exchange_chunks = 0;
    EXPECT_TRUE(throws_naming<ConfigError>([&] { run_layer(c, o, in.x, in.dy, Device::cpu(), DType::f32); },
                                           {"parallel.exchange_chunks", "at least 1"}));
  }
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
