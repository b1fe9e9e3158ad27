// The operand data the FP8 grouped-GEMM benchmarks share (bench/bench_fp8_grouped_linear.cpp,
// bench/bench_grouped_gemm_device.cpp): random FP8 codes, power-of-two scales and bf16 values drawn once
// on the host and tiled over device buffers, so the GEMMs run on realistic bits at any size.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "engine/tensor.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/dtype.h"
#include "kernels/fp8.h"
#include "kernels/fp8_grouped_linear.h"

namespace flowmoe::bench {

// A random host chunk tiled over the device buffer (random data, not zeros: power draw changes clocks).
template <class T>
Tensor device_fill(const std::vector<T>& chunk, const Shape& shape, DType dtype, cudaStream_t stream) {
  Tensor out = Tensor::empty(shape, dtype, Device::cuda(0));
  const int64_t n = out.numel(), c = int64_t(chunk.size());
  Tensor src = Tensor::empty({c}, dtype);
  std::copy(chunk.begin(), chunk.end(), static_cast<T*>(src.raw_data()));
  src = src.to(Device::cuda(0));
  for (int64_t off = 0; off < n; off += c)
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<T*>(out.raw_data()) + off, src.raw_data(),
                                       size_t(std::min(c, n - off)) * sizeof(T), cudaMemcpyDeviceToDevice, stream));
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

struct Chunks {
  std::vector<uint8_t> fp8;    // e4m3 codes, NaN codes (S.1111.111) excluded
  std::vector<float> scales;   // powers of two 2^-10..2^-6
  std::vector<uint16_t> bf16;  // bf16 bits of uniform(-1, 1)
};
inline Chunks make_chunks() {
  std::mt19937_64 gen(2026);
  Chunks c;
  c.fp8.resize(size_t(1) << 22);
  for (auto& b : c.fp8) {
    b = uint8_t(gen());
    if ((b & 0x7F) == 0x7F) b ^= 1;
  }
  c.scales.resize(4096);
  for (auto& s : c.scales) s = fp8_pow2(-6 - int(gen() % 5));
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  c.bf16.resize(size_t(1) << 22);
  for (auto& v : c.bf16) v = f32_to_bf16_bits(u(gen));
  return c;
}

// The FP8 wgrad's operands: colwise dy_t [n, m] and x_t [k, m] with their scales [num_blocks, n | k], and
// the f32 dw [e, n, k] it writes.
struct WgradOperands {
  Tensor dy_t, dy_t_scales, x_t, x_t_scales, dw;
  void run_per_expert(const int64_t* rows, int64_t e, int64_t m, int64_t n, int64_t k, cudaStream_t stream) {
    fp8_grouped_wgrad_cuda(dy_t.data<uint8_t>(), dy_t_scales.data<float>(), x_t.data<uint8_t>(),
                           x_t_scales.data<float>(), dw.data<float>(), rows, e, m, n, k, false, stream);
  }
};
inline WgradOperands wgrad_operands(const Chunks& ch, int64_t e, int64_t m, int64_t n, int64_t k, int64_t num_blocks,
                                    cudaStream_t stream) {
  return {device_fill(ch.fp8, {n, m}, DType::e4m3, stream), device_fill(ch.scales, {num_blocks, n}, DType::f32, stream),
          device_fill(ch.fp8, {k, m}, DType::e4m3, stream), device_fill(ch.scales, {num_blocks, k}, DType::f32, stream),
          Tensor::empty({e, n, k}, DType::f32, Device::cuda(0))};
}

}  // namespace flowmoe::bench
