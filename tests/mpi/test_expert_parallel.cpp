// Expert parallelism in the trainer (parallel/expert_parallel.h, parallel/data_parallel.h) on the world this
// test runs in, for every expert-parallel size it allows: expert gradients reduced over their
// expert-data-parallel group and dense ones over the world, the gradient norm of the full model,
// checkpoints gathered from the shards and sliced back at any size, and the start-up check of the
// size. Values are small integers times powers of two, so every sum is exact in any order.
#include <cmath>
#include <filesystem>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "parallel/data_parallel.h"
#include "parallel/expert_parallel.h"
#include "parallel/process_group.h"
#include "tests/mpi/comm_test_util.h"
#include "tests/support/checks.h"
#include "train/optimizer.h"

namespace flowmoe::test {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kExperts = 8;  // divisible by every expert-parallel size of a world of 1, 2 or 4

// Every expert-parallel size the world allows.
std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int e = 1; e <= n; ++e)
    if (n % e == 0) out.push_back(e);
  return out;
}

// The groups of cfg's parallel.expert_parallel_size over this test's world, as a run makes them.
ParallelState run_state(const Config& cfg) {
  return run_parallel_state(test_runtime().world, cfg.parallel.expert_parallel_size, cfg.model.n_routed_experts,
                            cfg.origin("parallel.expert_parallel_size"));
}

// Element j of row `row` of parameter t as rank r holds it: distinct per rank, row and tensor.
float code(int r, size_t t, int64_t row, int64_t j) { return float((r + 1) * 4096 + int64_t(t) * 512 + row * 8 + j); }

// A small model's parameters as expert parallelism shards them: a dense vector, two expert weights
// [kExperts, 2, 3] of which this rank holds its group's rows, and a dense matrix; zero AdamW moments.
struct ShardedParams {
  std::vector<Variable> params;
  std::vector<ParamShard> shards;
  std::vector<Tensor> exp_avg, exp_avg_sq;
};
ShardedParams sharded_params(const ParallelState& ps) {
  ShardedParams s;
  const int64_t rows = ps.num_local_experts, offset = ps.expert_parallel_size == 1 ? 0 : ps.expert_offset;
  const auto add = [&](const std::string& name, const Shape& shape, ParamShard shard) {
    s.params.emplace_back(Tensor::zeros(shape, DType::f32), true, name);
    s.shards.push_back(shard);
    s.exp_avg.push_back(Tensor::zeros(shape, DType::f32));
    s.exp_avg_sq.push_back(Tensor::zeros(shape, DType::f32));
  };
  add("dense.bias", {5}, {false, 0, 5});
  add("experts.fc1.weight", {rows, 2, 3}, {true, offset, kExperts});
  add("experts.fc2.weight", {rows, 2, 3}, {true, offset, kExperts});
  add("dense.weight", {2, 4}, {false, 0, 2});
  return s;
}

// Fills tensor t of parameter index `index` with code(r, index, global row, j).
void fill_coded(Tensor t, int r, size_t index, int64_t first_row) {
  const int64_t rows = t.size(0), width = t.numel() / std::max<int64_t>(rows, 1);
  std::vector<float> v(size_t(t.numel()));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < width; ++j) v[size_t(i * width + j)] = code(r, index, first_row + i, j);
  t.copy_(Tensor::from_floats(v, t.shape()));
}

TEST(ExpertParallelTraining, ExpertGradientsReduceOverTheirGroupAndDenseOnesOverTheWorld) {
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  for (int e : divisors(n)) {
    SCOPED_TRACE("expert_parallel_size " + std::to_string(e));
    const ParallelState ps = make_parallel_state(test_runtime().world, e, kExperts);
    ShardedParams s = sharded_params(ps);
    for (size_t p = 0; p < s.params.size(); ++p) {
      if (p == 2 && me >= e) continue;  // fc2: only the first expert-parallel group has gradients
      if (p == 3) continue;             // no rank has one
      Tensor g = Tensor::zeros(s.params[p].shape(), DType::f32);
      fill_coded(g, me, p, s.shards[p].offset);
      s.params[p].set_grad(g);
    }
    all_reduce_gradients(ps, s.params, s.shards, 16 * sizeof(float));
    for (size_t p = 0; p < 3; ++p) {
      ASSERT_TRUE(s.params[p].grad().defined()) << "parameter " << p;
      const Tensor g = s.params[p].grad();
      const int64_t rows = g.size(0), width = g.numel() / rows;
      const std::vector<float> got = g.to_floats();
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < width; ++j) {
          double sum = 0;  // dense: every rank; expert: the ranks at this rank's place in their groups
          for (int r = 0; r < n; ++r)
            if (p == 0 || (r % e == me % e && (p == 1 || r < e))) sum += code(r, p, s.shards[p].offset + i, j);
          ASSERT_EQ(got[size_t(i * width + j)], float(sum / n)) << "parameter " << p << " element " << i * width + j;
        }
    }
    EXPECT_FALSE(s.params[3].grad().defined()) << "a gradient no rank had stays undefined";
  }
}

TEST(ExpertParallelTraining, AtSizeOneTheReductionIsTheDataParallelOne) {
  Communicator& world = test_world();
  const ParallelState ps = run_state(parse_config("model:\n  n_routed_experts: 8\n", "ep.yaml"));
  EXPECT_EQ(ps.expert_data_parallel.get(), test_runtime().world.get()) << "no communicator is split at size 1";
  ShardedParams a = sharded_params(ps), b = sharded_params(ps);
  for (size_t p = 0; p < a.params.size(); ++p) {
    Tensor g = Tensor::zeros(a.params[p].shape(), DType::f32);
    fill_coded(g, world.rank(), p, 0);
    a.params[p].set_grad(tensor_scale(g, 1.0 / 3.0));  // inexact values: the bits must still agree
    b.params[p].set_grad(tensor_scale(g, 1.0 / 3.0));
  }
  all_reduce_gradients(ps, a.params, a.shards);
  all_reduce_gradients(world, b.params);
  for (size_t p = 0; p < a.params.size(); ++p) {
    const std::vector<float> got = a.params[p].grad().to_floats();
    EXPECT_EQ(got, b.params[p].grad().to_floats());
    // Both are the mean over the world of the ranks' gradients, computed here from their codes.
    const int64_t rows = a.params[p].shape()[0], width = int64_t(got.size()) / rows;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < width; ++j) {
        double mean = 0;
        for (int r = 0; r < world.size(); ++r) mean += double(float(double(code(r, p, i, j)) / 3.0)) / world.size();
        ASSERT_NEAR(got[size_t(i * width + j)], mean, 1e-6 * mean) << "parameter " << p << " element " << i * width + j;
      }
  }
}

TEST(ExpertParallelTraining, GradientNormIsTheFullModels) {
  Communicator& world = test_world();
  for (int e : divisors(world.size())) {
    SCOPED_TRACE("expert_parallel_size " + std::to_string(e));
    const ParallelState ps = make_parallel_state(test_runtime().world, e, kExperts);
    ShardedParams s = sharded_params(ps);
    double want = 0;  // the norm one process holding every row has: the same on every rank
    for (size_t p = 0; p < s.params.size(); ++p) {
      Tensor g = Tensor::zeros(s.params[p].shape(), DType::f32);
      fill_coded(g, 0, p, s.shards[p].offset);
      s.params[p].set_grad(g);
      const int64_t width = g.numel() / g.size(0);
      for (int64_t i = 0; i < s.shards[p].full_rows; ++i)
        for (int64_t j = 0; j < width; ++j) want += double(code(0, p, i, j)) * double(code(0, p, i, j));
    }
    AdamW opt(s.params, OptimizerConfig{});
    EXPECT_EQ(global_grad_norm(ps, opt, s.shards), std::sqrt(want));
    if (e == 1) {
      EXPECT_EQ(global_grad_norm(ps, opt, s.shards), opt.grad_norm());
    }
  }
}

// The checkpoint of a run at size e is the files one process writes; it loads at every size.
TEST(ExpertParallelTraining, CheckpointsGatherTheShardsAndLoadAtAnySize) {
  Communicator& world = test_world();
  const int n = world.size();
  const fs::path root = fs::temp_directory_path() / ("flowmoe_test_ep_checkpoint_np" + std::to_string(n));
  if (world.rank() == 0) fs::remove_all(root);
  world.barrier();
  for (int e : divisors(n)) {
    SCOPED_TRACE("saved at expert_parallel_size " + std::to_string(e));
    const ParallelState ps = make_parallel_state(test_runtime().world, e, kExperts);
    ShardedParams s = sharded_params(ps);
    for (size_t p = 0; p < s.params.size(); ++p) {  // weights code 0, moments codes 1 and 2: all distinct
      fill_coded(s.params[p].data(), 0, p, s.shards[p].offset);
      fill_coded(s.exp_avg[p], 1, p, s.shards[p].offset);
      fill_coded(s.exp_avg_sq[p], 2, p, s.shards[p].offset);
    }
    const FullState full = gather_full_state(*ps.expert_parallel, s.params, s.shards, s.exp_avg, s.exp_avg_sq, true);
    ASSERT_EQ(full.params.size(), s.params.size());
    for (size_t p = 0; p < s.params.size(); ++p) {
      EXPECT_EQ(full.params[p].name(), s.params[p].name());
      EXPECT_EQ(full.params[p].shape()[0], s.shards[p].full_rows);
      Tensor want = Tensor::zeros(full.params[p].shape(), DType::f32);
      fill_coded(want, 0, p, 0);
      EXPECT_EQ(full.params[p].data().to_floats(), want.to_floats()) << s.params[p].name();
      fill_coded(want, 2, p, 0);
      EXPECT_EQ(full.exp_avg_sq[p].to_floats(), want.to_floats()) << s.params[p].name();
    }
    CheckpointMeta meta;
    meta.step = e;
    if (world.rank() == 0) save_checkpoint(root.string(), meta, full.params, full.exp_avg, full.exp_avg_sq, 10);
    world.barrier();
    for (int load_e : divisors(n)) {
      SCOPED_TRACE("loaded at expert_parallel_size " + std::to_string(load_e));
      const ParallelState at = make_parallel_state(test_runtime().world, load_e, kExperts);
      ShardedParams l = sharded_params(at);
      load_checkpoint(checkpoint_path(root.string(), e), l.params, &l.exp_avg, &l.exp_avg_sq, {}, l.shards);
      for (size_t p = 0; p < l.params.size(); ++p) {
        Tensor want = Tensor::zeros(l.params[p].shape(), DType::f32);
        fill_coded(want, 0, p, l.shards[p].offset);
        EXPECT_EQ(l.params[p].data().to_floats(), want.to_floats()) << l.params[p].name();
        fill_coded(want, 1, p, l.shards[p].offset);
        EXPECT_EQ(l.exp_avg[p].to_floats(), want.to_floats()) << l.params[p].name();
      }
    }
    // A model with other experts: the file's full shape is named against the one expected.
    ShardedParams other = sharded_params(ps);
    other.shards[1].full_rows = 2 * kExperts;
    EXPECT_TRUE(throws_naming<IoError>(
        [&] { load_checkpoint(checkpoint_path(root.string(), e), other.params, nullptr, nullptr, {}, other.shards); },
        {"tensor 'experts.fc1.weight' is f32[8, 2, 3] on cpu", "the model expects f32[16, 2, 3]"}));
    world.barrier();  // every rank has read before the next size's files replace these
  }
  if (world.rank() == 0) fs::remove_all(root);
}

TEST(ExpertParallelTraining, SizesThatDoNotFitTheLaunchAreRefusedOnEveryRank) {
  const int n = test_world().size();
  const auto state = [&](const std::vector<std::string>& sets) {
    run_state(parse_config("model:\n  n_routed_experts: 6\n", "ep.yaml", sets));
  };
  const std::string wide = std::to_string(2 * n);
  EXPECT_TRUE(throws_naming<AllRanksConfigError>(
      [&] { state({"parallel.expert_parallel_size=" + wide}); },
      {("--set parallel.expert_parallel_size=" + wide + ": parallel.expert_parallel_size: " + wide +
        " does not divide the " + std::to_string(n) + " ranks")
           .c_str()}));
  if (n == 4) {
    EXPECT_TRUE(throws_naming<AllRanksConfigError>([&] { state({"parallel.expert_parallel_size=4"}); },
                                                   {"parallel.expert_parallel_size: 4 does not divide "
                                                    "model.n_routed_experts 6"}));
  }
  test_world().barrier();  // no rank went on to split a group
}

TEST(ExpertParallelTraining, StartUpLineNamesTheGroupsAndTheExperts) {
  const int n = test_world().size();
  for (int e : divisors(n)) {
    const Config cfg = parse_config("model:\n  n_routed_experts: 8\n", "ep.yaml",
                                    {"parallel.expert_parallel_size=" + std::to_string(e)});
    const ParallelState ps = run_state(cfg);
    const std::string line = describe_ranks(ps, cfg.train.batch_size), b = std::to_string(8 / n);
    const std::string ranks = std::to_string(n) + " ranks (backend " + test_world().backend_name() + "), each reads " +
                              b + " of every batch of 8 sequences";
    if (e == 1) {
      EXPECT_EQ(line, "data-parallel: " + ranks);
      continue;
    }
    const std::string k = std::to_string(8 / e);
    EXPECT_EQ(line, "expert-parallel " + std::to_string(e) + " x data-parallel " + std::to_string(n / e) + ": " +
                        ranks + " and holds " + k + " of the 8 routed experts: rank r the experts [" + k + "p, " + k +
                        "p + " + k + ") with p = r mod " + std::to_string(e));
  }
}

}  // namespace
}  // namespace flowmoe::test
