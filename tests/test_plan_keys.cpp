// The cuBLASLt plan caches' host logic (kernels/plan_keys.h), on the CPU: operand alignment, the row-count
// buckets a new per-expert count borrows a heuristic answer from, linear's bucket key (which of m and k it
// buckets), and that every field of linear's key tells two plans apart, in == and in the hash.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "kernels/plan_keys.h"

using namespace flowmoe;

namespace {

LinearPlanKey base_key() {
  LinearPlanKey k{};
  k.m = 100, k.n = 256, k.k = 300, k.lda = 300, k.ldb = 300, k.ldc = 256;
  k.trans_a = false, k.trans_b = true, k.accumulate = false, k.has_bias = true;
  k.ab_dtype = DType::bf16, k.c_dtype = DType::f32;
  k.align_a = 16, k.align_b = 16, k.align_c = 16, k.align_bias = 16;
  return k;
}

}  // namespace

TEST(PlanKeys, AlignmentIsTheLargestPowerOfTwoDividingTheAddressUpTo256) {
  EXPECT_EQ(alignment_of(nullptr), 256u);
  EXPECT_EQ(alignment_of(reinterpret_cast<const void*>(uintptr_t(0x1000))), 256u);
  EXPECT_EQ(alignment_of(reinterpret_cast<const void*>(uintptr_t(0x100))), 256u);
  EXPECT_EQ(alignment_of(reinterpret_cast<const void*>(uintptr_t(0x80))), 128u);
  EXPECT_EQ(alignment_of(reinterpret_cast<const void*>(uintptr_t(0x1010))), 16u);
  EXPECT_EQ(alignment_of(reinterpret_cast<const void*>(uintptr_t(0x1003))), 1u);
}

TEST(PlanKeys, QuarterOctaveBucketsAreAtMostAQuarterOverAndStable) {
  const std::vector<std::pair<int64_t, int64_t>> known = {
      {0, 16},  {1, 16},  {16, 16},     {17, 20},     {20, 20},     {21, 24},    {29, 32},
      {33, 40}, {41, 48}, {1000, 1024}, {1024, 1024}, {1025, 1280}, {1281, 1536}};
  for (const auto& [v, want] : known) EXPECT_EQ(quarter_octave_bucket(v), want) << v;
  int64_t previous = 16;
  for (int64_t v = 1; v <= 100000; ++v) {
    const int64_t b = quarter_octave_bucket(v);
    ASSERT_GE(b, v);
    ASSERT_GE(b, previous) << v;  // monotone: counts in order take buckets in order
    if (v > 16) {
      ASSERT_LE(b * 4, v * 5) << v;  // at most 25% over
    }
    ASSERT_EQ(quarter_octave_bucket(b), b) << v;  // a bucket is its own bucket
    previous = b;
  }
  EXPECT_EQ(quarter_octave_bucket(17, 8), 24);  // steps of at least min_step
  EXPECT_EQ(quarter_octave_bucket(2000, 512), 2048);
}

// m is bucketed unless a is stored [k, m]; k only when a is [k, m] and b is [k, n]; n never.
TEST(PlanKeys, LinearBucketsTheRowCountsThatAreNoOperandsContiguousDimension) {
  LinearPlanKey fprop = base_key();  // a [m, k], b [n, k]
  LinearPlanKey b = linear_bucket_key(fprop);
  EXPECT_EQ(b.m, 112);
  EXPECT_EQ(b.k, 300);
  EXPECT_EQ(b.n, 256);
  LinearPlanKey wgrad = base_key();  // a [k, m], b [k, n]
  wgrad.trans_a = true, wgrad.trans_b = false;
  b = linear_bucket_key(wgrad);
  EXPECT_EQ(b.m, 100);
  EXPECT_EQ(b.k, 320);
  LinearPlanKey both = base_key();
  both.trans_a = true, both.trans_b = true;
  EXPECT_EQ(linear_bucket_key(both), both);
  // Counts of a step fall into the bucket of the count they borrow from: one heuristic query for all.
  LinearPlanKey other = fprop;
  other.m = 105;
  EXPECT_EQ(linear_bucket_key(other), linear_bucket_key(fprop));
  EXPECT_FALSE(other == fprop);
}

TEST(PlanKeys, EveryFieldOfLinearsKeyTellsPlansApart) {
  const LinearPlanKey base = base_key();
  const LinearPlanKeyHash hash;
  EXPECT_EQ(hash(base), hash(base_key()));
  const std::vector<std::function<void(LinearPlanKey&)>> changes = {
      [](LinearPlanKey& k) { k.m += 1; },
      [](LinearPlanKey& k) { k.n += 1; },
      [](LinearPlanKey& k) { k.k += 1; },
      [](LinearPlanKey& k) { k.lda += 1; },
      [](LinearPlanKey& k) { k.ldb += 1; },
      [](LinearPlanKey& k) { k.ldc += 1; },
      [](LinearPlanKey& k) { k.trans_a = !k.trans_a; },
      [](LinearPlanKey& k) { k.trans_b = !k.trans_b; },
      [](LinearPlanKey& k) { k.accumulate = !k.accumulate; },
      [](LinearPlanKey& k) { k.has_bias = !k.has_bias; },
      [](LinearPlanKey& k) { k.ab_dtype = DType::f32; },
      [](LinearPlanKey& k) { k.c_dtype = DType::bf16; },
      [](LinearPlanKey& k) { k.align_a = 8; },
      [](LinearPlanKey& k) { k.align_b = 8; },
      [](LinearPlanKey& k) { k.align_c = 8; },
      [](LinearPlanKey& k) { k.align_bias = 8; },
  };
  for (size_t i = 0; i < changes.size(); ++i) {
    LinearPlanKey k = base;
    changes[i](k);
    EXPECT_FALSE(k == base) << "field " << i;
    EXPECT_NE(hash(k), hash(base)) << "field " << i;
  }
}
