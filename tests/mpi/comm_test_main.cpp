// The test_comm main: makes the world as a training run does (init_distributed: backend none without
// a launcher, mpi under mpirun), then runs the tests. Rank 0 prints GoogleTest's full report; the
// other ranks print only their failures, each line prefixed with the rank, so a 4-process log stays
// readable and still says which rank saw what.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "tests/mpi/comm_test_util.h"

namespace flowmoe::test {

namespace {
DistributedRuntime g_runtime;

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // The name is kept here: UnitTest::current_test_info() would wait on the lock GoogleTest holds
  // while it reports a result.
  void OnTestStart(const ::testing::TestInfo& t) override { test_ = std::string(t.test_suite_name()) + "." + t.name(); }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILED %s at %s:%d\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }

 private:
  int rank_;
  std::string test_;
};
}  // namespace

DistributedRuntime& test_runtime() { return g_runtime; }

}  // namespace flowmoe::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  try {
    flowmoe::test::g_runtime = flowmoe::init_distributed();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_comm: could not start: %s\n", e.what());
    return 1;
  }
  const int rank = flowmoe::test::g_runtime.world->rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new flowmoe::test::RankFailurePrinter(rank));
  }
  std::printf("test_comm: rank %d of %d, backend %s\n", rank, flowmoe::test::g_runtime.world->size(),
              flowmoe::test::g_runtime.world->backend_name());
  int status = RUN_ALL_TESTS();
  flowmoe::test::g_runtime = {};  // free the communicators before MPI is finalized at exit
  return status;
}
