// Seeded, counter-based random numbers. Element i of a draw depends only on (seed, offset + i), so
// the same seed gives the same initial weights on every device: values are generated on the host
// (large draws on several threads, with the same bits) and copied, which makes CPU and GPU runs start
// from identical bits by construction.
#pragma once
#include <cstdint>

#include "engine/tensor.h"

namespace flowmoe {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : seed_(seed) {}

  Tensor uniform(const Shape& shape, double lo, double hi, DType dtype = DType::f32, Device device = Device::cpu());
  Tensor normal(const Shape& shape, double mean, double std, DType dtype = DType::f32, Device device = Device::cpu());
  // Rows [row_begin, row_begin + rows) of normal(full_shape, ...), bit for bit, drawing only those rows;
  // the offset advances as for the whole draw (an expert-parallel rank's share of a full tensor).
  Tensor normal_rows(const Shape& full_shape, int64_t row_begin, int64_t rows, double mean, double std,
                     DType dtype = DType::f32, Device device = Device::cpu());
  // Integers uniform in [lo, hi).
  Tensor randint(const Shape& shape, int64_t lo, int64_t hi, DType dtype = DType::i32, Device device = Device::cpu());
  double next_uniform();  // one double in [0, 1)
  uint64_t next_u64();    // one raw 64-bit draw

  // Full state, for checkpoints: restoring it continues the exact sequence.
  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_state(uint64_t seed, uint64_t offset) { seed_ = seed, offset_ = offset; }

 private:
  uint64_t seed_;
  uint64_t offset_ = 0;  // draws consumed so far
  uint64_t draw(uint64_t i) const;
};

}  // namespace flowmoe
