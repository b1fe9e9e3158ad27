// Error checks for CUDA runtime and cuBLASLt calls: turn a failed status into a CudaError that
// names the call, the error string and file:line. Device code never includes this.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime.h>

#include "kernels/common/error.h"

#define FLOWMOE_CUDA_CHECK(cmd)                                                                            \
  do {                                                                                                     \
    cudaError_t e_ = (cmd);                                                                                \
    if (e_ != cudaSuccess) FLOWMOE_THROW(::flowmoe::CudaError, #cmd, " failed: ", cudaGetErrorString(e_)); \
  } while (0)

#define FLOWMOE_CUBLAS_CHECK(cmd)                                                                              \
  do {                                                                                                         \
    cublasStatus_t s_ = (cmd);                                                                                 \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                                           \
      FLOWMOE_THROW(::flowmoe::CudaError, #cmd, " failed: ", cublasLtGetStatusString(s_), " (", int(s_), ")"); \
  } while (0)

// After a kernel launch: catches bad launch configurations immediately (no synchronisation).
#define FLOWMOE_CUDA_CHECK_LAUNCH() FLOWMOE_CUDA_CHECK(cudaGetLastError())
