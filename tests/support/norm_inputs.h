// Inputs for the tests of the fused RMSNorm ops (tests/test_rmsnorm_quant.cpp, tests/test_add_rmsnorm.cpp): the
// shapes, rows with edge magnitudes, a norm weight of both signs.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/rng.h"
#include "engine/tensor.h"
#include "tests/support/checks.h"

namespace flowmoe::test {

struct NormCase {
  int64_t rows, hidden;
};
// Widths of the model (multiples of 128, up to 7168 and 16384) and, for the kernels' general path, a few that
// are not (partial last blocks, rows not 16-byte aligned).
inline const NormCase kNormCases[] = {{0, 128},  {1, 128},   {4, 256}, {6, 1024}, {5, 2048}, {3, 4096},
                                      {2, 7168}, {2, 16384}, {3, 129}, {4, 1001}, {2, 7}};

// x [rows, hidden] in [-2, 2), its first rows made edge rows where there are enough: zeros, huge (2^40 scale: the
// f32 sum of x^2 stays finite up to 16384 columns), tiny (2^-100: x^2 underflows in f32 and is negligible beside
// eps in double, so both backends take rstd = 1/sqrt(eps)), and one spike among small values.
inline Tensor edge_rows(Rng& rng, const NormCase& c) {
  std::vector<float> v = random_tensor(rng, {c.rows, c.hidden}, DType::f32, Device::cpu(), -2, 2).to_floats();
  auto row = [&](int64_t r) { return v.begin() + r * c.hidden; };
  if (c.rows > 1) std::fill(row(0), row(1), 0.f);
  if (c.rows > 2)
    for (auto it = row(1); it != row(2); ++it) *it *= 0x1p40f;
  if (c.rows > 3)
    for (auto it = row(2); it != row(3); ++it) *it *= 0x1p-100f;
  if (c.rows > 4) {
    for (auto it = row(3); it != row(4); ++it) *it *= 0x1p-20f;
    *(row(3) + c.hidden / 2) = 1000.f;
  }
  return Tensor::from_floats(v, {c.rows, c.hidden});
}

inline Tensor norm_weight(Rng& rng, int64_t hidden) {
  return random_tensor(rng, {hidden}, DType::f32, Device::cpu(), -1.5, 1.5);
}

}  // namespace flowmoe::test
