// Data-parallel training through the built command, as a user launches it: `mpirun -np N flowmoe
// train` against the plain single-process run on the same global batch, for each recipe; resume
// across world sizes; and the start-up errors every rank must report without leaving a peer waiting.
// configs/tiny_moe.yaml is made small by --set (sequences of 64 tokens, 20 steps).
//
// Tolerance. The ranks sum their gradients in another order than one process sums them over the
// batch (and the GEMMs block a smaller batch differently), so the bits differ; nothing else may:
//  - step 1's loss is a forward on the same weights, only its sums are ordered otherwise: rel 1e-6.
//  - bf16 (f32 on the CPU): every loss within rel 2e-5. One f32 rounding is 6e-8 relative; a sum of
//    n terms taken in another order moves by about sqrt(n) of them, and 20 AdamW steps carry that
//    along without growing it much (measured: at most 3e-7).
//  - fp8_blockwise, fp8_flow: within rel 5e-3. A rank's forward sees B/N sequences, so the 1x128
//    column blocks that scale its wgrad operands hold other tokens than one forward of B; and an f32
//    ulp in a weight can move a value across an e4m3 rounding boundary (3 mantissa bits: a step of
//    6-12% of it), which later steps carry on. Both are the FP8 recipes' own noise (fp8_flow costs up
//    to 0.5% of loss against bf16, docs/PERF.md); measured: 1.2e-3. That this is all of it is checked
//    exactly: 2 ranks equal one process that runs the batch as 2 micro-batches of B/2, bit for bit
//    (the same forwards, and a + b summed once either way).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "train/metrics.h"

using namespace flowmoe;
namespace fs = std::filesystem;

namespace {

const std::string kBinary = std::string(FLOWMOE_BINARY_DIR) + "/flowmoe";
const std::string kConfig = std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny_moe.yaml";
constexpr double kFirstStepRel = 1e-6, kF32Rel = 2e-5, kFp8Rel = 5e-3;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + 1)) ++n;
  return n;
}

// Lines of text that start with `prefix`.
size_t lines_starting(const std::string& text, const std::string& prefix) {
  std::istringstream in(text);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) n += line.rfind(prefix, 0) == 0;
  return n;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("flowmoe_dp_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

struct Launch {
  int status = -1;  // the exit status; 124: killed at the time limit
  std::string out, err;
};

// Runs `command` in dir under a time limit, with the Open MPI settings a container and root need.
Launch run_shell(const fs::path& dir, const std::string& command, int limit_s = 240) {
  static int counter = 0;
  const fs::path out = dir / ("out_" + std::to_string(counter) + ".txt");
  const fs::path err = dir / ("err_" + std::to_string(counter++) + ".txt");
  const std::string line = "cd '" + dir.string() +
                           "' && env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
                           " OMPI_MCA_btl_vader_single_copy_mechanism=none timeout -k 10 " +
                           std::to_string(limit_s) + " " + command + " > '" + out.string() + "' 2> '" + err.string() + "'";
  const int raw = std::system(line.c_str());
  Launch r;
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

// "mpirun -n N --oversubscribe" (the flags CMake found for this MPI), or "" for a plain run.
std::string launcher(int np) {
  if (np == 0) return "";
  return std::string(FLOWMOE_MPIEXEC) + " " + FLOWMOE_MPIEXEC_NUMPROC_FLAG + " " + std::to_string(np) + " " +
         FLOWMOE_MPIEXEC_FLAGS + " ";
}

// The train arguments of a 20-step run writing to out, evaluating and saving at steps 10 and 20.
std::string train_args(const fs::path& out, const std::string& extra) {
  return "train --config " + kConfig +
         " --set train.device=cpu --set train.steps=20 --set data.seq_len=64 --set data.synthetic_tokens=200000"
         " --set optimizer.warmup_steps=5 --set train.eval_every=10 --set checkpoint.every=10"
         " --set logging.progress=plain --set logging.log_every=1 --set logging.out_dir=" +
         out.string() + " " + extra;
}

// Trains with np processes (0: the plain command) and returns the metrics rows.
std::vector<StepMetrics> train_run(const fs::path& dir, int np, const std::string& name, const std::string& extra,
                                   Launch* launch = nullptr) {
  const Launch r = run_shell(dir, launcher(np) + kBinary + " " + train_args(dir / name, extra));
  EXPECT_EQ(r.status, 0) << name << ":\n" << r.out << r.err;
  if (launch) *launch = r;
  if (r.status != 0) return {};
  return read_metrics((dir / name / "metrics.jsonl").string());
}

struct Agreement {
  double max_abs = 0, max_rel = 0;
};

// Compares the rows of `got` with the reference's rows of the same steps: train and validation loss.
Agreement compare(const std::vector<StepMetrics>& ref, const std::vector<StepMetrics>& got, double rel_tol,
                  const std::string& what) {
  Agreement a;
  EXPECT_FALSE(got.empty()) << what;
  for (const StepMetrics& g : got) {
    const auto r = std::find_if(ref.begin(), ref.end(), [&](const StepMetrics& m) { return m.step == g.step; });
    if (r == ref.end()) {
      ADD_FAILURE() << what << ": step " << g.step << " is not in the reference";
      continue;
    }
    const double tol = r->step == 1 ? kFirstStepRel : rel_tol;
    for (const auto& [name, x, y] : {std::tuple{"loss", r->loss, g.loss}, {"val loss", r->val_loss, g.val_loss}}) {
      if (std::isnan(x) && std::isnan(y)) continue;
      const double d = std::fabs(x - y);
      a.max_abs = std::max(a.max_abs, d);
      a.max_rel = std::max(a.max_rel, d / std::fabs(x));
      EXPECT_LE(d, tol * std::fabs(x)) << what << ", step " << g.step << " " << name << ": " << x << " vs " << y;
    }
  }
  std::printf("%s: %zu steps, max abs %.3g, max rel %.3g\n", what.c_str(), got.size(), a.max_abs, a.max_rel);
  return a;
}

struct Recipe {
  const char* name;
  const char* sets;
  double rel_tol;
  bool one_micro_batch;  // grad_accum_steps 1: np2 is one process with 2 micro-batches of B/2, bit for bit
};

void PrintTo(const Recipe& r, std::ostream* os) { *os << r.name; }  // test names and messages, not bytes

class DataParallel : public ::testing::TestWithParam<Recipe> {};

// bf16 also accumulates two micro-batches and adds the balance loss: the means over ranks, micro-
// batches and tokens must still give the single process's gradient.
const Recipe kRecipes[] = {
    {"bf16", "--set precision.recipe=bf16 --set train.grad_accum_steps=2 --set model.aux_loss_alpha=0.01", kF32Rel,
     false},
    {"fp8_blockwise", "--set precision.recipe=fp8_blockwise", kFp8Rel, true},
    {"fp8_flow", "--set precision.recipe=fp8_flow", kFp8Rel, true},
};

}  // namespace

TEST_P(DataParallel, LossesMatchOneProcessOnTheSameGlobalBatch) {
  const Recipe& recipe = GetParam();
  const fs::path d = fresh_dir(std::string("losses_") + recipe.name);
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", recipe.sets);
  ASSERT_EQ(one.size(), 20u);
  for (int np : {2, 4}) {
    Launch launch;
    const std::vector<StepMetrics> many = train_run(d, np, "np" + std::to_string(np), recipe.sets, &launch);
    ASSERT_EQ(many.size(), 20u);
    compare(one, many, recipe.rel_tol, std::string(recipe.name) + " np" + std::to_string(np) + " vs one process");
    // Rank 0 alone prints: one start-up line about the ranks, one summary naming them.
    EXPECT_EQ(count(launch.out, "data-parallel: " + std::to_string(np) + " ranks (backend mpi), each reads " +
                                    std::to_string(8 / np) + " of every batch of 8 sequences"),
              1u)
        << launch.out;
    EXPECT_EQ(count(launch.out, "done: step 20/20"), 1u) << launch.out;
    EXPECT_EQ(count(launch.out, "(max over ranks) | " + std::to_string(np) + " ranks"), 1u) << launch.out;
    EXPECT_EQ(count(launch.out, "step 10: val loss"), 1u) << launch.out;
    if (np != 2 || !recipe.one_micro_batch) continue;
    const std::vector<StepMetrics> halves =
        train_run(d, 0, "np1_halves", std::string(recipe.sets) + " --set train.batch_size=4 --set train.grad_accum_steps=2");
    ASSERT_EQ(halves.size(), 20u);
    for (size_t i = 0; i < halves.size(); ++i)  // the validation batches differ in size: train losses only
      EXPECT_EQ(halves[i].loss, many[i].loss) << recipe.name << " step " << halves[i].step
                                              << ": np2 vs one process in 2 micro-batches of 4";
  }
  fs::remove_all(d);
}

INSTANTIATE_TEST_SUITE_P(Recipes, DataParallel, ::testing::ValuesIn(kRecipes),
                         [](const auto& info) { return std::string(info.param.name); });

// The checkpoint holds the global data position and the state every rank shares: a run saved by
// two processes continues under one, and the reverse, on the losses of the run that did not stop.
TEST(DataParallelResume, AcrossWorldSizesContinuesTheSameLosses) {
  const fs::path d = fresh_dir("resume");
  const std::string sets = kRecipes[0].sets;
  const std::vector<StepMetrics> one = train_run(d, 0, "np1", sets), two = train_run(d, 2, "np2", sets);
  ASSERT_EQ(one.size(), 20u);
  ASSERT_EQ(two.size(), 20u);
  const std::string step10 = "/checkpoints/step_00000010";
  const std::vector<StepMetrics> two_then_one =
      train_run(d, 0, "np2_np1", sets + " --resume " + (d / "np2").string() + step10);
  const std::vector<StepMetrics> one_then_two =
      train_run(d, 2, "np1_np2", sets + " --resume " + (d / "np1").string() + step10);
  ASSERT_EQ(two_then_one.size(), 10u);
  ASSERT_EQ(one_then_two.size(), 10u);
  EXPECT_EQ(two_then_one.front().step, 11);
  compare(two, two_then_one, kF32Rel, "saved by np2, resumed by np1, vs np2");
  compare(one, one_then_two, kF32Rel, "saved by np1, resumed by np2, vs np1");

  // eval of the same checkpoint: each rank evaluates its slice, the means agree.
  const std::string eval = "eval --config " + kConfig + " --set train.device=cpu --set data.seq_len=64" +
                           " --set data.synthetic_tokens=200000 --checkpoint " + (d / "np1").string() +
                           "/checkpoints/step_00000020";
  const Launch e1 = run_shell(d, kBinary + " " + eval), e2 = run_shell(d, launcher(2) + kBinary + " " + eval);
  ASSERT_EQ(e1.status, 0) << e1.err;
  ASSERT_EQ(e2.status, 0) << e2.err;
  EXPECT_EQ(count(e2.out, "val loss"), 1u) << e2.out;
  const auto val = [](const std::string& out) { return std::atof(out.substr(out.find("val loss ") + 9).c_str()); };
  EXPECT_NEAR(val(e1.out), val(e2.out), 1.5e-4) << e1.out << e2.out;
  fs::remove_all(d);
}

// Ranks given different configs all stop with the error (none waits in a collective for a peer).
TEST(DataParallelErrors, DifferentConfigsFailOnEveryRank) {
  const fs::path d = fresh_dir("mismatch");
  const std::string args = train_args(d / "run", "--set train.steps=4 --set optimizer.warmup_steps=1");
  const std::string mpmd = std::string(FLOWMOE_MPIEXEC) + " " + FLOWMOE_MPIEXEC_FLAGS + " " +
                           FLOWMOE_MPIEXEC_NUMPROC_FLAG + " 1 " + kBinary + " " + args + " : " +
                           FLOWMOE_MPIEXEC_NUMPROC_FLAG + " 1 " + kBinary + " " + args;
  // Both configs are valid: the ranks reach the check and disagree there.
  const Launch differ = run_shell(d, mpmd + " --set train.steps=5", 120);
  EXPECT_NE(differ.status, 0);
  EXPECT_NE(differ.status, 124) << "the ranks hung";
  const std::string message = "flowmoe: error: the ranks were given different configs (rank 0 hash ";
  EXPECT_EQ(lines_starting(differ.err, message), 1u) << differ.err;
  EXPECT_EQ(lines_starting(differ.err, "[rank 1] " + message), 1u) << differ.err;
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl"));

  // Rank 1's override is invalid: it fails before MPI starts, and its peer must not wait for it.
  const Launch broken = run_shell(d, mpmd + " --set train.steps=many", 120);
  EXPECT_NE(broken.status, 0);
  EXPECT_NE(broken.status, 124) << "rank 0 waited for rank 1 forever";
  EXPECT_EQ(lines_starting(broken.err, "[rank 1] flowmoe: error: --set train.steps=many"), 1u) << broken.err;
  fs::remove_all(d);
}

TEST(DataParallelErrors, BatchThatDoesNotSplitOverTheRanks) {
  const fs::path d = fresh_dir("indivisible");
  const Launch r = run_shell(d, launcher(3) + kBinary + " " + train_args(d / "run", ""), 120);
  EXPECT_EQ(r.status, 2) << r.err;
  const std::string message = "train.batch_size: 8 sequences do not split evenly over 3 processes";
  EXPECT_EQ(count(r.err, message), 3u) << r.err;  // every rank says it
  for (const char* who : {"flowmoe: error: ", "[rank 1] flowmoe: error: ", "[rank 2] flowmoe: error: "})
    EXPECT_EQ(lines_starting(r.err, who), 1u) << who << "\n" << r.err;
  fs::remove_all(d);
}
