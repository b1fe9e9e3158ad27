// Expert-parallel training through the built command, as a user launches it: `mpirun -np N flowmoe
// train --set parallel.expert_parallel_size=E` against the plain single-process run on the same global
// batch, and the start-up errors of a size that does not fit the launch, which every rank must report
// without leaving a peer waiting.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tests/mpi/train_launch.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

std::string ep(int size) { return " --set parallel.expert_parallel_size=" + std::to_string(size); }

// Every one of the np ranks stops at start-up with `message` as its one error line, exit status 2.
void expect_error_on_every_rank(const Launch& r, int np, const std::string& message) {
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_EQ(count(r.err, message), size_t(np)) << r.err;
  EXPECT_EQ(lines_starting(r.err, "flowmoe: error: "), 1u) << r.err;
  for (int rank = 1; rank < np; ++rank)
    EXPECT_EQ(lines_starting(r.err, "[rank " + std::to_string(rank) + "] flowmoe: error: "), 1u) << r.err;
}

}  // namespace

TEST(ExpertParallelErrors, SizesThatDoNotFitTheLaunchFailOnEveryRank) {
  const fs::path d = fresh_dir("ep_errors");
  // Every rank checks before any collective, so the run ends at once (the time limit would say 124).
  const Launch ranks = run_shell(d, launcher(4) + kBinary + " " + train_args(d / "run", ep(3)), 120);
  expect_error_on_every_rank(
      ranks, 4, "--set parallel.expert_parallel_size=3: parallel.expert_parallel_size: 3 does not divide the 4 ranks");
  const Launch experts =
      run_shell(d, launcher(4) + kBinary + " " + train_args(d / "run", ep(4) + " --set model.n_routed_experts=6"), 120);
  expect_error_on_every_rank(experts, 4, "parallel.expert_parallel_size: 4 does not divide model.n_routed_experts 6");
  const Launch alone = run_shell(d, kBinary + " " + train_args(d / "run", ep(2)), 60);
  expect_error_on_every_rank(alone, 1, "parallel.expert_parallel_size: 2 does not divide the 1 ranks");
  // A dense model has no experts to share out: the config itself is refused, on every rank.
  const Launch dense =
      run_shell(d, launcher(2) + kBinary + " " + train_args(d / "run", ep(2) + " --set model.n_routed_experts=0"), 120);
  EXPECT_NE(dense.status, 0);
  EXPECT_NE(dense.status, 124) << "the ranks hung";
  EXPECT_EQ(count(dense.err,
                  "--set parallel.expert_parallel_size=2: parallel.expert_parallel_size: 2 needs routed "
                  "experts to share out over the ranks, but model.n_routed_experts (--set "
                  "model.n_routed_experts=0) is 0"),
            2u)
      << dense.err;
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl"));
  fs::remove_all(d);
}
