// train.cuda_graph over several ranks (train/step_graph.h, agree_on_capture): every rank replays the
// captured step or none does. The decision is made on the host side of the world, so it runs here on the
// CPU: each rank hands in its own capture's outcome, as StepGraph::step does after trying it, and rank 1's
// capture fails while the others' succeed.
#include <string>

#include "parallel/collectives.h"
#include "tests/mpi/comm_test_util.h"
#include "train/step_graph.h"

namespace flowmoe::test {
namespace {

// The decision on every rank, which must be the same.
::testing::AssertionResult agreed(GraphDecision here, GraphDecision want) {
  const std::vector<double> seen = all_reduce_values(test_world(), {double(here), -double(here)}, ReduceOp::max);
  if (seen[0] != -seen[1]) return ::testing::AssertionFailure() << "the ranks decided differently";
  if (here != want) return ::testing::AssertionFailure() << "decided " << int(here) << ", expected " << int(want);
  return ::testing::AssertionSuccess();
}

TEST(GraphAgreement, EveryRankReplaysWhenEveryRankCaptured) {
  Communicator& world = test_world();
  EXPECT_TRUE(agreed(agree_on_capture(world, true, false), GraphDecision::replay));
  EXPECT_TRUE(agreed(agree_on_capture(world, true, true), GraphDecision::replay));
}

// Rank 1's capture fails, every other rank's succeeds: under auto every rank runs eagerly, under on every
// rank stops (none replays a graph whose collectives its peer never joins).
TEST(GraphAgreement, OneRankFailingSendsEveryRankEager) {
  Communicator& world = test_world();
  if (world.size() < 2) GTEST_SKIP() << "one rank: nothing to agree with";
  const bool captured = world.rank() != 1;
  EXPECT_TRUE(agreed(agree_on_capture(world, captured, false), GraphDecision::eager)) << "rank " << world.rank();
  EXPECT_TRUE(agreed(agree_on_capture(world, captured, true), GraphDecision::abort)) << "rank " << world.rank();
}

TEST(GraphAgreement, EveryRankFailingSendsEveryRankEager) {
  Communicator& world = test_world();
  EXPECT_TRUE(agreed(agree_on_capture(world, false, false), GraphDecision::eager));
  EXPECT_TRUE(agreed(agree_on_capture(world, false, true), GraphDecision::abort));
}

// The logical AND under it, for every single rank that says no.
TEST(GraphAgreement, OnEveryRankIsALogicalAnd) {
  Communicator& world = test_world();
  EXPECT_TRUE(on_every_rank(world, true));
  for (int no = 0; no < world.size(); ++no) EXPECT_FALSE(on_every_rank(world, world.rank() != no)) << "rank " << no;
}

}  // namespace
}  // namespace flowmoe::test
