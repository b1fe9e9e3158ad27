#include "engine/rng.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <thread>
#include <vector>

#include "engine/host_threads.h"
#include "kernels/copy.h"

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

// A host tensor whose element i is value(i), cast to dtype, then moved to device. value(i) depends on
// i alone (the draws are counter-based), so chunks are filled on several threads and the bits do not
// depend on how many: a 100M-parameter init takes seconds, not minutes.
template <class F>
static Tensor generate(const Shape& shape, DType dtype, Device device, const F& value) {
  const int64_t n = shape_numel(shape);
  Tensor host = Tensor::empty(shape, dtype, Device::cpu());
  char* out = static_cast<char*>(host.raw_data());
  const size_t esize = dtype_size(dtype);
  constexpr int64_t kChunk = int64_t(1) << 16;
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  // Chunks [c0, c1): values in double, then cast to dtype (one rounding, as a single-threaded fill).
  auto fill = [&](int64_t c0, int64_t c1) {
    std::vector<double> buf(size_t(std::min(n, kChunk)));
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t begin = c * kChunk, m = std::min(kChunk, n - begin);
      for (int64_t i = 0; i < m; ++i) buf[size_t(i)] = value(begin + i);
      cast_cpu(out + size_t(begin) * esize, dtype, buf.data(), DType::f64, m);
    }
  };
  const int64_t num_threads = std::min<int64_t>(num_chunks / 4, usable_cpu_count());
  if (num_threads <= 1) {
    fill(0, num_chunks);
    return host.to(device);
  }
  std::vector<std::thread> workers;
  std::vector<std::exception_ptr> errors(static_cast<size_t>(num_threads));
  try {
    for (int64_t w = 1; w < num_threads; ++w)
      workers.emplace_back([&, w] {
        try {
          fill(num_chunks * w / num_threads, num_chunks * (w + 1) / num_threads);
        } catch (...) {
          errors[size_t(w)] = std::current_exception();
        }
      });
  } catch (...) {  // a thread that could not start: join the others before unwinding
    for (std::thread& t : workers) t.join();
    throw;
  }
  try {
    fill(0, num_chunks / num_threads);
  } catch (...) {
    errors[0] = std::current_exception();
  }
  for (std::thread& t : workers) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return host.to(device);
}

Tensor Rng::uniform(const Shape& shape, double lo, double hi, DType dtype, Device device) {
  const uint64_t base = offset_;
  Tensor t =
      generate(shape, dtype, device, [&](int64_t i) { return lo + (hi - lo) * to_unit(draw(base + uint64_t(i))); });
  offset_ += uint64_t(shape_numel(shape));
  return t;
}

Tensor Rng::normal(const Shape& shape, double mean, double std, DType dtype, Device device) {
  return normal_rows(shape, 0, shape.empty() ? 1 : shape[0], mean, std, dtype, device);
}

Tensor Rng::normal_rows(const Shape& full_shape, int64_t row_begin, int64_t rows, double mean, double std, DType dtype,
                        Device device) {
  const int64_t full_rows = full_shape.empty() ? 1 : full_shape[0];
  FLOWMOE_CHECK(row_begin >= 0 && rows >= 0 && row_begin + rows <= full_rows, ShapeError, "Rng::normal_rows: rows [",
                row_begin, ", ", row_begin + rows, ") of ", shape_str(full_shape));
  Shape shape = full_shape;
  if (!shape.empty()) shape[0] = rows;
  const int64_t row_elems = full_rows > 0 ? shape_numel(full_shape) / full_rows : 0;
  const uint64_t base = offset_ + 2 * uint64_t(row_begin * row_elems);
  // Box-Muller: each element uses two draws of its own, so element i never depends on the shape.
  Tensor t = generate(shape, dtype, device, [&](int64_t i) {
    const uint64_t d = base + 2 * uint64_t(i);
    const double u1 = 1.0 - to_unit(draw(d));  // (0, 1]: log is finite
    const double u2 = to_unit(draw(d + 1));
    return mean + std * std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * M_PI * u2);
  });
  offset_ += 2 * uint64_t(shape_numel(full_shape));
  return t;
}

Tensor Rng::randint(const Shape& shape, int64_t lo, int64_t hi, DType dtype, Device device) {
  FLOWMOE_CHECK(hi > lo, Error, "randint: empty range [", lo, ", ", hi, ")");
  std::vector<int64_t> v(size_t(shape_numel(shape)));
  uint64_t span = uint64_t(hi - lo);
  for (auto& x : v) x = lo + int64_t(draw(offset_++) % span);
  return Tensor::from_ints(v, shape, dtype, device);
}

}  // namespace flowmoe
