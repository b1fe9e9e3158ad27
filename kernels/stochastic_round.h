// Stochastic rounding of f32 to bf16, one function for the host and the device, so the CPU reference and
// the CUDA kernels give the same bits.
//   bf16_bits_stochastic(x, r): add r's low 16 bits to x's bits below bf16's mantissa, then truncate. A value
//   a fraction f of the way from its lower-magnitude bf16 neighbour to the next rounds away from zero with
//   probability f (r uniform), so the expected result is x itself: unbiased, where round-to-nearest moves a
//   quantity that changes by less than half a bf16 ulp per step never.
// The random bits are a counter-based hash of (seed, update, tensor id, element index): SplitMix64's finalizer
// (a bijection of 64-bit words) applied in turn. Nothing is stored or checkpointed; an element draws the same
// bits wherever it is updated (CPU or GPU, any launch shape, any shard of its tensor), and a resumed run
// draws what the uninterrupted one would. AdamW's bf16 moments use it (kernels/adamw.h).
// Tests: tests/test_bf16_moments.cpp.
#pragma once
#include <cstdint>
#include <cstring>

#include "kernels/step_control.h"  // FLOWMOE_HOST_DEVICE

namespace flowmoe {

FLOWMOE_HOST_DEVICE inline uint32_t float_to_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

FLOWMOE_HOST_DEVICE inline float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
#endif
}

// A bf16's value, exactly.
FLOWMOE_HOST_DEVICE inline float bf16_bits_value(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

// x rounded to bf16 stochastically from the low 16 bits of `random`; NaN gives 0x7FFF, as round-to-nearest
// does on both devices (kernels/common/dtype.h), and a finite x past bf16's largest value may round to inf.
FLOWMOE_HOST_DEVICE inline uint16_t bf16_bits_stochastic(float x, uint32_t random) {
  const uint32_t u = float_to_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFF;
  return uint16_t((u + (random & 0xFFFFu)) >> 16);  // no overflow: u <= 0xFF800000 here
}

constexpr uint64_t kSplitMixGamma = 0x9E3779B97F4A7C15ull;

// SplitMix64's finalizer: a bijection that spreads every input bit over the output.
FLOWMOE_HOST_DEVICE inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A tensor's rounding key from the run's seed and the tensor's id (computed once, on the host).
FLOWMOE_HOST_DEVICE inline uint64_t rounding_key(uint64_t seed, uint64_t tensor_id) {
  return splitmix64_mix(splitmix64_mix(seed + kSplitMixGamma) + (tensor_id + 1) * kSplitMixGamma);
}

// The stream of a tensor's key at one update (once per thread on the device).
FLOWMOE_HOST_DEVICE inline uint64_t rounding_stream(uint64_t key, uint64_t update) {
  return splitmix64_mix(key ^ splitmix64_mix(update + kSplitMixGamma));
}

// 64 random bits for element `index` of a stream: SplitMix64's output number index + 1 from state `stream`.
FLOWMOE_HOST_DEVICE inline uint64_t rounding_bits(uint64_t stream, uint64_t index) {
  return splitmix64_mix(stream + (index + 1) * kSplitMixGamma);
}

}  // namespace flowmoe
