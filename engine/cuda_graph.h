// A piece of engine work captured once as a CUDA graph and replayed (the trainer's whole step:
// train.cuda_graph). The capture runs a function with the engine stream recording instead of running,
// inside a private memory pool (engine/allocator.h): every tensor the function allocates keeps its
// address for all replays, and no tensor outside the graph is ever handed one of those blocks. Host
// work in the function (shape checks, the autograd tape) happens once, at capture; what the replays
// change is only what the device computes. A host synchronisation in the function makes the capture
// fail (CudaError), and nothing of it is left behind.
#pragma once
#include <functional>
#include <vector>

#include "engine/device.h"
#include "engine/tensor.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

class CudaGraphCapture {
 public:
  explicit CudaGraphCapture(Device device);
  ~CudaGraphCapture();
  CudaGraphCapture(const CudaGraphCapture&) = delete;
  CudaGraphCapture& operator=(const CudaGraphCapture&) = delete;

  // Captures body (nothing runs yet) and keeps the tensors it returns; throws, capturing nothing, when
  // body throws or cannot be captured.
  void capture(const std::function<std::vector<Tensor>()>& body);
  bool captured() const { return graph_ != nullptr; }
  // Runs the captured work once more on the engine stream; outputs() then hold this replay's values.
  void replay();
  const std::vector<Tensor>& outputs() const { return outputs_; }

 private:
  Device device_;
  int pool_ = 0;
  CudaGraph graph_ = nullptr;
  std::vector<Tensor> outputs_;
  void release();
};

}  // namespace flowmoe
