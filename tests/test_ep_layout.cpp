// The expert-parallel exchange layout computed from all-gathered counts (kernels/ep_layout.h, the
// zero-sync dispatch's plan) against the host plan make_exchange_plan builds from the same counts
// (parallel/exchange.h): every rank's segments and both row tables, on random counts with empty
// experts, empty ranks and everything on one expert; then the CUDA kernel against the CPU reference.
#include <algorithm>
#include <random>

#include "kernels/ep_layout.h"
#include "parallel/exchange.h"
#include "tests/support/checks.h"

namespace flowmoe::test {
namespace {

// A communicator that is only a size and a rank: make_exchange_plan reads nothing else.
class ShapeOnlyComm final : public Communicator {
 public:
  ShapeOnlyComm(int rank, int size) : rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* backend_name() const override { return "shape-only"; }
  Device native_device() const override { return Device::cpu(); }

 protected:
  [[noreturn]] static void refuse() { FLOWMOE_THROW(CommError, "ShapeOnlyComm moves nothing"); }
  void do_all_to_all(const Tensor&, const std::vector<int64_t>&, const Tensor&, const std::vector<int64_t>&,
                     size_t) override {
    refuse();
  }
  void do_all_to_all_chunks(const Tensor&, const std::vector<RowChunk>&, const Tensor&, const std::vector<RowChunk>&,
                            size_t) override {
    refuse();
  }
  void do_all_reduce(const Tensor&, ReduceOp) override { refuse(); }
  void do_all_gather(const Tensor&, const Tensor&, size_t) override { refuse(); }
  void do_reduce_scatter_in_place(const Tensor&, ReduceOp) override { refuse(); }
  void do_all_gather_in_place(const Tensor&, size_t) override { refuse(); }
  void do_broadcast(const Tensor&, int) override { refuse(); }
  void do_barrier() override { refuse(); }
  std::shared_ptr<Communicator> do_split(int, int, int) override { refuse(); }

 private:
  int rank_, size_;
};

struct Case {
  int n, L, align;
  std::vector<int32_t> counts;  // [n, n·L]
};

std::vector<Case> cases(uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<Case> out;
  for (int n : {1, 2, 3, 4, 8})
    for (int L : {1, 3, 8})
      for (int align : {16, 128})
        for (int kind = 0; kind < 3; ++kind) {
          Case c{n, L, align, std::vector<int32_t>(size_t(n) * n * L, 0)};
          for (size_t i = 0; i < c.counts.size(); ++i) {
            const int p = int(i / size_t(n * L));
            const bool empty = (kind == 1 && p == n - 1) || gen() % 4 == 0;  // kind 1: the last rank sends nothing
            c.counts[i] = empty ? 0 : int32_t(gen() % 40);
          }
          if (kind == 2)  // every copy to global expert n·L - 1
            for (size_t i = 0; i < c.counts.size(); ++i) c.counts[i] = i % size_t(n * L) == size_t(n * L - 1) ? 37 : 0;
          out.push_back(c);
        }
  return out;
}

std::vector<int64_t> row(const Case& c, int p) {
  const int E = c.n * c.L;
  return std::vector<int64_t>(c.counts.begin() + p * E, c.counts.begin() + (p + 1) * E);
}

ExchangePlan host_plan(const Case& c, int me) {
  std::vector<int64_t> recv;
  for (int p = 0; p < c.n; ++p)
    for (int e = 0; e < c.L; ++e) recv.push_back(c.counts[size_t(p * c.n * c.L + me * c.L + e)]);
  return make_exchange_plan(std::make_shared<ShapeOnlyComm>(me, c.n), row(c, me), recv, 16, 0, c.align, 1);
}

std::vector<int32_t> layout_cpu(const Case& c, int me, int64_t capacity = 0, int32_t* most_needed = nullptr) {
  std::vector<int32_t> out(size_t(ep_layout_size(c.n, c.L)), -7);
  ep_layout_cpu({c.n, c.L, me, 16, c.align, capacity}, c.counts.data(), out.data(), most_needed);
  return out;
}

// The most padded rows any rank of c receives: the host plans' padded totals.
int64_t most_rows(const Case& c) {
  int64_t need = 0;
  for (int r = 0; r < c.n; ++r) need = std::max(need, host_plan(c, r).segment_starts.back());
  return need;
}

TEST(EpLayout, EqualsTheHostPlanOnEveryRank) {
  for (const Case& c : cases(test_seed())) {
    std::vector<ExchangePlan> plans;
    for (int r = 0; r < c.n; ++r) plans.push_back(host_plan(c, r));
    for (int me = 0; me < c.n; ++me) {
      SCOPED_TRACE("n " + std::to_string(c.n) + ", L " + std::to_string(c.L) + ", align " + std::to_string(c.align) +
                   ", rank " + std::to_string(me));
      const std::vector<int32_t> got = layout_cpu(c, me);
      const ExchangePlan& p = plans[size_t(me)];
      // Rank r's sorted segment for global expert g: where its permute_pad (align 16) put g's copies.
      const auto sorted_start = [&](int r, size_t g) { return padded_segment_starts(row(c, r), 16)[g]; };
      auto at = [&](int64_t offset, int64_t count) {
        return std::vector<int64_t>(got.begin() + offset, got.begin() + offset + count);
      };
      EXPECT_EQ(at(0, c.L), p.tokens_per_expert);
      EXPECT_EQ(at(ep_layout_padded_offset(c.n, c.L), c.L), p.padded_tokens_per_expert);
      EXPECT_EQ(at(ep_layout_starts_offset(c.n, c.L), c.L + 1), p.segment_starts);
      for (int q = 0; q < c.n; ++q)
        for (int e = 0; e < c.L; ++e) {
          const size_t i = size_t(q * c.L + e);
          const auto out = at(ep_layout_to_experts_offset(c.n, c.L) + 3 * int64_t(i), 3);
          const std::vector<int64_t> want_out = {
              sorted_start(me, i), plans[size_t(q)].padded_chunks[size_t(me * c.L + e)].offset, row(c, me)[i]};
          EXPECT_EQ(out, want_out) << "to_experts: peer " << q << ", its expert " << e;
          const auto back = at(ep_layout_to_tokens_offset(c.n, c.L) + 3 * int64_t(i), 3);
          const std::vector<int64_t> want_back = {p.padded_chunks[i].offset, sorted_start(q, size_t(me * c.L + e)),
                                                  p.padded_chunks[i].rows};
          EXPECT_EQ(back, want_back) << "to_tokens: peer " << q << ", my expert " << e;
        }
    }
  }
}

// Receive buffers of `capacity` rows: a layout that fits is the unbounded one; one row short, every rank lays
// out an empty exchange (every count and row 0) and reports the need, which also raises the running maximum.
TEST(EpLayout, CapacityFitsOrEveryRankLaysOutAnEmptyExchange) {
  for (const Case& c : cases(test_seed() + 2)) {
    const int64_t need = most_rows(c);
    for (int me = 0; me < c.n; ++me) {
      SCOPED_TRACE("n " + std::to_string(c.n) + ", L " + std::to_string(c.L) + ", align " + std::to_string(c.align) +
                   ", rank " + std::to_string(me) + ", need " + std::to_string(need));
      int32_t most = 5;
      const std::vector<int32_t> fits = layout_cpu(c, me, need, &most);
      EXPECT_EQ(fits, layout_cpu(c, me)) << "a layout that fits its capacity exactly";
      EXPECT_EQ(fits[size_t(ep_layout_overflow_offset(c.n, c.L))], 0);
      EXPECT_EQ(most, 5) << "no overflow leaves the running maximum";
      if (need <= 1) continue;
      const std::vector<int32_t> over = layout_cpu(c, me, need - 1, &most);
      std::vector<int32_t> want(over.size(), 0);
      want[size_t(ep_layout_overflow_offset(c.n, c.L))] = int32_t(need);
      EXPECT_EQ(over, want) << "one row short";
      EXPECT_EQ(most, std::max<int32_t>(5, int32_t(need)));
    }
  }
}

// The zero-sync buffer's rows: the worst case n·T·min(k, L) + L·(align − 1); with a capacity factor F,
// ceil(F·T·k) + the pad rows, at least min_rows and at most the worst case; rounded up to row_multiple.
TEST(EpLayout, ZeroSyncRowsFollowTheCapacity) {
  const int64_t pad = 8 * 15, worst = 4 * 1000 * 6 + pad;  // 4 ranks, 1000 tokens, top-6 of 8 local experts
  EXPECT_EQ(zero_sync_padded_rows(4, 1000, 6, 8, 16, 1), worst);
  EXPECT_EQ(zero_sync_padded_rows(4, 1000, 6, 8, 16, 1, 1.25), 7500 + pad);
  EXPECT_EQ(zero_sync_padded_rows(4, 1000, 6, 8, 16, 16, 1.25), (7500 + pad + 15) / 16 * 16);
  EXPECT_EQ(zero_sync_padded_rows(4, 1000, 6, 8, 16, 1, 1.25, 9000), 9000) << "grown past the factor's rows";
  EXPECT_EQ(zero_sync_padded_rows(4, 1000, 6, 8, 16, 1, 9.0), worst) << "never past the worst case";
  EXPECT_EQ(zero_sync_padded_rows(4, 1000, 6, 8, 16, 1, 1.25, 1 << 30), worst);
  EXPECT_THROW(zero_sync_padded_rows(4, 1000, 6, 8, 16, 1, -1.0), ShapeError);
}

TEST(EpLayout, RefusesImpossibleDims) {
  std::vector<int32_t> counts(4, 0), out(64, 0);
  EXPECT_THROW(ep_layout_cpu({2, 1, 2, 16, 16}, counts.data(), out.data()), ShapeError);  // rank 2 of 2
  EXPECT_THROW(ep_layout_cpu({2, 0, 0, 16, 16}, counts.data(), out.data()), ShapeError);
  EXPECT_THROW(ep_layout_cpu({2, 1, 0, 16, 0}, counts.data(), out.data()), ShapeError);
  EXPECT_THROW(ep_layout_cpu({2, 1, 0, 16, 16, -1}, counts.data(), out.data()), ShapeError);
}

TEST(EpLayout, CudaKernelEqualsTheCpuReference) {
  FLOWMOE_REQUIRE_CUDA();
  for (const Case& c : cases(test_seed() + 1))
    for (int me = 0; me < c.n; ++me) {
      const Tensor counts = Tensor::from_ints(std::vector<int64_t>(c.counts.begin(), c.counts.end()), {c.n, c.n * c.L},
                                              DType::i32, Device::cuda(0));
      // Unbounded, and one row short of the need (an empty exchange, the need in the running maximum).
      const int64_t need = most_rows(c);
      for (int64_t capacity : {int64_t(0), std::max<int64_t>(need - 1, 0)}) {
        Tensor out = Tensor::full({ep_layout_size(c.n, c.L)}, -7, DType::i32, Device::cuda(0));
        Tensor most = Tensor::full({1}, 5, DType::i32, Device::cuda(0));
        ep_layout_cuda({c.n, c.L, me, 16, c.align, capacity}, counts.data<int32_t>(), out.data<int32_t>(),
                       most.data<int32_t>(), current_stream(0));
        int32_t want_most = 5;
        const std::vector<int32_t> want = layout_cpu(c, me, capacity, &want_most);
        EXPECT_EQ(out.to_ints(), std::vector<int64_t>(want.begin(), want.end()))
            << "n " << c.n << ", L " << c.L << ", align " << c.align << ", rank " << me << ", capacity " << capacity;
        EXPECT_EQ(most.to_ints(), std::vector<int64_t>{want_most});
      }
    }
}

}  // namespace
}  // namespace flowmoe::test
