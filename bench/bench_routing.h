// The routing the MoE benchmarks draw: what a balanced router produces, host-only so that benchmarks
// built without CUDA (bench_dispatch) share it with the GPU ones.
#pragma once
#include <cstdint>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

namespace flowmoe {

// [tokens × top_k] expert ids, row-major: top_k distinct experts per token, uniform over [0, experts).
inline std::vector<int64_t> random_topk_experts(std::mt19937_64& gen, int64_t tokens, int top_k, int experts) {
  std::vector<int64_t> idx;
  idx.reserve(size_t(tokens * top_k));
  std::vector<int> pool(static_cast<size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int j = 0; j < top_k; ++j) {  // partial Fisher-Yates
      std::uniform_int_distribution<size_t> pick(size_t(j), pool.size() - 1);
      std::swap(pool[size_t(j)], pool[pick(gen)]);
      idx.push_back(pool[size_t(j)]);
    }
  }
  return idx;
}

}  // namespace flowmoe
