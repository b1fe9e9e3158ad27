#include "engine/rng.h"

#include <cmath>
#include <vector>

namespace flowmoe {

static uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t Rng::draw(uint64_t i) const { return splitmix64(splitmix64(seed_) ^ i); }

// 53 random bits -> [0, 1)
static double to_unit(uint64_t r) { return double(r >> 11) * (1.0 / 9007199254740992.0); }

uint64_t Rng::next_u64() { return draw(offset_++); }
double Rng::next_uniform() { return to_unit(next_u64()); }

Tensor Rng::uniform(const Shape& shape, double lo, double hi, DType dtype, Device device) {
  std::vector<double> v(size_t(shape_numel(shape)));
  for (auto& x : v) x = lo + (hi - lo) * to_unit(draw(offset_++));
  return Tensor::from_doubles(v, shape, dtype, device);
}

Tensor Rng::normal(const Shape& shape, double mean, double std, DType dtype, Device device) {
  std::vector<double> v(size_t(shape_numel(shape)));
  // Box-Muller: each element uses two draws of its own, so element i never depends on the shape.
  for (auto& x : v) {
    double u1 = 1.0 - to_unit(draw(offset_++));  // (0, 1]: log is finite
    double u2 = to_unit(draw(offset_++));
    x = mean + std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  }
  return Tensor::from_doubles(v, shape, dtype, device);
}

Tensor Rng::randint(const Shape& shape, int64_t lo, int64_t hi, DType dtype, Device device) {
  FLOWMOE_CHECK(hi > lo, Error, "randint: empty range [", lo, ", ", hi, ")");
  std::vector<int64_t> v(size_t(shape_numel(shape)));
  uint64_t span = uint64_t(hi - lo);
  for (auto& x : v) x = lo + int64_t(draw(offset_++) % span);
  return Tensor::from_ints(v, shape, dtype, device);
}

}  // namespace flowmoe
