// StreamFan: spreads a loop of independent per-expert GEMMs over `main` and a few side streams, round
// robin, as many as grouped_linear_streams() says (kernels/grouped_linear.h; 1 = all on `main`).
// A small expert GEMM fills a fraction of the SMs and the next one starts only when it ends; on a few
// streams neighbours overlap. The side streams first wait for everything already on `main`, and join()
// makes `main` wait for them, so callers (and the allocator, which assumes one stream per device) see
// the ordering of a single stream. Results are unchanged: each GEMM keeps its algorithm and gets its
// stream's own cuBLASLt workspace. Used by kernels/cuda/grouped_linear.cu and fp8_grouped_linear.cu.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/grouped_linear.h"

namespace flowmoe {

// Per device and host thread (events are re-recorded every call, so threads must not share them).
// Created on first use and never destroyed: destroying them at exit would race CUDA's own teardown.
struct SideStreams {
  std::vector<cudaStream_t> streams;
  std::vector<cudaEvent_t> done;  // one per side stream
  cudaEvent_t fork = nullptr;
};

inline SideStreams& side_streams(int device, size_t count) {
  thread_local std::vector<std::unique_ptr<SideStreams>> per_device;
  if (per_device.size() <= size_t(device)) per_device.resize(size_t(device) + 1);
  auto& s = per_device[size_t(device)];
  if (!s) {
    s = std::make_unique<SideStreams>();
    FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&s->fork, cudaEventDisableTiming));
  }
  while (s->streams.size() < count) {
    cudaStream_t st = nullptr;
    cudaEvent_t ev = nullptr;
    FLOWMOE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    s->streams.push_back(st);
    FLOWMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    s->done.push_back(ev);
  }
  return *s;
}

// The GEMMs a grouped call issues: one per expert that has rows (the fan's num_gemms).
inline int64_t experts_with_rows(const int64_t* padded_tokens_per_expert, int64_t num_experts) {
  return std::count_if(padded_tokens_per_expert, padded_tokens_per_expert + num_experts,
                       [](int64_t r) { return r > 0; });
}

class StreamFan {
 public:
  StreamFan(cudaStream_t main, int64_t num_gemms) : main_(main) {
    const int64_t n = std::min<int64_t>(grouped_linear_streams(), num_gemms);
    if (n <= 1) return;
    side_ = &side_streams(cuda_current_device(), size_t(n - 1));
    num_side_ = int(n - 1);
    FLOWMOE_CUDA_CHECK(cudaEventRecord(side_->fork, main_));
    for (int i = 0; i < num_side_; ++i)
      FLOWMOE_CUDA_CHECK(cudaStreamWaitEvent(side_->streams[size_t(i)], side_->fork, 0));
  }
  StreamFan(const StreamFan&) = delete;
  StreamFan& operator=(const StreamFan&) = delete;
  ~StreamFan() {
    if (num_side_ > 0) join_impl(false);  // unwinding from a throw: still leave `main` ordered after the sides
  }

  cudaStream_t next() {
    if (num_side_ == 0) return main_;
    int i = turn_++ % (num_side_ + 1);
    return i == 0 ? main_ : side_->streams[size_t(i - 1)];
  }
  void join() { join_impl(true); }

 private:
  void join_impl(bool check) {
    for (int i = 0; i < num_side_; ++i) {
      cudaError_t e = cudaEventRecord(side_->done[size_t(i)], side_->streams[size_t(i)]);
      if (e == cudaSuccess) e = cudaStreamWaitEvent(main_, side_->done[size_t(i)], 0);
      if (check) FLOWMOE_CUDA_CHECK(e);
    }
    num_side_ = 0;
  }

  cudaStream_t main_;
  SideStreams* side_ = nullptr;
  int num_side_ = 0, turn_ = 0;
};

}  // namespace flowmoe
