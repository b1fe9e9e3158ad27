// Launch helpers shared by the kernel files: the SM count and the dynamic shared-memory opt-in, each
// cached per device (launchers run on every step, and a driver query or attribute call per launch adds
// to an op's latency), and cudaLaunchKernelEx for programmatic dependent launches and cooperative grids.
// Inline, so each cache is one for the whole program. Used by permute.cu, attention.cu, the flash
// attention files, swiglu_quant.cu and the grouped GEMMs; their tests exercise them.
#pragma once
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

#include "kernels/common/cuda_check.h"

namespace flowmoe {

// SMs of the current device.
inline int sm_count() {
  static std::array<std::atomic<int>, 64> cached{};
  int dev = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
  int n = dev < int(cached.size()) ? cached[size_t(dev)].load(std::memory_order_relaxed) : 0;
  if (n == 0) {
    FLOWMOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    if (dev < int(cached.size())) cached[size_t(dev)].store(n, std::memory_order_relaxed);
  }
  return n;
}

// Raises kernel's dynamic shared memory limit to smem bytes on the current device, once per (kernel,
// device) and size; nothing below the default 48 KiB. carveout: also ask for the largest shared-memory
// split of L1.
inline void allow_smem_ptr(const void* kernel, size_t smem, bool carveout) {
  if (smem <= 48 * 1024 && !carveout) return;
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, size_t> granted;  // (kernel, device) -> bytes allowed
  int dev = 0;
  FLOWMOE_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  auto it = granted.find({kernel, dev});
  if (it != granted.end() && it->second >= smem) return;
  if (carveout && it == granted.end())
    FLOWMOE_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, cudaSharedmemCarveoutMaxShared));
  if (smem > 48 * 1024)
    FLOWMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  granted[{kernel, dev}] = smem;
}

template <class... Params>
void allow_smem(void (*kernel)(Params...), size_t smem, bool carveout = false) {
  allow_smem_ptr(reinterpret_cast<const void*>(kernel), smem, carveout);
}

// dependent: programmatic stream serialization (the kernel may start before the previous one in the
// stream has finished; it waits where it must: wait_for_previous_kernel, kernels/cuda/permute_route.cuh).
// cooperative: all blocks resident at once, so the grid barrier of cooperative_groups works.
template <class... Params, class... Args>
void launch_ex(void (*kernel)(Params...), unsigned blocks, int threads, size_t smem, cudaStream_t stream,
               bool dependent, bool cooperative, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int num_attrs = 0;
  if (dependent) {
    attr[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[num_attrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cooperative) {
    attr[num_attrs].id = cudaLaunchAttributeCooperative;
    attr[num_attrs++].val.cooperative = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = unsigned(num_attrs);
  FLOWMOE_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

template <class... Params, class... Args>
void launch_dependent(void (*kernel)(Params...), unsigned blocks, int threads, size_t smem, cudaStream_t stream,
                      Args... args) {
  launch_ex(kernel, blocks, threads, smem, stream, true, false, args...);
}

}  // namespace flowmoe
