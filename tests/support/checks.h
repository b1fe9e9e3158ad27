// Shared test helpers: fresh random inputs, closeness checks that name the first bad element,
// a finite-difference gradient check in f64, and a skip for machines without a GPU.
#pragma once
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "engine/ops/ops.h"
#include "engine/rng.h"
#include "kernels/common/device_api.h"

namespace flowmoe::test {

// Skips the current test (cleanly, with a reason) when no CUDA device is usable.
#define FLOWMOE_REQUIRE_CUDA()                                                            \
  do {                                                                                    \
    if (!::flowmoe::cuda_available()) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)

// A seed that differs per run (so inputs are fresh) unless FLOWMOE_TEST_SEED fixes it; the seed
// is printed so any failure can be replayed.
uint64_t test_seed();

// The fuzz tests' seed and case count: fixed defaults, bounded for CI, unless FLOWMOE_TEST_SEED /
// FLOWMOE_FUZZ_CASES set them for a longer run on demand. Prints what it chose.
struct FuzzPlan {
  uint64_t seed;
  int64_t num_cases;
};
FuzzPlan fuzz_plan(uint64_t default_seed, int64_t default_cases);

// Uniform in [lo, hi) with the given dtype and device, drawn from `rng`.
Tensor random_tensor(Rng& rng, const Shape& shape, DType dtype = DType::f32, Device device = Device::cpu(),
                     double lo = -1.0, double hi = 1.0);

// max |got - ref| <= atol + rtol * |ref| elementwise; a failure names the first bad index and values.
::testing::AssertionResult all_close(const Tensor& got, const Tensor& ref, double rtol, double atol);
// Bitwise equality of the raw bytes (for permutes, quantize, casts); names the first bad element.
::testing::AssertionResult bit_equal(const Tensor& got, const Tensor& ref);
// ||got - ref|| / ||ref|| (0 when both are zero).
double rel_error(const Tensor& got, const Tensor& ref);

// Finite-difference check of fn's gradients at `inputs` (f64 CPU tensors). Compares the analytic
// vjp of a random projection of the output against central differences. Only inputs listed in
// `wrt` are checked (default: all floating inputs).
using GradFn = std::function<Variable(const std::vector<Variable>&)>;
::testing::AssertionResult gradcheck(const GradFn& fn, const std::vector<Tensor>& inputs, double eps = 1e-6,
                                     double tol = 1e-5, std::vector<int> wrt = {});

// Expects fn to throw E with a message that contains every one of `parts`.
template <class E, class F>
::testing::AssertionResult throws_naming(F&& fn, std::initializer_list<const char*> parts) {
  try {
    fn();
  } catch (const E& e) {
    std::string msg = e.what();
    for (const char* p : parts)
      if (msg.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << msg << "\" does not name " << p;
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw the wrong type: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// rows [R,H] times probs [R], row by row (probs [R,1] · ones [1,H] broadcasts them): fp8_flow's prob
// weighting as a differentiable composition of engine ops, for tests of the layouts that move probs.
Variable times_probs(const Variable& rows, const Variable& probs);

// topk_idx [T,k] i32: each token picks k distinct experts from `allowed` (all of [0, E) when empty).
Tensor random_topk(std::mt19937_64& gen, int64_t num_tokens, int top_k, int num_experts, std::vector<int> allowed = {});

}  // namespace flowmoe::test
