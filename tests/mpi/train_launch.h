// Shared by the drivers that run the built `flowmoe` command under mpiexec (test_dp_train.cpp,
// test_ep_train.cpp): launching it as a user does, with a time limit, and comparing the metrics of
// two runs. configs/tiny_moe.yaml is made small by --set (sequences of 64 tokens, 20 steps).
#pragma once
#include <gtest/gtest.h>

#include <filesystem>
#include <ostream>
#include <string>
#include <vector>

#include "train/metrics.h"

namespace flowmoe::test {

extern const std::string kBinary;  // the built flowmoe command
extern const std::string kConfig;  // configs/tiny_moe.yaml
// The tolerances of a run against another on the same global batch (test_dp_train.cpp says why):
// step 1 (the same weights), f32 sums in another order, the FP8 recipes' own noise.
constexpr double kFirstStepRel = 1e-6, kF32Rel = 2e-5, kFp8Rel = 5e-3;

std::string read_text(const std::filesystem::path& p);
size_t count(const std::string& text, const std::string& part);
// Lines of text that start with `prefix`.
size_t lines_starting(const std::string& text, const std::string& prefix);
// An empty directory flowmoe_<name> under the temporary directory.
std::filesystem::path fresh_dir(const std::string& name);

struct Launch {
  int status = -1;  // the exit status; 124: killed at the time limit
  std::string out, err;
};
// Runs `command` in dir under a time limit, with the Open MPI settings a container and root need.
Launch run_shell(const std::filesystem::path& dir, const std::string& command, int limit_s = 240);
// "mpirun -n N --oversubscribe " (the flags CMake found for this MPI), or "" for a plain run (np 0).
std::string launcher(int np);
// The train arguments of a 20-step run writing to out, evaluating and saving at steps 10 and 20.
std::string train_args(const std::filesystem::path& out, const std::string& extra);
// Trains with np processes (0: the plain command) and returns the metrics rows.
std::vector<StepMetrics> train_run(const std::filesystem::path& dir, int np, const std::string& name,
                                   const std::string& extra, Launch* launch = nullptr);
// The validation loss an `flowmoe eval` printed.
double printed_val_loss(const std::string& out);

// Trains like train_run and compares the 20 steps with `ref` within rel_tol; rank 0 alone prints the
// summary and the evaluation at step 10. The launch's output is left in *launch.
std::vector<StepMetrics> train_and_compare(const std::filesystem::path& dir, const std::vector<StepMetrics>& ref,
                                           int np, const std::string& name, const std::string& extra, double rel_tol,
                                           Launch* launch);
// Resumes <dir>/<from>'s step-10 checkpoint with np processes, as run `name`, and compares its 10 steps
// with `ref` (the uninterrupted run) within kF32Rel.
void resume_and_compare(const std::filesystem::path& dir, const std::vector<StepMetrics>& ref, const std::string& from,
                        int np, const std::string& name, const std::string& extra);
// `flowmoe eval` of <dir>/<run>'s step-20 checkpoint by one process and by np (with extra_np): the
// printed validation losses agree to their printed digits. extra: for both.
void expect_same_eval(const std::filesystem::path& dir, const std::string& run, int np, const std::string& extra,
                      const std::string& extra_np);

// A precision recipe and the keys its runs set.
struct Recipe {
  const char* name;
  const char* sets;
  double rel_tol;
  bool one_micro_batch;  // grad_accum_steps 1: np2 is one process with 2 micro-batches of B/2, bit for bit
};
void PrintTo(const Recipe& r, std::ostream* os);  // test names and messages, not bytes
// bf16 also accumulates two micro-batches and adds the balance loss: the means over ranks, micro-
// batches and tokens must still give the single process's gradient.
extern const Recipe kRecipes[4];  // bf16, fp8_blockwise, fp8_flow, fp8_full

struct Agreement {
  double max_abs = 0, max_rel = 0;
};
// Compares the rows of `got` with the reference's rows of the same steps: train and validation loss,
// within rel_tol (kFirstStepRel at step 1). Prints the largest differences.
Agreement compare(const std::vector<StepMetrics>& ref, const std::vector<StepMetrics>& got, double rel_tol,
                  const std::string& what);

}  // namespace flowmoe::test
