// The gradient reducer's shared checks (see grad_reducer_cases.h).
#include "tests/mpi/grad_reducer_cases.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>

#include "engine/cuda_graph.h"
#include "parallel/grad_reducer.h"
#include "train/trainer.h"

namespace flowmoe::test {

Config moe_config() {
  return parse_config(
      "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 3, num_attention_heads: 2,"
      " intermediate_size: 64, max_position_embeddings: 16, n_routed_experts: 4, num_experts_per_tok: 2,"
      " n_shared_experts: 1, moe_intermediate_size: 16, first_k_dense_replace: 1}\n"
      "data: {seq_len: 16}\n"
      "train: {device: cpu}\n",
      "reducer_test.yaml");
}

Tensor coded_ids(int rank, int a) {
  std::vector<int64_t> ids(2 * 16);
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = int64_t((rank * 13 + a * 7 + int(i) * 5) % 64);
  return Tensor::from_ints(ids, {2, 16}, DType::i32);
}

namespace {

// Runs step() once; captured, then captures it as a CUDA graph on `device` and replays that. What the
// step leaves behind is then the replay's, valid while the caller keeps `graph`. The step's inputs must
// be on the device already: an upload inside a capture would synchronise the host.
void run_step(const std::function<void()>& step, bool captured, Device device,
              std::unique_ptr<CudaGraphCapture>& graph) {
  step();
  if (!captured) return;
  graph = std::make_unique<CudaGraphCapture>(device);
  graph->capture([&] {
    step();
    return std::vector<Tensor>{};
  });
  graph->replay();
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> times(std::vector<float> v, float factor) {
  for (float& x : v) x *= factor;  // exact for factor 2
  return v;
}

}  // namespace

Reduced reduced_gradients(const ParallelState& ps, const ReduceRun& run) {
  const Config cfg = moe_config();
  Transformer model(cfg.model, run.device, run.device.is_cuda() ? DType::bf16 : DType::f32, 7, moe_options(cfg, ps));
  GradientReducer reducer(ps, model.parameters(), model.parameter_shards(), run.overlap, run.bucket_bytes,
                          run.max_ctas);
  const int me = ps.world->rank();
  std::vector<Tensor> ids;  // ids[a] are micro-batch a's inputs and a - 1's targets
  for (int a = 0; a <= run.micro_batches; ++a) ids.push_back(coded_ids(me, a).to(run.device));
  std::unique_ptr<CudaGraphCapture> graph;
  run_step(
      [&] {
        for (Variable p : model.parameters()) p.zero_grad();
        for (int a = 0; a < run.micro_batches; ++a) {
          if (a + 1 == run.micro_batches) reducer.begin();
          model.loss(ids[size_t(a)], ids[size_t(a) + 1]).backward();
        }
        reducer.finish();
      },
      run.captured, run.device, graph);
  Reduced out;
  out.launched_early = reducer.num_launched_in_backward();
  out.buckets = reducer.num_buckets();
  out.in_place = reducer.num_reduced_in_place();
  for (const Variable& p : model.parameters())
    out.grads.push_back(p.grad().defined() ? p.grad().to_floats() : std::vector<float>{});
  return out;
}

::testing::AssertionResult same_sums(const float* got, const float* want, size_t n, double scale, int ranks,
                                     float factor) {
  for (size_t j = 0; j < n; ++j) {
    const float w = want[j] * factor;
    const bool same = ranks <= 2 ? got[j] == w : std::abs(double(got[j]) - w) <= 1e-6 * scale * factor;
    if (!same) return ::testing::AssertionFailure() << "element " << j << ": " << got[j] << " against " << w;
  }
  return ::testing::AssertionSuccess();
}

double largest_magnitude(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, double(std::abs(x)));
  return m;
}

void check_overlap_gives_plain_sums(const ParallelState& ps, const ReduceRun& overlapped, float factor) {
  ReduceRun plain_run = overlapped;
  plain_run.overlap = false;
  plain_run.captured = false;
  const Reduced plain = reduced_gradients(ps, plain_run);
  const Reduced got = reduced_gradients(ps, overlapped);
  EXPECT_EQ(plain.launched_early, 0);
  // The backward finishes the buckets one after another and launches each as it does, down to the
  // embedding's, final last: none is left for finish().
  EXPECT_GT(got.buckets, 4);
  EXPECT_EQ(got.launched_early, got.buckets);
  ASSERT_EQ(plain.grads.size(), got.grads.size());
  for (size_t p = 0; p < plain.grads.size(); ++p) {
    EXPECT_FALSE(plain.grads[p].empty()) << "parameter " << p;
    EXPECT_TRUE(same_bits(got.grads[p], times(plain.grads[p], factor))) << "parameter " << p;
  }
}

void check_lone_gradients(const ParallelState& ps, Device device, bool captured) {
  // 4-byte buckets: one parameter each. 1 GiB buckets: one per group, every gradient copied into it.
  ReduceRun lone_run, whole_run;
  lone_run.device = whole_run.device = device;
  lone_run.bucket_bytes = 4;
  lone_run.captured = captured;
  whole_run.bucket_bytes = size_t(1) << 30;
  const Reduced lone = reduced_gradients(ps, lone_run), whole = reduced_gradients(ps, whole_run);
  EXPECT_EQ(size_t(lone.buckets), lone.grads.size());
  if (device.is_cpu()) {
    EXPECT_EQ(lone.in_place, lone.buckets) << "every lone gradient is a fresh tensor here";
  } else {
    EXPECT_GT(lone.in_place, 0);
  }
  EXPECT_LE(whole.buckets, 2);
  EXPECT_EQ(whole.in_place, 0);
  ASSERT_EQ(lone.grads.size(), whole.grads.size());
  for (size_t p = 0; p < lone.grads.size(); ++p) {
    ASSERT_EQ(lone.grads[p].size(), whole.grads[p].size()) << "parameter " << p;
    ASSERT_TRUE(same_sums(lone.grads[p].data(), whole.grads[p].data(), lone.grads[p].size(),
                          largest_magnitude(whole.grads[p]), ps.world->size()))
        << "parameter " << p;
  }
}

void check_sharded_reduction(const ParallelState& ps, Device device, size_t bucket_bytes, bool captured, float factor) {
  const Config cfg = moe_config();
  ReduceRun plain_run;
  plain_run.overlap = false;
  plain_run.device = device;
  const std::vector<std::vector<float>> plain = reduced_gradients(ps, plain_run).grads;
  Transformer model(cfg.model, device, device.is_cuda() ? DType::bf16 : DType::f32, 7, moe_options(cfg, ps));
  const std::vector<Variable>& params = model.parameters();
  GradientReducer reducer(ps, params, model.parameter_shards(), true, bucket_bytes, 0, /*shard=*/true);
  ASSERT_TRUE(reducer.sharded());
  const int me = ps.world->rank();
  std::vector<Tensor> ids;
  for (int a = 0; a <= 2; ++a) ids.push_back(coded_ids(me, a).to(device));
  std::unique_ptr<CudaGraphCapture> reduction, gather;
  run_step(
      [&] {
        for (Variable p : params) p.zero_grad();
        for (int a = 0; a < 2; ++a) {
          if (a == 1) reducer.begin();
          model.loss(ids[size_t(a)], ids[size_t(a) + 1]).backward();
        }
        reducer.finish();
      },
      captured, device, reduction);
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
    ASSERT_TRUE(same_sums(got.data(), plain[i].data() + begin, got.size(), largest_magnitude(plain[i]),
                          ps.world->size(), factor))
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
  run_step([&] { reducer.gather_weights(); }, captured, device, gather);
  reducer.wait_weights();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::vector<float> w = params[i].data().to_floats();
    for (size_t j = 0; j < w.size(); ++j)
      ASSERT_EQ(w[j], float(int64_t(i) * 1000 + int64_t(j) % 1000)) << "parameter " << i << " element " << j;
  }
}

void check_missing_gradients(const ParallelState& ps, Device device, bool shard, bool captured, float factor) {
  const int me = ps.world->rank(), n = ps.world->size();
  std::vector<Variable> params;
  for (int64_t size : {3, 200, 2, 4}) params.emplace_back(Tensor::zeros({size}, DType::f32, device), true);
  const std::vector<ParamShard> shards(params.size());
  GradientReducer reducer(ps, params, shards, true, 16 * sizeof(float), 0, shard);
  // Only rank 0 has parameter 2; nobody has 3. Made before any capture: the step copies them.
  std::vector<Tensor> grads(params.size());
  for (size_t p = 0; p < params.size(); ++p) {
    if ((p == 2 && me != 0) || p == 3) continue;
    std::vector<float> g(size_t(params[p].shape()[0]));
    for (size_t j = 0; j < g.size(); ++j) g[j] = float((me + 1) * 1000 + int(p) * 100 + int(j) % 97);
    grads[p] = Tensor::from_floats(g, {int64_t(g.size())}).to(device);
  }
  std::unique_ptr<CudaGraphCapture> graph;
  run_step(
      [&] {
        for (Variable p : params) p.zero_grad();
        reducer.begin();
        // A gradient nothing else refers to, as a backward leaves it (a lone one is reduced where it lies).
        for (size_t p = 0; p < params.size(); ++p)
          if (grads[p].defined()) params[p].set_grad(grads[p].clone());
        reducer.finish();  // no backward reported anything: every bucket goes in finish(), in order
      },
      captured, device, graph);
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
      ASSERT_EQ(got[k], float(sum / n) * factor) << "parameter " << p << " element " << j;
    }
  }
  EXPECT_FALSE(params[3].grad().defined()) << "a gradient no rank had stays undefined";
  if (shard) {
    EXPECT_FALSE(reducer.range_grads()[3].defined()) << "a gradient no rank had stays undefined";
  }
  EXPECT_THROW(reducer.finish(), Error);  // finish() without begin()
}

}  // namespace flowmoe::test
