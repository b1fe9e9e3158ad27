// What the benchmarks share: their main() (bench_main), the median of `reps` event-timed runs on
// `stream` after `warmup` untimed ones (module load, handle creation and cuBLASLt plans stay out of
// the numbers), the device's copy bandwidth, the ceiling of the bandwidth-bound kernels, and large
// random inputs made quickly.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <vector>

#include "engine/rng.h"
#include "engine/stream.h"
#include "engine/tensor.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

// The device memory that GPU-time-only measurements memset first: 256 MiB, tens of µs of GPU work,
// longer than the host takes to queue an op's launches. Allocated on first use, kept until exit.
struct BusyBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
};
inline BusyBuffer busy_buffer() {
  static const BusyBuffer busy{cuda_malloc_raw(size_t(256) << 20, 0), size_t(256) << 20};
  return busy;
}

// GPU time only (gpu_only): a memset of busy_buffer() keeps the GPU busy while the host queues
// `prelude` (untimed), the start event, `run` and the stop event, so launch latency drops out.
// Otherwise the host's queueing is timed too (median_ms).
template <class P, class F>
double median_gpu_ms(P&& prelude, F&& run, cudaStream_t stream, bool gpu_only, int warmup = 5, int reps = 30) {
  const BusyBuffer busy = gpu_only ? busy_buffer() : BusyBuffer{};
  for (int i = 0; i < warmup; ++i) {
    prelude();
    run();
  }
  Event start(true), stop(true);
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    if (busy.ptr) FLOWMOE_CUDA_CHECK(cudaMemsetAsync(busy.ptr, 0, busy.bytes, stream));
    prelude();
    start.record(stream);
    run();
    stop.record(stream);
    stop.synchronize();
    times.push_back(start.elapsed_ms(stop));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

template <class F>
double median_ms(F&& run, cudaStream_t stream, int warmup = 5, int reps = 30) {
  return median_gpu_ms([] {}, run, stream, false, warmup, reps);
}

// DESIGN.md §6: the H200's device-to-device copy bandwidth, bytes read + written.
constexpr double kH200CopyGbps = 4249.0;

inline double gbps(double bytes, double ms) { return bytes / (ms * 1e-3) / 1e9; }

// The device's D2D copy bandwidth (cudaMemcpyAsync of copy_bytes, 1 GiB for the ceiling; bytes read
// + written), timed the way the benchmark times its kernels: `queued` with the host's queueing
// (median_ms), and with gpu_only also `gpu_only` (median_gpu_ms; NaN otherwise).
struct CopyGbps {
  double queued = NAN, gpu_only = NAN;
};
inline CopyGbps copy_gbps(cudaStream_t stream, bool gpu_only = false, size_t copy_bytes = size_t(1) << 30) {
  void* src = cuda_malloc_raw(copy_bytes, 0);
  void* dst = cuda_malloc_raw(copy_bytes, 0);
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(src, 1, copy_bytes, stream));
  auto copy = [&] { FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream)); };
  CopyGbps r;
  r.queued = gbps(2.0 * double(copy_bytes), median_ms(copy, stream));
  if (gpu_only) r.gpu_only = gbps(2.0 * double(copy_bytes), median_gpu_ms([] {}, copy, stream, true));
  cuda_free_raw(src, 0);
  cuda_free_raw(dst, 0);
  return r;
}

// Uniform values on device 0: a 4M-element random tile drawn on the host, repeated (host draws of a
// 277M-element tensor would take seconds).
inline Tensor random_tiled_device(Rng& rng, const Shape& shape, double lo, double hi, DType dtype,
                                  cudaStream_t stream) {
  const int64_t n = shape_numel(shape), tile = std::min<int64_t>(n, int64_t(1) << 22);
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0)), src = rng.uniform({tile}, lo, hi, dtype, Device::cuda(0));
  const size_t es = dtype_size(dtype);
  for (int64_t off = 0; off < n; off += tile)
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(t.raw_data()) + size_t(off) * es, src.raw_data(),
                                       size_t(std::min(tile, n - off)) * es, cudaMemcpyDeviceToDevice, stream));
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return t;
}

// A benchmark's main(): without a CUDA device it prints "<name>: no CUDA device, skipped" and
// returns 0; otherwise it selects device 0 and runs body(properties, the engine's stream), turning an
// exception into "<name> failed: ..." and 1.
template <class F>
int bench_main(const char* name, F&& body) {
  if (cuda_device_count() == 0) {
    std::printf("%s: no CUDA device, skipped\n", name);
    return 0;
  }
  try {
    cuda_set_device(0);
    cudaDeviceProp prop{};
    FLOWMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    body(static_cast<const cudaDeviceProp&>(prop), current_stream(0));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s failed: %s\n", name, e.what());
    return 1;
  }
  return 0;
}

}  // namespace flowmoe
