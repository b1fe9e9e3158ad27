// Engine data-movement kernels: strided -> contiguous copy, dtype casts, and fill.
// CPU versions in kernels/cpu/copy.cpp, CUDA in kernels/cuda/copy.cu; tested in tests/test_tensor.cpp.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/common/device_api.h"
#include "kernels/common/dtype.h"

namespace flowmoe {

constexpr int kMaxDims = 8;
struct StridedLayout {  // the source's view; the destination is contiguous in the same shape
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements
};

void strided_copy_cpu(void* dst /*[numel] contiguous*/, const void* src /*strided*/, size_t elem_size,
                      const StridedLayout& layout);
// Element conversion through float (double for f64 on the CPU); FP8 saturates, bf16 rounds to even.
void cast_cpu(void* dst /*[n]*/, DType dst_type, const void* src /*[n]*/, DType src_type, int64_t n);

void strided_copy_cuda(void* dst /*[numel] contiguous*/, const void* src /*strided*/, size_t elem_size,
                       const StridedLayout& layout, cudaStream_t stream);
void cast_cuda(void* dst /*[n]*/, DType dst_type, const void* src /*[n]*/, DType src_type, int64_t n,
               cudaStream_t stream);
void fill_cuda(void* dst /*[n]*/, DType type, double value, int64_t n, cudaStream_t stream);

}  // namespace flowmoe
