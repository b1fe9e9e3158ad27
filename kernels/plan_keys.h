// The host logic of the cuBLASLt plan caches (kernels/cuda/cublaslt_cache.cuh, linear.cu), apart from
// cuBLASLt's types so the CPU build compiles and tests it (tests/test_plan_keys.cpp): operand alignment,
// key hashing, the row-count buckets whose heuristic answer a new per-expert count borrows, and linear's
// key (every field the algorithm choice depends on) with the bucket it borrows from.
#pragma once
#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <functional>

#include "kernels/common/dtype.h"

namespace flowmoe {

// Largest power of two (at most 256) dividing the address: cuBLASLt picks algorithms by alignment.
inline uint32_t alignment_of(const void* p) {
  auto v = reinterpret_cast<uintptr_t>(p);
  return v == 0 ? 256u : uint32_t(1) << std::min(8, std::countr_zero(v));
}

// Folds v into the running hash h (boost's hash_combine).
inline void hash_mix(size_t& h, uint64_t v) {
  h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
}

// v rounded up to a quarter octave (16, 20, 24, 28, 32, 40, ..., 1024, 1280, ...), at least 16, with
// steps of at least min_step: at most 25% over, so a heuristic asked for the bucket sees nearly the real
// tile and wave counts, while a step's fresh per-expert row counts fall into a handful of buckets.
inline int64_t quarter_octave_bucket(int64_t v, int64_t min_step = 1) {
  if (v <= 16) return 16;
  const int64_t step = std::max<int64_t>(min_step, int64_t(1) << (std::bit_width(uint64_t(v - 1)) - 3));
  return (v + step - 1) / step * step;
}

// Everything linear's algorithm choice depends on (the bias pointer's alignment included: the heuristic
// reads it).
struct LinearPlanKey {
  int64_t m, n, k, lda, ldb, ldc;
  bool trans_a, trans_b, accumulate, has_bias;
  DType ab_dtype, c_dtype;
  uint32_t align_a, align_b, align_c, align_bias;
  bool operator==(const LinearPlanKey&) const = default;
};
struct LinearPlanKeyHash {
  size_t operator()(const LinearPlanKey& k) const {
    size_t h = 0;
    for (int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldc}) hash_mix(h, uint64_t(v));
    hash_mix(h, uint64_t(k.trans_a) | uint64_t(k.trans_b) << 1 | uint64_t(k.accumulate) << 2 |
                    uint64_t(k.has_bias) << 3 | uint64_t(k.ab_dtype) << 8 | uint64_t(k.c_dtype) << 16);
    hash_mix(
        h, uint64_t(k.align_a) | uint64_t(k.align_b) << 16 | uint64_t(k.align_c) << 32 | uint64_t(k.align_bias) << 48);
    return h;
  }
};

// The key whose heuristic result `key` borrows: m and k (they count rows or tokens in our callers, n
// is a feature size) bucketed where they are never an operand's contiguous dimension, so vector widths
// and row tails stay those of the exact problem: m unless a is stored [k, m] (trans_a), k only when a
// is [k, m] and b is [k, n]. This covers grouped_linear's varying counts: m of fprop and dgrad, k of
// wgrad.
inline LinearPlanKey linear_bucket_key(LinearPlanKey key) {
  if (!key.trans_a) key.m = quarter_octave_bucket(key.m);
  if (key.trans_a && !key.trans_b) key.k = quarter_octave_bucket(key.k);
  return key;
}

}  // namespace flowmoe
