// A CUDA graph of launchers, for the tests that show a launcher makes no host synchronisation
// (tests/test_grouped_gemm_device.cpp, tests/test_fp8_colwise_device.cpp): stream capture rejects any
// call that synchronises the host, so such a launcher either throws under capture or invalidates it.
#pragma once
#if defined(FLOWMOE_WITH_CUDA)
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <exception>
#include <functional>

#include "kernels/common/device_api.h"

namespace flowmoe::test {

// Owns a non-blocking stream, the graph captured on it and its executable.
class CapturedGraph {
 public:
  CapturedGraph() { cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking); }
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
    if (stream_) cudaStreamDestroy(stream_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  cudaStream_t stream() const { return stream_; }

  // Runs launch() (which enqueues on stream()) once eagerly, after the engine's stream, so module loading
  // and lazy driver lookups stay out of the capture; then captures it and instantiates the graph.
  ::testing::AssertionResult capture(const std::function<void()>& launch) {
    if (!stream_) return ::testing::AssertionFailure() << "no stream";
    cuda_synchronize(0);  // inputs written on the engine's stream
    launch();
    if (cudaStreamSynchronize(stream_) != cudaSuccess) return ::testing::AssertionFailure() << "eager run failed";
    if (cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaStreamBeginCapture failed";
    try {
      launch();
    } catch (const std::exception& ex) {
      cudaStreamEndCapture(stream_, &graph_);
      return ::testing::AssertionFailure()
             << "a launcher failed under stream capture (a host synchronisation?): " << ex.what();
    }
    if (cudaStreamEndCapture(stream_, &graph_) != cudaSuccess)
      return ::testing::AssertionFailure() << "capture was invalidated by a synchronising call";
    if (cudaGraphInstantiate(&exec_, graph_, 0) != cudaSuccess)
      return ::testing::AssertionFailure() << "cudaGraphInstantiate failed";
    return ::testing::AssertionSuccess();
  }
  // One replay, waited for.
  bool replay() {
    return cudaGraphLaunch(exec_, stream_) == cudaSuccess && cudaStreamSynchronize(stream_) == cudaSuccess;
  }

 private:
  cudaStream_t stream_ = nullptr;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace flowmoe::test
#endif
