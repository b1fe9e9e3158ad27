// CudaGraphCapture (see cuda_graph.h).
#include "engine/cuda_graph.h"

#include "engine/allocator.h"
#include "kernels/common/error.h"

namespace flowmoe {

CudaGraphCapture::CudaGraphCapture(Device device) : device_(device) {
  FLOWMOE_CHECK(device.is_cuda(), DeviceError, "CUDA graphs need a CUDA device, not ", device.str());
}

CudaGraphCapture::~CudaGraphCapture() {
  try {
    release();
  } catch (...) {  // the CUDA context may already be gone at exit
  }
}

void CudaGraphCapture::release() {
  cuda_graph_destroy(graph_);
  graph_ = nullptr;
  outputs_.clear();  // their blocks return to the pool, which then returns to the cache
  if (pool_) release_memory_pool(device_, pool_);
  pool_ = 0;
}

void CudaGraphCapture::capture(const std::function<std::vector<Tensor>()>& body) {
  FLOWMOE_CHECK(!captured(), Error, "CudaGraphCapture: already captured");
  cuda_set_device(device_.index);
  pool_ = open_memory_pool(device_);
  try {
    cuda_begin_capture(device_.index);
    try {
      outputs_ = body();
    } catch (...) {
      cuda_abort_capture(device_.index);
      throw;
    }
    graph_ = cuda_end_capture(device_.index);
  } catch (...) {
    close_memory_pool(device_);
    release();
    throw;
  }
  close_memory_pool(device_);
}

void CudaGraphCapture::replay() {
  FLOWMOE_CHECK(captured(), Error, "CudaGraphCapture: nothing captured to replay");
  cuda_graph_launch(graph_, device_.index);
}

}  // namespace flowmoe
