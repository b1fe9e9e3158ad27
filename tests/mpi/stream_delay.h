// Test-only kernels enqueued on a stream the caller names, for the tests that hold one stream back
// against another (test_nccl_one_rank.cpp, through GradientReducer::set_stream_hook).
#pragma once
#include <cstdint>

#include "kernels/common/device_api.h"  // cudaStream_t

namespace flowmoe::test {

// One thread that spins for about `microseconds` of GPU time (the global timer).
void spin_on_stream(cudaStream_t stream, int64_t microseconds);
// data[i] *= factor for n f32 elements in device memory.
void scale_on_stream(cudaStream_t stream, float* data, int64_t n, float factor);

}  // namespace flowmoe::test
