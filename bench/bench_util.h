// Timing helpers shared by the benchmarks: the median of `reps` event-timed runs on `stream`, after
// `warmup` untimed ones (module load, handle creation and cuBLASLt plans stay out of the numbers).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "engine/cuda/cuda_check.h"
#include "engine/stream.h"

namespace flowmoe {

// GPU time only: a memset of `busy_bytes` at `busy` keeps the GPU busy while the host queues
// `prelude` (untimed), the start event, `run` and the stop event, so launch latency drops out.
// With busy == nullptr the host's queueing is timed too (median_ms).
template <class P, class F>
double median_gpu_ms(P&& prelude, F&& run, cudaStream_t stream, void* busy, size_t busy_bytes, int warmup = 5,
                     int reps = 30) {
  for (int i = 0; i < warmup; ++i) {
    prelude();
    run();
  }
  Event start(true), stop(true);
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    if (busy) MOE_CUDA_CHECK(cudaMemsetAsync(busy, 0, busy_bytes, stream));
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
  return median_gpu_ms([] {}, run, stream, nullptr, 0, warmup, reps);
}

}  // namespace flowmoe
