// The comm lane (engine/stream_lane.h) and the backward walk's order (engine/autograd.cpp): tickets, waits, and
// nodes marked backward_first running as soon as they are ready, before later-recorded ones. The lane's
// streams run on a GPU in tests/mpi/test_exchange_chunks.cpp (the chunked MoE layer, bit for bit).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/ops/ops.h"
#include "engine/stream_lane.h"
#include "tests/support/checks.h"

namespace flowmoe::test {
namespace {

// y = x, recording its name when its vjp runs; `first` marks it backward_first; `issue` puts its vjp
// on the comm lane (a ticket on the CPU).
class Traced : public Primitive {
 public:
  Traced(std::string name, std::vector<std::string>* log, bool first, bool issue)
      : name_(std::move(name)), log_(log), first_(first), issue_(issue) {}
  const char* name() const override { return name_.c_str(); }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override { return {in[0]}; }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return {in[0]}; }
  bool saves_inputs() const override { return false; }
  bool backward_first() const override { return first_; }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d,
                          const std::vector<bool>&) override {
    log_->push_back(name_);
    if (!issue_) return {d[0]};
    Tensor out = d[0].clone();
    issue_on_comm_lane(out.device(), {d[0], out}, [] {});
    return {out};
  }

 private:
  std::string name_;
  std::vector<std::string>* log_;
  bool first_, issue_;
};

Variable traced(const Variable& x, const std::string& name, std::vector<std::string>* log, bool first = false,
                bool issue = false) {
  return apply(std::make_shared<Traced>(name, log, first, issue), {x})[0];
}

TEST(BackwardOrder, TheLastRecordedReadyNodeRunsFirst) {
  std::vector<std::string> log;
  Variable x(Tensor::full({2}, 1.0, DType::f32), true);
  Variable a = traced(x, "a", &log), b = traced(x, "b", &log), c = traced(add(a, b), "c", &log);
  sum(c).backward();
  EXPECT_EQ(log, (std::vector<std::string>{"c", "b", "a"}));
}

TEST(BackwardOrder, BackwardFirstNodesRunAsSoonAsTheyAreReady) {
  std::vector<std::string> log;
  Variable x(Tensor::full({2}, 1.0, DType::f32), true);
  Variable a = traced(traced(x, "a1", &log, true), "a2", &log, true);
  Variable b = traced(traced(x, "b1", &log), "b2", &log);
  Variable s;
  {
    BackwardFirstGuard first;  // as a side branch marks the shared experts
    s = traced(x, "s", &log);
  }
  sum(add(add(a, b), s)).backward();
  // s and a2 are ready at once and marked (s recorded last); a1 follows a2; then b2, b1 in reverse order.
  EXPECT_EQ(log, (std::vector<std::string>{"s", "a2", "a1", "b2", "b1"}));
  EXPECT_EQ(x.grad().to_floats(), (std::vector<float>{3, 3}));
}

TEST(CommLane, TicketsCountIssuesAndWaitsPassOnTheCpu) {
  const Device cpu = Device::cpu();
  const uint64_t before = comm_lane_last_ticket(cpu);
  bool ran = false;
  EXPECT_EQ(issue_on_comm_lane(cpu, {}, [&] { ran = true; }), before + 1);
  EXPECT_TRUE(ran) << "the launches run at once";
  issue_on_comm_lane(cpu, {}, [] {});
  EXPECT_EQ(comm_lane_last_ticket(cpu), before + 2);
  comm_lane_wait(cpu, before + 1);
  comm_lane_join(cpu);
  EXPECT_TRUE(throws_naming<Error>([&] { comm_lane_wait(cpu, before + 99); }, {"never issued"}));
  EXPECT_FALSE(comm_lane_on());
  {
    LaneScope lane(Lane::comm, cpu, false);
    EXPECT_TRUE(comm_lane_on());
    EXPECT_FALSE(comm_lane_streams());
  }
  EXPECT_FALSE(comm_lane_on());
  EXPECT_TRUE(comm_lane_streams());
}

// A gradient an issue wrote is summed with one the compute stream wrote: the walk waits for the issue first
// (on the CPU the wait passes; the sum and the order are what is checked).
TEST(CommLane, GradientsFromTheLaneAreSummedAfterTheirIssue) {
  std::vector<std::string> log;
  Variable x(Tensor::full({3}, 2.0, DType::f32), true);
  const uint64_t before = comm_lane_last_ticket(Device::cpu());
  Variable moved = traced(x, "moved", &log, true, true), kept = traced(scale(x, 2.0), "kept", &log);
  sum(add(moved, kept)).backward();
  EXPECT_EQ(log, (std::vector<std::string>{"moved", "kept"}));
  EXPECT_EQ(comm_lane_last_ticket(Device::cpu()), before + 1);
  EXPECT_EQ(x.grad().to_floats(), (std::vector<float>{3, 3, 3}));
}

}  // namespace
}  // namespace flowmoe::test
