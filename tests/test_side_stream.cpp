// Side branches (engine/stream_lane.h): the allocator holds freed blocks while one is open; autograd tags
// the nodes recorded in one and runs their backward there; and on a GPU, the MoE layer with its shared
// experts on the side stream equals the one-stream layer bit for bit, forward and backward, in every recipe.
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "engine/allocator.h"
#include "engine/ops/ops.h"
#include "engine/stream_lane.h"
#include "layers/moe.h"
#include "tests/support/checks.h"
#include "tests/support/moe_config.h"

using namespace flowmoe;
using namespace flowmoe::test;

// While a branch is open: a block the side stream frees is held (counted live) until the join; one the
// compute stream frees serves the compute stream again at once, never the side stream.
TEST(CachingAllocator, HeldReleasesFollowTheStreamThatFreedThem) {
  CachingAllocator a([](size_t n) { return std::malloc(n); }, [](void* p) { std::free(p); });
  void* side = a.allocate(1000, /*on_side=*/true);
  void* compute = a.allocate(1000);
  a.hold_releases();
  a.release(side, /*on_side=*/true);
  a.release(compute);
  EXPECT_EQ(a.stats().live_bytes, 1024u) << "the side stream's block still counts as live, the compute one not";
  void* s2 = a.allocate(1000, /*on_side=*/true);
  EXPECT_NE(s2, side);
  EXPECT_NE(s2, compute) << "the side stream took a block the compute stream freed during the branch";
  void* c2 = a.allocate(1000);
  EXPECT_EQ(c2, compute) << "the compute stream's own freed block serves it again";
  void* c3 = a.allocate(1000);
  EXPECT_NE(c3, side) << "a held block was handed out";
  a.release(c2);
  a.release_held();
  EXPECT_EQ(a.stats().live_bytes, 2048u);  // s2 and c3
  void* again = a.allocate(1000);
  EXPECT_TRUE(again == side || again == compute) << "the held blocks return to the pool at the join";
  for (void* p : {s2, c3, again}) a.release(p);
  EXPECT_EQ(a.stats().live_bytes, 0u);
}

namespace {

// y = x, recording whether each run and each vjp happened in a side branch.
std::vector<std::pair<std::string, bool>> g_log;
class Probe : public Primitive {
 public:
  explicit Probe(std::string name) : name_(std::move(name)) {}
  const char* name() const override { return "probe"; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    g_log.emplace_back(name_, in_side_branch());
    return {in[0].clone()};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return eval_cpu(in); }
  bool saves_inputs() const override { return false; }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d,
                          const std::vector<bool>&) override {
    g_log.emplace_back("d " + name_, in_side_branch());
    return {tensor_scale(d[0], 2.0)};
  }

 private:
  std::string name_;
};
Variable probe(const std::string& name, const Variable& x) { return apply(std::make_shared<Probe>(name), {x})[0]; }

}  // namespace

// x → main → (+) and x → side → side2 → (+): the side ops and their vjps run in the branch, the rest
// outside it, and the gradient is the one-stream gradient (2 + 4 per element).
TEST(SideBranch, TheBackwardRunsTheBranchsNodesOnItsStream) {
  for (bool enabled : {true, false}) {
    SCOPED_TRACE(enabled ? "side branch" : "one stream");
    g_log.clear();
    Variable x(Tensor::full({3}, 1.0, DType::f32, Device::cpu()), true);
    Variable s;
    {
      LaneScope side(Lane::side, Device::cpu(), enabled);
      s = probe("side2", probe("side", x));
    }
    EXPECT_EQ(side_branch_open(Device::cpu()), enabled);
    Variable m = probe("main", x);
    join_side_branch(Device::cpu());
    EXPECT_FALSE(side_branch_open(Device::cpu()));
    Variable y = add(m, s);
    y.backward(Tensor::full({3}, 1.0, DType::f32, Device::cpu()));
    EXPECT_FALSE(in_side_branch());
    EXPECT_FALSE(side_branch_open(Device::cpu())) << "the backward joins the branch it forked";
    const std::vector<std::pair<std::string, bool>> want = {{"side", enabled},   {"side2", enabled},
                                                            {"main", false},     {"d side2", enabled},
                                                            {"d side", enabled}, {"d main", false}};
    EXPECT_EQ(g_log, want);
    EXPECT_EQ(x.grad().to_doubles(), std::vector<double>(3, 6.0));
  }
}

// A checkpoint recorded in the branch recomputes and backpropagates there, inner walk included.
TEST(SideBranch, ACheckpointInTheBranchStaysThere) {
  g_log.clear();
  Variable x(Tensor::full({2}, 1.0, DType::f32, Device::cpu()), true);
  Variable s;
  {
    LaneScope side(Lane::side, Device::cpu());
    s = checkpoint([](const std::vector<Variable>& in) { return std::vector<Variable>{probe("inner", in[0])}; },
                   {x})[0];
  }
  join_side_branch(Device::cpu());
  add(s, probe("main", x)).backward(Tensor::full({2}, 1.0, DType::f32, Device::cpu()));
  for (const auto& [what, on_side] : g_log) EXPECT_EQ(on_side, what != "main" && what != "d main") << what;
  EXPECT_FALSE(in_side_branch());
  EXPECT_EQ(x.grad().to_doubles(), std::vector<double>(2, 4.0));
}

// The MoE layer (shared experts on the side stream) against itself on one stream: the same bits, for 0,
// 1, 100 and 1000 tokens (sizes not multiples of 128), in each recipe, and no memory left held. fp8_full's
// shared experts are FP8 linears, whose rows come in multiples of 16: 0, 16, 112 and 1008 tokens; they read
// the dispatch's quantized x, so their backward adds into that tensor's gradient from the side stream.
TEST(SideBranchCuda, MoeLayerWithSharedExpertOverlapEqualsOneStream) {
  FLOWMOE_REQUIRE_CUDA();
  for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow, MoeRecipe::fp8_full})
    for (int64_t T : recipe == MoeRecipe::fp8_full ? std::vector<int64_t>{0, 16, 112, 1008}
                                                   : std::vector<int64_t>{0, 1, 100, 1000}) {
      SCOPED_TRACE(std::string(moe_recipe_name(recipe)) + ", T=" + std::to_string(T));
      const ModelConfig c = moe_test_config(16, 4, 256, 128, 2, 0.05, 4, 2);
      Rng rng(test_seed());
      const Tensor x = rng.normal({T, 256}, 0, 1).to(Device::cuda()).to(DType::bf16);
      const Tensor dy = rng.normal({T, 256}, 0, 1).to(Device::cuda()).to(DType::bf16);
      auto run = [&](bool overlap) {
        MoeOptions o(16);
        o.recipe = recipe;
        o.shared_expert_overlap = overlap;
        return run_layer(c, o, x, dy, Device::cuda(), DType::bf16, 7);
      };
      const LayerRun one = run(false), two = run(true);
      EXPECT_FALSE(side_branch_open(Device::cuda()));
      EXPECT_TRUE(bit_equal(two.y, one.y)) << "y";
      EXPECT_TRUE(bit_equal(two.dx, one.dx)) << "dx";
      ASSERT_EQ(one.grads.size(), two.grads.size());
      for (size_t i = 0; i < one.grads.size(); ++i) {
        if (!one.grads[i].defined() && !two.grads[i].defined()) continue;
        EXPECT_TRUE(bit_equal(two.grads[i], one.grads[i])) << "gradient " << i;
      }
    }
}
