// Dual micro-batches (parallel.dual_microbatch, Transformer::losses): the batch as two halves interleaved layer
// by layer equals the batch at once to f32 rounding (the loss is the mean of the halves' means; the weight
// gradients sum over the halves apart), in each recipe, with the world as one expert-parallel group over the
// zero-sync exchange (its exchanges on the comm lane) and over the sync one, and in one process. Rank-coded
// token ids. On the CPU under mpirun; an odd batch is a ShapeError naming the key. With nccl and a GPU per rank,
// the exchanges on the comm stream equal them on the compute stream bit for bit.
#include "engine/stream_lane.h"
#include "layers/transformer.h"
#include "parallel/backends.h"
#include "parallel/process_group.h"
#include "tests/mpi/comm_test_util.h"
#include "tests/support/checks.h"

namespace flowmoe::test {
namespace {

ModelConfig dual_config() {
  ModelConfig c;
  c.vocab_size = 64, c.hidden_size = 128, c.num_hidden_layers = 3, c.num_attention_heads = 2;
  c.intermediate_size = 128, c.max_position_embeddings = 16;
  c.n_routed_experts = 8, c.num_experts_per_tok = 2, c.n_shared_experts = 1, c.moe_intermediate_size = 128;
  c.first_k_dense_replace = 1, c.aux_loss_alpha = 0.01;
  return c;
}

// Rank r's batch of 4 sequences of 12 tokens: ids that depend on both.
Tensor coded_ids(int rank, int shift) {
  std::vector<int64_t> ids(4 * 12);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t((rank * 13 + shift * 7 + int(i) * 5) % 64);
  return Tensor::from_ints(ids, {4, 12}, DType::i32);
}

struct StepRun {
  float lm = 0, aux = 0;
  std::vector<Tensor> grads;
};

StepRun run_step(const MoeOptions& o, bool dual, int rank, Device device = Device::cpu()) {
  Transformer model(dual_config(), device, device.is_cuda() ? DType::bf16 : DType::f32, 7, o);
  model.set_dual_microbatch(dual);
  const Transformer::Losses l = model.losses(coded_ids(rank, 0), coded_ids(rank, 1));
  l.total().backward();
  StepRun r{l.lm.data().to_floats()[0], l.aux.data().to_floats()[0], {}};
  for (const Variable& p : model.parameters())
    r.grads.push_back(p.grad().defined() ? p.grad().to(Device::cpu()) : Tensor());
  return r;
}

// on_lane: the dual step's exchanges must go to the comm lane (zero_sync over several ranks).
void check_dual_equals_plain(const MoeOptions& o, int rank, bool on_lane = false) {
  const StepRun plain = run_step(o, false, rank);
  const uint64_t before = comm_lane_last_ticket(Device::cpu());
  const StepRun dual = run_step(o, true, rank);
  // 2 MoE layers × 2 halves × (dispatch, return) forward, as many backward.
  if (on_lane) {
    EXPECT_GE(comm_lane_last_ticket(Device::cpu()) - before, 16u) << "the exchanges on the comm lane";
  }
  EXPECT_NEAR(dual.lm, plain.lm, 1e-5 * std::abs(plain.lm)) << "lm";
  EXPECT_NEAR(dual.aux, plain.aux, 1e-5 * std::abs(plain.aux) + 1e-9) << "aux";
  ASSERT_EQ(dual.grads.size(), plain.grads.size());
  // FP8: an expert's column-wise 1x128 wgrad blocks group other rows in each half (other scales).
  const double tol = o.recipe == MoeRecipe::bf16 ? 1e-5 : 2e-2;
  for (size_t i = 0; i < plain.grads.size(); ++i) {
    ASSERT_EQ(dual.grads[i].defined(), plain.grads[i].defined()) << "gradient " << i;
    if (plain.grads[i].defined()) {
      EXPECT_LE(rel_error(dual.grads[i], plain.grads[i]), tol) << "gradient " << i;
    }
  }
}

}  // namespace

TEST(DualMicrobatch, EqualsTheBatchAtOnceOverTheExpertParallelGroup) {
  const auto& world = test_runtime().world;
  const ParallelState ps = make_parallel_state(world, world->size(), dual_config().n_routed_experts);
  for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_flow})
    for (EpDispatch mode : {EpDispatch::zero_sync, EpDispatch::sync}) {
      SCOPED_TRACE(std::string(moe_recipe_name(recipe)) + ", " + ep_dispatch_name(mode));
      MoeOptions o;
      o.recipe = recipe;
      o.ep_dispatch = mode;
      o.expert_parallel = ps.expert_parallel_size > 1 ? ps.expert_parallel : nullptr;
      o.shared_expert_overlap = true;  // as training has it at EP > 1: both halves' shared experts on the side stream
      check_dual_equals_plain(o, world->rank(), world->size() > 1 && mode == EpDispatch::zero_sync);
    }
}

TEST(DualMicrobatch, EqualsTheBatchAtOnceInOneProcess) {
  for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow}) {
    SCOPED_TRACE(moe_recipe_name(recipe));
    MoeOptions o;
    o.recipe = recipe;
    check_dual_equals_plain(o, test_runtime().world->rank());
  }
}

TEST(DualMicrobatch, EvaluationAndAnOddBatch) {
  MoeOptions o;
  Transformer model(dual_config(), Device::cpu(), DType::f32, 7, o);
  model.set_dual_microbatch(true);
  {  // without grad (an evaluation) the batch runs at once, whatever its size
    NoGradGuard no_grad;
    const Tensor ids = coded_ids(0, 0).slice(0, 0, 3).contiguous();
    EXPECT_TRUE(std::isfinite(model.losses(ids, ids).lm.data().to_floats()[0]));
  }
  const Tensor odd = coded_ids(0, 0).slice(0, 0, 3).contiguous();
  EXPECT_TRUE(throws_naming<ShapeError>([&] { model.losses(odd, odd); }, {"parallel.dual_microbatch", "3 sequences"}));
}

// On GPUs through nccl, a GPU per rank: the dual step's exchanges on the comm stream equal them on the compute
// stream bit for bit (the same ops in the same order), in bf16 and fp8_flow over the zero-sync exchange.
TEST(DualMicrobatchCuda, CommStreamEqualsTheComputeStreamBitForBit) {
  const std::string why = why_no_nccl_gpu_per_rank();
  if (!why.empty()) GTEST_SKIP() << why;
  Communicator& world = test_world();
  cuda_set_device(world.rank());
  std::shared_ptr<Communicator> nccl = make_nccl_communicator(test_runtime().world, world.rank());
  if (!nccl->device_puts()) GTEST_SKIP() << "the GPUs do not reach each other: zero_sync reads its tables on the host";
  for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_flow}) {
    SCOPED_TRACE(moe_recipe_name(recipe));
    MoeOptions o;
    o.recipe = recipe;
    o.ep_dispatch = EpDispatch::zero_sync;
    o.expert_parallel = nccl;
    o.shared_expert_overlap = true;
    const StepRun lane = run_step(o, true, world.rank(), Device::cuda(world.rank()));
    o.exchange_comm_stream = false;
    const StepRun inline_ = run_step(o, true, world.rank(), Device::cuda(world.rank()));
    EXPECT_EQ(lane.lm, inline_.lm);
    EXPECT_EQ(lane.aux, inline_.aux);
    ASSERT_EQ(lane.grads.size(), inline_.grads.size());
    for (size_t i = 0; i < lane.grads.size(); ++i)
      if (lane.grads[i].defined()) {
        EXPECT_TRUE(bit_equal(lane.grads[i], inline_.grads[i])) << "gradient " << i;
      }
  }
  nccl->barrier();
  cuda_set_device(0);
}

}  // namespace flowmoe::test
