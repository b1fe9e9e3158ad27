// `flowmoe parity`: the report math on synthetic metrics (EMA, relative error, the warmup cut, the
// verdict, non-finite steps), and the command end to end on configs/tiny_moe.yaml (a few CPU steps).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <yaml-cpp/yaml.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "studies/parity.h"
#include "tests/support/train_fixtures.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

ParityRun synthetic_run(const std::string& name, const std::vector<double>& losses) {
  ParityRun r;
  r.name = r.recipe = name;
  for (size_t i = 0; i < losses.size(); ++i) {
    StepMetrics m;
    m.step = int64_t(i) + 1;
    m.loss = losses[i];
    m.skipped = !std::isfinite(losses[i]);
    r.rows.push_back(m);
  }
  return r;
}

}  // namespace

TEST(Parity, EmaStartsAtTheFirstLossAndHoldsOverNonFiniteOnes) {
  const std::vector<double> e = loss_ema({NAN, 2.0, 4.0, INFINITY, 4.0});
  EXPECT_TRUE(std::isnan(e[0]));
  EXPECT_DOUBLE_EQ(e[1], 2.0);
  EXPECT_DOUBLE_EQ(e[2], 0.9 * 2.0 + 0.1 * 4.0);
  EXPECT_DOUBLE_EQ(e[3], e[2]);
  EXPECT_DOUBLE_EQ(e[4], 0.9 * e[2] + 0.1 * 4.0);
}

TEST(Parity, RelativeErrorIsNanWithoutAFiniteNonZeroReference) {
  EXPECT_NEAR(relative_error(2.2, 2.0), 0.1, 1e-12);
  EXPECT_NEAR(relative_error(1.8, 2.0), 0.1, 1e-12);
  EXPECT_TRUE(std::isnan(relative_error(1.0, 0.0)));
  EXPECT_TRUE(std::isnan(relative_error(NAN, 2.0)));
}

TEST(Parity, TheVerdictReadsOnlyTheStepsAfterWarmup) {
  // The candidate is 100% off during the 2 warmup steps; after them its EMA comes back towards the
  // reference's, so the largest error that counts is step 3's, below the warmup's.
  const std::vector<double> ref = {4, 4, 3, 3, 3, 3}, cand = {8, 8, 3, 3, 3, 3};
  ParityReport r = make_parity_report({synthetic_run("bf16", ref), synthetic_run("fp8", cand)}, 0.95, 2);
  ASSERT_EQ(r.candidates.size(), 1u);
  const ParityCandidate& c = r.candidates[0];
  EXPECT_EQ(c.compared_steps, 4);
  const std::vector<double> a = loss_ema(ref), b = loss_ema(cand);
  EXPECT_DOUBLE_EQ(c.max_rel_err, relative_error(b[2], a[2]));
  EXPECT_LT(c.max_rel_err, 0.95);
  EXPECT_GT(c.max_rel_err, c.mean_rel_err);
  EXPECT_TRUE(c.pass);
  EXPECT_TRUE(r.passed());
  r = make_parity_report({synthetic_run("bf16", ref), synthetic_run("fp8", cand)}, 0.9, 2);
  EXPECT_FALSE(r.candidates[0].pass);
  EXPECT_FALSE(r.passed());
  EXPECT_EQ(r.candidates[0].reason, "max EMA relative error above the threshold");
}

// The EMA's alpha: 0 compares the raw losses (step 3's error is then 0, the warmup's errors gone at
// once); a longer EMA carries the warmup's gap further. Outside [0, 1) it is an error.
TEST(Parity, TheEmaAlphaSetsHowFarTheWarmupsGapCarries) {
  const std::vector<double> ref = {4, 4, 3, 3, 3, 3}, cand = {8, 8, 3, 3, 3, 3};
  const auto report = [&](double alpha) {
    return make_parity_report({synthetic_run("bf16", ref), synthetic_run("fp8", cand)}, 0.95, 2, 0.25, alpha);
  };
  const ParityReport raw = report(0), short_ema = report(0.5), long_ema = report(0.95);
  EXPECT_EQ(raw.ema_alpha, 0);
  EXPECT_EQ(raw.candidates[0].max_rel_err, 0);
  EXPECT_DOUBLE_EQ(short_ema.candidates[0].max_rel_err, relative_error(loss_ema(cand, 0.5)[2], loss_ema(ref, 0.5)[2]));
  EXPECT_GT(long_ema.candidates[0].max_rel_err, short_ema.candidates[0].max_rel_err);
  EXPECT_NE(parity_json(short_ema).find("\"ema_alpha\": 0.5"), std::string::npos);
  EXPECT_THROW(report(1.0), ConfigError);
  EXPECT_THROW(report(-0.1), ConfigError);
}

TEST(Parity, ANonFiniteStepFailsAndTheControlIsNotJudged) {
  ParityRun control = synthetic_run("control", {4, 5, 6, 7});
  control.control = true;
  const ParityReport r =
      make_parity_report({synthetic_run("bf16", {4, 4, 4, 4}), synthetic_run("fp8", {4, NAN, 4, 4}), control}, 1.0, 0);
  ASSERT_EQ(r.candidates.size(), 2u);
  EXPECT_FALSE(r.candidates[0].pass);
  EXPECT_EQ(r.candidates[0].nonfinite_steps, std::vector<int64_t>{2});
  EXPECT_DOUBLE_EQ(r.candidates[0].max_rel_err, 0.0);  // the EMA held over the bad step
  EXPECT_TRUE(r.candidates[1].control);
  EXPECT_FALSE(r.passed());
  const ParityReport bad_reference =
      make_parity_report({synthetic_run("bf16", {4, NAN, 4, 4}), synthetic_run("fp8", {4, 4, 4, 4})}, 1.0, 0);
  EXPECT_EQ(bad_reference.candidates[0].reason, "the reference run has non-finite or skipped steps");
  const std::string line = parity_summary_line(r, r.candidates[1]);
  EXPECT_NE(line.find("control vs bf16: max EMA rel err"), std::string::npos) << line;
  EXPECT_NE(line.find("not judged"), std::string::npos) << line;
}

TEST(Parity, NoStepAfterWarmupFailsAndTheJsonParses) {
  const ParityReport r =
      make_parity_report({synthetic_run("bf16", {4, 3}), synthetic_run("fp8_flow", {4, 3})}, 0.0025, 5);
  EXPECT_FALSE(r.candidates[0].pass);
  EXPECT_EQ(parity_summary_line(r, r.candidates[0]),
            "fp8_flow vs bf16: max EMA rel err n/a after warmup (mean n/a), final loss 3.0000 vs 3.0000: FAIL "
            "(threshold 0.25%): no step after warmup (step 5) to compare");
  const YAML::Node j = YAML::Load(parity_json(r));
  EXPECT_EQ(j["runs"].size(), 2u);
  EXPECT_EQ(j["steps"].size(), 2u);
  EXPECT_NEAR(j["steps"][1]["ema"]["fp8_flow"].as<double>(), 0.9 * 4 + 0.1 * 3, 1e-9);
  EXPECT_TRUE(j["candidates"][0]["max_rel_err"].IsNull());
  EXPECT_EQ(j["candidates"][0]["verdict"].as<std::string>(), "fail");
}

TEST(Parity, FirstChangedKeyNamesTheKeyAndBothValues) {
  const Config earlier = parse_config("train:\n  steps: 200\n", "a.yaml");
  Config now = earlier;
  EXPECT_EQ(first_changed_key(to_yaml(earlier), to_yaml(now)), "");
  now.file = "./a.yaml";  // only the header comment names the file
  EXPECT_EQ(first_changed_key(to_yaml(earlier), to_yaml(now)), "");
  now.train.steps = 300;
  now.optimizer.lr = 0.002;
  EXPECT_EQ(first_changed_key(to_yaml(earlier), to_yaml(now)), "train.steps: 200 in the earlier run, 300 now");
  now.train.steps = 200;
  EXPECT_EQ(first_changed_key(to_yaml(earlier), to_yaml(now)), "optimizer.lr: 0.003 in the earlier run, 0.002 now");
  now = earlier;
  now.train.recompute = "moe_expert";
  now.checkpoint.resume = "true";
  EXPECT_EQ(first_changed_key(to_yaml(earlier), to_yaml(now), {"checkpoint.resume"}),
            "train.recompute: [] in the earlier run, [moe_expert] now");
  now.train.recompute.clear();
  EXPECT_EQ(first_changed_key(to_yaml(earlier), to_yaml(now), {"checkpoint.resume"}), "");
  EXPECT_EQ(first_changed_key("train:\n  steps: 200\n  seed: 1\n", "train:\n  steps: 200\n"),
            "train.seed: 1 in the earlier run, (absent) now");
  EXPECT_EQ(first_changed_key("data:\n  path: \"\"\n", "data:\n  path: \"x.bin\"\n"),
            "data.path: \"\" in the earlier run, x.bin now");
  EXPECT_THROW(first_changed_key("train: [", to_yaml(now)), ConfigError);
}

// ---- the command ---------------------------------------------------------------------------------

namespace {

struct Ran {
  int exit_code = -1;
  std::string out;
};

// `env` (NAME=value ...) goes before the command.
Ran run_parity(const fs::path& dir, const std::string& args, const std::string& env = "") {
  const fs::path log = dir / "out.txt";
  const std::string cmd = env + " " + std::string(FLOWMOE_BINARY_DIR) + "/flowmoe parity --config " +
                          FLOWMOE_SOURCE_DIR + "/configs/tiny_moe.yaml --out " + (dir / "parity").string() +
                          " --steps 6 --warmup-steps 2 --set train.device=cpu --set train.eval_every=0"
                          " --set data.seq_len=32 --set data.synthetic_tokens=20000 --set train.batch_size=4"
                          " --set optimizer.warmup_steps=2 --set logging.progress=plain " +
                          args + " >" + log.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  Ran r;
  if (status != -1 && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  std::ifstream in(log);
  std::stringstream ss;
  ss << in.rdbuf();
  r.out = ss.str();
  return r;
}

}  // namespace

TEST(ParityCommand, ThreeRecipesThenAResumeThatKeepsThemAndAZeroThreshold) {
  const fs::path d = fresh_dir("parity_cmd");
  const Ran first = run_parity(d, "--threshold 1");
  ASSERT_EQ(first.exit_code, 0) << first.out;
  const YAML::Node j = YAML::LoadFile((d / "parity" / "parity.json").string());
  ASSERT_EQ(j["runs"].size(), 3u);
  EXPECT_EQ(j["runs"][0]["name"].as<std::string>(), "bf16");
  EXPECT_EQ(j["runs"][2]["name"].as<std::string>(), "fp8_flow");
  EXPECT_EQ(j["steps"].size(), 6u);
  ASSERT_EQ(j["candidates"].size(), 2u);
  EXPECT_TRUE(j["pass"].as<bool>());
  EXPECT_EQ(j["candidates"][1]["compared_steps"].as<int>(), 4);
  EXPECT_NE(first.out.find("fp8_flow vs bf16: max EMA rel err"), std::string::npos) << first.out;
  EXPECT_EQ(fs::exists(d / "parity" / "parity.png"), first.out.find("parity.png:") == std::string::npos) << first.out;
  const fs::path metrics = d / "parity" / "fp8_flow" / "metrics.jsonl";
  const auto written = fs::last_write_time(metrics);

  // The finished runs are kept; with threshold 0 the FP8 curves fail wherever they differ from bf16's.
  // No plotter on the PATH: the report is written without its image.
  const Ran again = run_parity(d, "--threshold 0 --resume", "PATH=" + (d / "empty").string());
  EXPECT_NE(again.out.find("(no parity.png: neither gnuplot nor matplotlib is installed)"), std::string::npos)
      << again.out;
  EXPECT_FALSE(fs::exists(d / "parity" / "parity.png"));
  EXPECT_EQ(fs::last_write_time(metrics), written);
  EXPECT_NE(again.out.find("fp8_flow: kept the finished run"), std::string::npos) << again.out;
  EXPECT_EQ(again.out.find("parity: bf16: training"), std::string::npos) << again.out;
  const YAML::Node k = YAML::LoadFile((d / "parity" / "parity.json").string());
  const bool differ =
      k["candidates"][0]["max_rel_err"].as<double>() > 0 || k["candidates"][1]["max_rel_err"].as<double>() > 0;
  EXPECT_TRUE(differ);
  EXPECT_EQ(again.exit_code, differ ? 1 : 0) << again.out;
  fs::remove_all(d);
}

// Controls make the noise band: two data-order controls, the band and both verdicts in the JSON, the
// summary lines and the exit status, which follows the verdicts (0, 1 or 4: ParityReport::exit_status).
TEST(ParityCommand, ControlsMakeANoiseBandAndASecondVerdict) {
  const fs::path d = fresh_dir("parity_band_cmd");
  const Ran r = run_parity(d, "--recipes bf16,fp8_flow --controls 2 --steps 24 --margin 0.5");
  const YAML::Node j = YAML::LoadFile((d / "parity" / "parity.json").string());
  ASSERT_TRUE(j["noise_band"].IsMap()) << r.out;
  EXPECT_EQ(j["noise_band"]["controls"].as<int>(), 2);
  EXPECT_DOUBLE_EQ(j["noise_band"]["margin"].as<double>(), 0.5);
  EXPECT_GT(j["noise_band"]["control_mean_max"].as<double>(), 0.0);
  ASSERT_EQ(j["candidates"].size(), 3u);  // fp8_flow, control1, control2
  const YAML::Node fp8 = j["candidates"][0];
  EXPECT_EQ(fp8["name"].as<std::string>(), "fp8_flow");
  const std::string noise = fp8["noise_verdict"].as<std::string>();
  EXPECT_TRUE(noise == "within noise" || noise == "outside noise") << noise;
  EXPECT_TRUE(j["candidates"][1]["noise_verdict"].IsNull());  // a control is not judged
  EXPECT_EQ(j["runs"][3]["name"].as<std::string>(), "control2");
  EXPECT_TRUE(j["steps"][23]["band_upper"].IsScalar());
  // The data orders differ: the controls' data.seed is the reference's + 1 and + 2.
  const YAML::Node c2 = YAML::LoadFile((d / "parity" / "control2" / "config.yaml").string());
  const YAML::Node ref = YAML::LoadFile((d / "parity" / "bf16" / "config.yaml").string());
  EXPECT_EQ(c2["data"]["seed"].as<int64_t>(), ref["data"]["seed"].as<int64_t>() + 2);
  const bool within = noise == "within noise", pass = fp8["verdict"].as<std::string>() == "pass";
  EXPECT_EQ(r.exit_code, within ? (pass ? 0 : 4) : 1) << r.out;
  EXPECT_EQ(j["exit_status"].as<int>(), r.exit_code);
  EXPECT_NE(r.out.find(within ? "; within noise (mean error " : "; OUTSIDE noise (mean error "), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("the largest of 2 controls', margin 50%)"), std::string::npos) << r.out;
  fs::remove_all(d);
}

TEST(ParityCommand, UsageErrorsExitTwo) {
  const fs::path d = fresh_dir("parity_usage");
  EXPECT_EQ(run_parity(d, "--control noise").exit_code, 2);
  EXPECT_EQ(run_parity(d, "--controls 65").exit_code, 2);
  EXPECT_EQ(run_parity(d, "--margin -1").exit_code, 2);
  EXPECT_EQ(run_parity(d, "--recipes bf16").exit_code, 2);
  EXPECT_EQ(run_parity(d, "--ema-alpha 1").exit_code, 2);
  // A layout control compares expert with data parallelism: one process at expert-parallel size 1 has none.
  const Ran layout = run_parity(d, "--layout-control");
  EXPECT_EQ(layout.exit_code, 2);
  EXPECT_NE(layout.out.find("--layout-control compares expert parallelism with data parallelism"), std::string::npos)
      << layout.out;
  // A warmup past the last step leaves nothing to compare: refused before the first run trains.
  const Ran warmup = run_parity(d, "--warmup-steps 99999 --steps 5");
  EXPECT_EQ(warmup.exit_code, 2) << warmup.out;
  EXPECT_EQ(warmup.out,
            "flowmoe: error: parity: --warmup-steps 99999 leaves no step to compare: the verdicts read "
            "the steps after the warmup, so it must be below --steps 5; give a smaller --warmup-steps or "
            "more --steps\n");
  EXPECT_FALSE(fs::exists(d / "parity" / "bf16"));
  fs::remove_all(d);
}

// --candidate: a setting judged like a recipe against the same controls. The candidate trains the reference's
// recipe with its overrides (two for one NAME), or the recipe an override names; bad specs exit 2, naming it.
TEST(ParityCommand, CandidatesAreSettingsJudgedLikeRecipes) {
  const fs::path d = fresh_dir("parity_candidate");
  const Ran r = run_parity(d,
                           "--recipes bf16,fp8_flow --threshold 1 --candidate eps3:optimizer.eps=3e-8"
                           " --candidate eps3:optimizer.beta1=0.85 --candidate full:precision.recipe=fp8_full");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const YAML::Node j = YAML::LoadFile((d / "parity" / "parity.json").string());
  ASSERT_EQ(j["runs"].size(), 4u) << r.out;
  EXPECT_EQ(j["runs"][2]["name"].as<std::string>(), "eps3");
  EXPECT_EQ(j["runs"][2]["recipe"].as<std::string>(), "bf16");
  EXPECT_EQ(j["runs"][3]["name"].as<std::string>(), "full");
  EXPECT_EQ(j["runs"][3]["recipe"].as<std::string>(), "fp8_full");
  ASSERT_EQ(j["candidates"].size(), 3u);
  EXPECT_EQ(j["candidates"][1]["name"].as<std::string>(), "eps3");
  EXPECT_EQ(j["candidates"][1]["verdict"].as<std::string>(), "pass");
  const YAML::Node eps3 = YAML::LoadFile((d / "parity" / "eps3" / "config.yaml").string());
  EXPECT_DOUBLE_EQ(eps3["optimizer"]["eps"].as<double>(), 3e-8);
  EXPECT_DOUBLE_EQ(eps3["optimizer"]["beta1"].as<double>(), 0.85);
  EXPECT_EQ(eps3["precision"]["recipe"].as<std::string>(), "bf16");
  EXPECT_NE(r.out.find("eps3 vs bf16: max EMA rel err"), std::string::npos) << r.out;

  const fs::path e = fresh_dir("parity_candidate_usage");
  for (const char* bad : {"--candidate eps3", "--candidate :optimizer.eps=1", "--candidate a/b:optimizer.eps=1",
                          "--candidate control1:optimizer.eps=1", "--candidate fp8_flow:optimizer.eps=1"}) {
    const Ran u = run_parity(e, std::string("--recipes bf16,fp8_flow ") + bad);
    EXPECT_EQ(u.exit_code, 2) << bad << ": " << u.out;
    EXPECT_NE(u.out.find("parity: --candidate"), std::string::npos) << bad << ": " << u.out;
  }
  // An override of an unknown key is the config's error, before anything trains.
  const Ran unknown = run_parity(e, "--recipes bf16,fp8_flow --candidate x:optimizer.nope=1");
  EXPECT_EQ(unknown.exit_code, 2) << unknown.out;
  EXPECT_NE(unknown.out.find("optimizer.nope"), std::string::npos) << unknown.out;
  EXPECT_FALSE(fs::exists(e / "parity" / "bf16"));
  fs::remove_all(d);
  fs::remove_all(e);
}

// An interrupted run (its final checkpoint missing) is continued from its newest checkpoint; its
// config_hash in the report is the one it had when it trained from step 1.
TEST(ParityCommand, ResumeContinuesRunsThatStoppedEarlier) {
  const fs::path d = fresh_dir("parity_resume");
  const std::string args = " --recipes bf16,fp8_flow --threshold 1 --set checkpoint.every=3";
  ASSERT_EQ(run_parity(d, args).exit_code, 0);
  const std::string hash =
      YAML::LoadFile((d / "parity" / "parity.json").string())["runs"][1]["config_hash"].as<std::string>();
  fs::remove_all(d / "parity" / "fp8_flow" / "checkpoints" / "step_00000006");
  const Ran resumed = run_parity(d, args + " --resume");
  EXPECT_EQ(resumed.exit_code, 0) << resumed.out;
  EXPECT_NE(resumed.out.find("bf16: kept the finished run"), std::string::npos) << resumed.out;
  EXPECT_NE(resumed.out.find("resumed from " + (d / "parity" / "fp8_flow" / "checkpoints" / "step_00000003").string()),
            std::string::npos)
      << resumed.out;
  const YAML::Node j = YAML::LoadFile((d / "parity" / "parity.json").string());
  EXPECT_EQ(j["steps"].size(), 6u);
  EXPECT_EQ(j["runs"][1]["config_hash"].as<std::string>(), hash);
  fs::remove_all(d);
}

// --resume over runs made with another config (another --steps or --set), finished or interrupted,
// is refused before anything trains, naming the run and the first key that differs; the same config,
// under another spelling of --out, still keeps the runs.
TEST(ParityCommand, ResumeRefusesRunsMadeWithAnotherConfig) {
  const fs::path d = fresh_dir("parity_other_config");
  const std::string args = " --recipes bf16,fp8_flow --threshold 1 --set checkpoint.every=3";
  ASSERT_EQ(run_parity(d, args).exit_code, 0);
  const fs::path metrics = d / "parity" / "bf16" / "metrics.jsonl";
  const auto written = fs::last_write_time(metrics);
  const std::string how = "; give a new --out folder, or run without --resume to train every run again\n";

  Ran r = run_parity(d, args + " --resume --steps 8");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_EQ(r.out, "flowmoe: error: parity: --resume: the bf16 run in " + (d / "parity" / "bf16").string() +
                       " was made with another config (train.steps: 6 in the earlier run, 8 now)" + how);
  r = run_parity(d, args + " --resume --set train.batch_size=8");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("(train.batch_size: 4 in the earlier run, 8 now)"), std::string::npos) << r.out;

  // An interrupted run is checked too: put first, it is the one named.
  fs::remove_all(d / "parity" / "fp8_flow" / "checkpoints" / "step_00000006");
  r = run_parity(d, " --recipes fp8_flow,bf16 --threshold 1 --set checkpoint.every=3 --resume --set train.seed=7");
  EXPECT_EQ(r.exit_code, 2) << r.out;
  EXPECT_NE(r.out.find("the fp8_flow run in " + (d / "parity" / "fp8_flow").string() +
                       " was made with another config (train.seed: 42 in the earlier run, 7 now)"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(fs::last_write_time(metrics), written);
  EXPECT_FALSE(fs::exists(d / "parity" / "fp8_flow" / "checkpoints" / "step_00000006"));

  r = run_parity(d, args + " --resume --out " + (d / "." / "parity").string());
  EXPECT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("bf16: kept the finished run"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("fp8_flow: training"), std::string::npos) << r.out;
  EXPECT_EQ(fs::last_write_time(metrics), written);
  fs::remove_all(d);
}
