// Launching the built command and comparing runs (see train_launch.h).
#include "tests/mpi/train_launch.h"

#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <tuple>

namespace flowmoe::test {

namespace fs = std::filesystem;

const std::string kBinary = std::string(FLOWMOE_BINARY_DIR) + "/flowmoe";
const std::string kConfig = std::string(FLOWMOE_SOURCE_DIR) + "/configs/tiny_moe.yaml";

void PrintTo(const Recipe& r, std::ostream* os) { *os << r.name; }

const Recipe kRecipes[4] = {
    {"bf16", "--set precision.recipe=bf16 --set train.grad_accum_steps=2 --set model.aux_loss_alpha=0.01", kF32Rel,
     false},
    {"fp8_blockwise", "--set precision.recipe=fp8_blockwise", kFp8Rel, true},
    {"fp8_flow", "--set precision.recipe=fp8_flow", kFp8Rel, true},
    {"fp8_full", "--set precision.recipe=fp8_full", kFp8Rel, true},
};

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

size_t lines_starting(const std::string& text, const std::string& prefix) {
  std::istringstream in(text);
  size_t n = 0;
  for (std::string line; std::getline(in, line);) n += line.rfind(prefix, 0) == 0;
  return n;
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / ("flowmoe_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

Launch run_shell(const fs::path& dir, const std::string& command, int limit_s) {
  static int counter = 0;
  const fs::path out = dir / ("out_" + std::to_string(counter) + ".txt");
  const fs::path err = dir / ("err_" + std::to_string(counter++) + ".txt");
  const std::string line = "cd '" + dir.string() +
                           "' && env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"
                           " OMPI_MCA_btl_vader_single_copy_mechanism=none timeout -k 10 " +
                           std::to_string(limit_s) + " " + command + " > '" + out.string() + "' 2> '" + err.string() +
                           "'";
  const int raw = std::system(line.c_str());
  Launch r;
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

std::string launcher(int np) {
  if (np == 0) return "";
  return std::string(FLOWMOE_MPIEXEC) + " " + FLOWMOE_MPIEXEC_NUMPROC_FLAG + " " + std::to_string(np) + " " +
         FLOWMOE_MPIEXEC_FLAGS + " ";
}

std::string train_args(const fs::path& out, const std::string& extra) {
  return "train --config " + kConfig +
         " --set train.device=cpu --set train.steps=20 --set data.seq_len=64 --set data.synthetic_tokens=200000"
         " --set optimizer.warmup_steps=5 --set train.eval_every=10 --set checkpoint.every=10"
         " --set logging.progress=plain --set logging.log_every=1 --set logging.out_dir=" +
         out.string() + " " + extra;
}

std::vector<StepMetrics> train_run(const fs::path& dir, int np, const std::string& name, const std::string& extra,
                                   Launch* launch) {
  const Launch r = run_shell(dir, launcher(np) + kBinary + " " + train_args(dir / name, extra));
  EXPECT_EQ(r.status, 0) << name << ":\n" << r.out << r.err;
  if (launch) *launch = r;
  if (r.status != 0) return {};
  return read_metrics((dir / name / "metrics.jsonl").string());
}

double printed_val_loss(const std::string& out) {
  const size_t at = out.find("val loss ");
  return at == std::string::npos ? NAN : std::atof(out.substr(at + 9).c_str());
}

std::vector<StepMetrics> train_and_compare(const fs::path& dir, const std::vector<StepMetrics>& ref, int np,
                                           const std::string& name, const std::string& extra, double rel_tol,
                                           Launch* launch) {
  const std::vector<StepMetrics> got = train_run(dir, np, name, extra, launch);
  EXPECT_EQ(got.size(), 20u) << name;
  if (got.empty()) return got;
  compare(ref, got, rel_tol, name + " vs one process");
  EXPECT_EQ(count(launch->out, "done: step 20/20"), 1u) << launch->out;
  EXPECT_EQ(count(launch->out, "step 10: val loss"), 1u) << launch->out;
  return got;
}

void resume_and_compare(const fs::path& dir, const std::vector<StepMetrics>& ref, const std::string& from, int np,
                        const std::string& name, const std::string& extra) {
  const std::vector<StepMetrics> got =
      train_run(dir, np, name, extra + " --resume " + (dir / from / "checkpoints" / "step_00000010").string());
  ASSERT_EQ(got.size(), 10u) << name;
  EXPECT_EQ(got.front().step, 11) << name;
  compare(ref, got, kF32Rel, name + ": saved by " + from + ", resumed, vs " + from);
}

void expect_same_eval(const fs::path& dir, const std::string& run, int np, const std::string& extra,
                      const std::string& extra_np) {
  const std::string eval = "eval --config " + kConfig + " --set train.device=cpu --set data.seq_len=64" +
                           " --set data.synthetic_tokens=200000 --checkpoint " +
                           (dir / run / "checkpoints" / "step_00000020").string() + " " + extra;
  const Launch one = run_shell(dir, kBinary + " " + eval),
               many = run_shell(dir, launcher(np) + kBinary + " " + eval + extra_np);
  ASSERT_EQ(one.status, 0) << one.err;
  ASSERT_EQ(many.status, 0) << many.err;
  EXPECT_EQ(count(many.out, "val loss"), 1u) << many.out;  // rank 0 alone prints
  EXPECT_NEAR(printed_val_loss(one.out), printed_val_loss(many.out), 1.5e-4) << one.out << many.out;
}

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

}  // namespace flowmoe::test
