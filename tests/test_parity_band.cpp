// The noise band of a parity study (studies/parity_band.h): the statistic on a hand-computed case, the
// verdicts and the exit status they give, and on real CPU training a candidate trained at 3x the
// reference's learning rate falls outside the band that data-order controls make, while one more
// data-order run does not.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "studies/parity.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// A run whose loss is `loss` at every step 1..n and whose final validation loss is `val`.
ParityRun flat_run(const std::string& name, double loss, int n, double val, bool control = false) {
  ParityRun r;
  r.name = r.recipe = name;
  r.control = control;
  for (int i = 1; i <= n; ++i) {
    StepMetrics m;
    m.step = i;
    m.loss = loss;
    r.rows.push_back(m);
  }
  r.final_val_loss = val;
  return r;
}

const ParityCandidate& candidate(const ParityReport& r, const std::string& name) {
  for (const ParityCandidate& c : r.candidates)
    if (c.name == name) return c;
  throw Error("no candidate " + name);
}

}  // namespace

// Flat losses make every EMA error exact: a run at loss 2 (1 + e) against a reference at 2 has error e
// at every step. Controls at 1%, 2% and 4%: the largest control's mean error is 4%, so with margin 0.25
// a candidate at 4.95% (ratio 1.2375) is within, one at 5.2% (1.3) outside.
TEST(ParityBand, TheStatisticOnAHandComputedCase) {
  const int n = 10;
  std::vector<ParityRun> runs = {flat_run("bf16", 2.0, n, 3.0),       flat_run("fp8_a", 2.099, n, 3.03),
                                 flat_run("fp8_b", 2.104, n, 2.97),   flat_run("c1", 2.02, n, 3.06, true),
                                 flat_run("c2", 1.96, n, 2.94, true), flat_run("c3", 2.08, n, 3.015, true)};
  ParityReport r = make_parity_report(runs, 0.0025, 2, 0.25);
  ASSERT_TRUE(r.band.defined());
  EXPECT_EQ(r.band.num_controls, 3);
  EXPECT_NEAR(r.band.control_mean_max, 0.04, 1e-12);
  EXPECT_NEAR(r.band.control_max_max, 0.04, 1e-12);
  EXPECT_NEAR(r.band.final_val_rel_min, -0.02, 1e-12);  // c2: 2.94 against 3.0
  EXPECT_NEAR(r.band.final_val_rel_max, 0.02, 1e-12);   // c1: 3.06
  ASSERT_EQ(r.band.upper.size(), size_t(n));
  EXPECT_TRUE(std::isnan(r.band.upper[0]) && std::isnan(r.band.upper[1]));  // the warmup is not banded
  for (int i = 2; i < n; ++i) EXPECT_NEAR(r.band.upper[size_t(i)], 0.04, 1e-12) << "step " << i + 1;

  const ParityCandidate a = candidate(r, "fp8_a");
  EXPECT_TRUE(a.judged_against_noise);
  EXPECT_NEAR(a.noise_ratio, 0.0495 / 0.04, 1e-9);
  EXPECT_TRUE(a.within_noise) << a.noise_reason;
  EXPECT_FALSE(a.pass);  // 4.95% is far above the 0.25% bar
  EXPECT_NEAR(a.final_val_rel, 0.01, 1e-12);
  const ParityCandidate b = candidate(r, "fp8_b");
  EXPECT_NEAR(b.noise_ratio, 0.052 / 0.04, 1e-9);
  EXPECT_FALSE(b.within_noise);
  EXPECT_NE(b.noise_reason.find("1.30x the largest of the 3 controls'"), std::string::npos) << b.noise_reason;
  EXPECT_FALSE(candidate(r, "c1").judged_against_noise);  // a control is the band, not judged by it
  EXPECT_EQ(r.exit_status(), 1);                          // fp8_b is outside the noise

  // Without fp8_b every candidate is within the noise but fails the bar: status 4.
  runs.erase(runs.begin() + 2);
  EXPECT_EQ(make_parity_report(runs, 0.0025, 2, 0.25).exit_status(), 4);
  // A bar the noise fits under: 0. A tighter margin puts fp8_a outside: 1.
  EXPECT_EQ(make_parity_report(runs, 0.06, 2, 0.25).exit_status(), 0);
  EXPECT_EQ(make_parity_report(runs, 0.06, 2, 0.1).exit_status(), 1);
  // Without controls the bar alone decides, as before: 1 fails, 0 passes.
  std::vector<ParityRun> plain = {runs[0], runs[1]};
  EXPECT_FALSE(make_parity_report(plain, 0.0025, 2).band.defined());
  EXPECT_EQ(make_parity_report(plain, 0.0025, 2).exit_status(), 1);
  EXPECT_EQ(make_parity_report(plain, 0.06, 2).exit_status(), 0);
  // The summary line gives both verdicts and the final-loss parity beside the controls' spread.
  const std::string line = parity_summary_line(r, candidate(r, "fp8_b"));
  for (const char* part :
       {"FAIL (threshold 0.25%)", "OUTSIDE noise (mean error 1.30x the largest of 3 controls', margin 25%)",
        "final val loss -1% vs bf16 (controls -2% to +2%)"})
    EXPECT_NE(line.find(part), std::string::npos) << part << "\n" << line;
}

TEST(ParityBand, ANonFiniteCandidateIsOutsideTheNoise) {
  std::vector<ParityRun> runs = {flat_run("bf16", 2.0, 6, 3.0), flat_run("fp8", 2.0, 6, 3.0),
                                 flat_run("c1", 2.02, 6, 3.0, true), flat_run("c2", 1.99, 6, 3.0, true)};
  runs[1].rows[4].loss = NAN;
  runs[1].rows[4].skipped = true;
  const ParityReport r = make_parity_report(runs, 0.0025, 1);
  EXPECT_FALSE(r.candidates[0].within_noise);
  EXPECT_EQ(r.candidates[0].noise_reason, "non-finite or skipped steps");
  EXPECT_EQ(r.exit_status(), 1);
  // One control is a floor to read, not a band: no noise verdict, and the bar alone sets the status.
  runs.pop_back();
  runs[1] = flat_run("fp8", 2.0, 6, 3.0);
  const ParityReport one = make_parity_report(runs, 0.0025, 1);
  EXPECT_FALSE(one.band.defined());
  EXPECT_FALSE(one.candidates[0].judged_against_noise);
  EXPECT_EQ(one.exit_status(), 0);
}

// Real training on the CPU: 3 controls differ from the reference in batch order only. A run at 3x the
// learning rate is a different training, far outside their band; a fourth data order is not.
TEST(ParityBand, ThreeTimesTheLearningRateFallsOutsideTheBand) {
  const fs::path d = fresh_dir("parity_band");
  const auto run = [&](const std::string& name, int64_t data_seed, double lr_scale, bool control) {
    Config c = parse_config(
        "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,"
        " intermediate_size: 64, max_position_embeddings: 16, n_routed_experts: 4, num_experts_per_tok: 2,"
        " moe_intermediate_size: 16, first_k_dense_replace: 1}\n"
        "data: {seq_len: 16, synthetic_tokens: 40000, val_fraction: 0.1}\n"
        "train: {device: cpu, steps: 40, batch_size: 8, eval_every: 0, eval_batches: 4}\n"
        "optimizer: {lr: 0.003, min_lr: 0.0003, warmup_steps: 5}\n"
        "checkpoint: {final: false}\n",
        "band_test.yaml");
    c.data.seed = data_seed;
    c.optimizer.lr *= lr_scale;
    c.optimizer.min_lr *= lr_scale;
    c.logging.out_dir = (d / name).string();
    const TrainResult t = train(c, quiet());
    ParityRun p;
    p.name = name;
    p.recipe = "bf16";
    p.control = control;
    p.rows = read_metrics(t.metrics_file);
    p.final_val_loss = t.final_val_loss;
    return p;
  };
  std::vector<ParityRun> runs = {run("bf16", 100, 1, false), run("lr3x", 100, 3, false), run("order4", 104, 1, false)};
  for (int k = 1; k <= 3; ++k) runs.push_back(run("control" + std::to_string(k), 100 + k, 1, true));
  const ParityReport r = make_parity_report(runs, 0.0025, 5);
  const ParityCandidate fast = candidate(r, "lr3x");
  EXPECT_FALSE(fast.within_noise) << "ratio " << fast.noise_ratio;
  EXPECT_GT(fast.noise_ratio, 2.0);
  const ParityCandidate order = candidate(r, "order4");
  EXPECT_TRUE(order.within_noise) << order.noise_reason;
  EXPECT_EQ(r.exit_status(), 1);
  fs::remove_all(d);
}
