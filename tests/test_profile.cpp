// The step profiler (engine/profiler.h, train/step_profile.h, `flowmoe train --profile N`): scopes,
// phases (a checkpoint's recompute apart), nested ops counted once, FLOP counts, the table, and the
// command end to end; profiling changes no result. With a GPU, the same on CUDA events.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/ops/ops.h"
#include "engine/profiler.h"
#include "tests/support/train_fixtures.h"
#include "train/step_profile.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

const OpTiming* find(const std::vector<OpTiming>& ops, const std::string& scope, const std::string& op, OpPhase phase) {
  for (const OpTiming& o : ops)
    if (o.scope == scope && o.op == op && o.phase == phase) return &o;
  return nullptr;
}

// x [4,8] · w1ᵀ in scope "a.b", then checkpoint(silu ∘ linear w2) in scope "c", backward outside.
std::vector<OpTiming> profile_small_graph(Device device) {
  Rng rng(3);
  Variable x(random_tensor(rng, {4, 8}, DType::f32, device), true);
  Variable w1(random_tensor(rng, {16, 8}, DType::f32, device), true),
      w2(random_tensor(rng, {8, 16}, DType::f32, device), true);
  profile_begin();
  Variable h;
  {
    ProfileScope a("a");
    ProfileScope b("b");
    EXPECT_EQ(profile_scope(), "a.b");
    h = linear(x, w1);
  }
  Variable y;
  {
    ProfileScope c("c");
    y = checkpoint([&](const std::vector<Variable>& in) { return std::vector<Variable>{silu(linear(in[0], w2))}; },
                   {h})[0];
  }
  EXPECT_EQ(profile_scope(), "");
  sum(y).backward();
  return profile_end();
}

}  // namespace

TEST(Profiler, ScopesPhasesAndFlops) {
  const std::vector<OpTiming> ops = profile_small_graph(Device::cpu());
  const OpTiming* fwd = find(ops, "a.b", "linear", OpPhase::forward);
  ASSERT_NE(fwd, nullptr);
  EXPECT_EQ(fwd->calls, 1);
  EXPECT_DOUBLE_EQ(fwd->flops, 2.0 * 4 * 16 * 8);
  EXPECT_DOUBLE_EQ(fwd->bytes, (4 * 8 + 16 * 8 + 4 * 16) * 4.0);        // x, w1 in; y out
  const OpTiming* bwd = find(ops, "a.b", "linear", OpPhase::backward);  // charged to its forward's scope
  ASSERT_NE(bwd, nullptr);
  EXPECT_DOUBLE_EQ(bwd->flops, 2 * fwd->flops);
  // The checkpoint: its forward, then in the backward the recompute, then the recomputed ops' backward.
  EXPECT_NE(find(ops, "c", "silu", OpPhase::forward), nullptr);
  EXPECT_NE(find(ops, "c", "silu", OpPhase::recompute), nullptr);
  EXPECT_NE(find(ops, "c", "linear", OpPhase::recompute), nullptr);
  EXPECT_NE(find(ops, "c", "silu", OpPhase::backward), nullptr);
  EXPECT_NE(find(ops, "c", "linear", OpPhase::backward), nullptr);
  for (const OpTiming& o : ops) {
    EXPECT_GE(o.device_ms, 0) << o.op;
    EXPECT_EQ(o.device_ms, o.host_ms) << o.op << ": on the CPU both are the host clock";
  }
  EXPECT_FALSE(profiling());
  EXPECT_THROW(profile_end(), Error);
}

TEST(Profiler, NestedTimersCountOnceAndNothingIsRecordedWhenOff) {
  {
    OpTimer off("nothing", OpPhase::forward, "", Device::cpu(), 1, 1);  // profiler off: a no-op
  }
  profile_begin();
  {
    OpTimer outer("outer", OpPhase::step, "optimizer", Device::cpu(), 10, 20);
    OpTimer inner("inner", OpPhase::step, "optimizer", Device::cpu(), 1, 1);
    outer.add_bytes(5);
  }
  EvalPhaseGuard phase(OpPhase::backward);
  EXPECT_EQ(forward_phase(), OpPhase::backward);
  const std::vector<OpTiming> ops = profile_end();
  ASSERT_EQ(ops.size(), 1u);
  EXPECT_EQ(ops[0].op, "outer");
  EXPECT_DOUBLE_EQ(ops[0].flops, 10);
  EXPECT_DOUBLE_EQ(ops[0].bytes, 25);
  EXPECT_EQ(profile_part("layers.12.moe"), "moe");
  EXPECT_EQ(profile_part("head"), "head");
  EXPECT_EQ(profile_part(""), "(outside the model)");
}

TEST(Profiler, TheTableSumsPartsAndRanksOps) {
  StepProfile p;
  p.step = 7;
  p.device = "cpu";
  p.wall_ms = 10;
  p.ops = {{"layers.0.moe", "grouped_linear", OpPhase::forward, 2, 3.0, 3.0, 6e9, 1e9},
           {"layers.1.moe", "grouped_linear", OpPhase::forward, 2, 1.0, 1.0, 2e9, 1e9},
           {"layers.0.attention", "causal_attention", OpPhase::backward, 1, 2.0, 2.0, 0, 0},
           {"optimizer", "adamw", OpPhase::step, 1, 2.0, 2.0, 0, 4e9}};
  const std::string t = profile_table(p);
  EXPECT_NE(t.find("profile of step 7 on cpu: 10.000 ms wall; the ops take 8.000 ms"), std::string::npos) << t;
  // moe: 4 ms of 8 forward; its op row sums both layers: 8e9 flops in 4 ms = 2 TFLOP/s.
  EXPECT_NE(t.find("  moe                             4.000      0.000      0.000      0.000   50.0%"),
            std::string::npos)
      << t;
  EXPECT_NE(t.find("  layers.1.moe                    1.000"), std::string::npos) << t;
  const size_t gl = t.find("grouped_linear"), att = t.find("causal_attention   ");
  ASSERT_NE(gl, std::string::npos);
  EXPECT_LT(gl, t.find("adamw")) << "ops are ranked by device time";
  EXPECT_NE(t.find("4      4.000   50.0%     4.000         2      500"), std::string::npos) << t;  // 2e9 bytes in 4 ms
  EXPECT_NE(att, std::string::npos);
}

TEST(ProfileCommand, TrainProfilesOneStepAndChangesNoResult) {
  const fs::path d = fresh_dir("profile_cmd");
  const std::string base = std::string(FLOWMOE_BINARY_DIR) + "/flowmoe train --config " + FLOWMOE_SOURCE_DIR +
                           "/configs/tiny_moe.yaml --set train.device=cpu --set train.steps=4"
                           " --set optimizer.warmup_steps=2 --set train.eval_every=0 --set data.seq_len=32"
                           " --set data.synthetic_tokens=20000 --set train.batch_size=4 --set logging.progress=plain"
                           " --set precision.recipe=fp8_flow --set 'train.recompute=[moe_expert]'";
  auto run = [&](const std::string& name, const std::string& extra) {
    const fs::path out = d / (name + ".txt");
    const int status = std::system(
        (base + " --set logging.out_dir=" + (d / name).string() + extra + " > " + out.string() + " 2>&1").c_str());
    std::ifstream in(out);
    std::stringstream ss;
    ss << in.rdbuf();
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1, ss.str());
  };
  const auto [plain_rc, plain] = run("plain", "");
  const auto [rc, out] = run("profiled", " --profile 3");
  ASSERT_EQ(plain_rc, 0) << plain;
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("profile of step 3 on cpu:"), std::string::npos) << out;
  for (const char* part : {"  attention ", "  moe ", "  mlp ", "  embed ", "  head ", "  optimizer ", "layers.2.moe"})
    EXPECT_NE(out.find(part), std::string::npos) << part << "\n" << out;
  EXPECT_NE(out.find("recompute"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(d / "profiled" / "profile.txt"));
  // The same losses with and without the profiler.
  std::ifstream a(d / "plain" / "metrics.jsonl"), b(d / "profiled" / "metrics.jsonl");
  std::string la, lb;
  int rows = 0;
  while (std::getline(a, la) && std::getline(b, lb)) {
    EXPECT_EQ(la.substr(0, la.find("\"tokens_per_s\"")), lb.substr(0, lb.find("\"tokens_per_s\""))) << "row " << rows;
    ++rows;
  }
  EXPECT_EQ(rows, 4);
  EXPECT_EQ(run("bad0", " --profile 0").first, 2);
  EXPECT_EQ(run("bad9", " --profile 9").first, 2);  // past train.steps
  fs::remove_all(d);
}

TEST(ProfilerCuda, EventsTimeTheSameGraph) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device: GPU test skipped";
  const std::vector<OpTiming> ops = profile_small_graph(Device::cuda(0));
  const OpTiming* fwd = find(ops, "a.b", "linear", OpPhase::forward);
  ASSERT_NE(fwd, nullptr);
  EXPECT_GT(fwd->device_ms, 0);
  EXPECT_NE(find(ops, "c", "silu", OpPhase::recompute), nullptr);
}
