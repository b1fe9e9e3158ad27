// Strided copy, dtype cast and fill on the GPU.
//   strided_copy: dst[i] = src[offset(unravel(i))], dst contiguous, up to 8 dims, any element size.
//   cast:         dst[i] = convert(src[i]) through float; bf16 RNE, FP8 RNE + saturate (satfinite).
//   fill:         dst[i] = value.
// CPU reference: kernels/cpu/copy.cpp. Tests: tests/test_tensor.cpp (CUDA vs CPU, bit for bit).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "kernels/common/cuda_check.h"
#include "kernels/copy.h"
#include "kernels/cuda/cuda_utils.cuh"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

template <class Elem>
__global__ void strided_copy_kernel(Elem* __restrict__ dst, const Elem* __restrict__ src, StridedLayout L, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    int64_t rem = i, off = 0;
    for (int d = L.ndim - 1; d >= 0; --d) {
      off += (rem % L.shape[d]) * L.strides[d];
      rem /= L.shape[d];
    }
    dst[i] = src[off];
  }
}

template <class T>
__device__ __forceinline__ float load_f(const T* p, int64_t i);
template <>
__device__ __forceinline__ float load_f<float>(const float* p, int64_t i) {
  return p[i];
}
template <>
__device__ __forceinline__ float load_f<__nv_bfloat16>(const __nv_bfloat16* p, int64_t i) {
  return __bfloat162float(p[i]);
}
template <>
__device__ __forceinline__ float load_f<__nv_fp8_e4m3>(const __nv_fp8_e4m3* p, int64_t i) {
  return float(p[i]);
}
template <>
__device__ __forceinline__ float load_f<__nv_fp8_e5m2>(const __nv_fp8_e5m2* p, int64_t i) {
  return float(p[i]);
}
template <>
__device__ __forceinline__ float load_f<int32_t>(const int32_t* p, int64_t i) {
  return float(p[i]);
}
template <>
__device__ __forceinline__ float load_f<int64_t>(const int64_t* p, int64_t i) {
  return float(p[i]);
}
template <>
__device__ __forceinline__ float load_f<uint8_t>(const uint8_t* p, int64_t i) {
  return float(p[i]);
}

template <class T>
__device__ __forceinline__ void store_f(T* p, int64_t i, float v);
template <>
__device__ __forceinline__ void store_f<float>(float* p, int64_t i, float v) {
  p[i] = v;
}
template <>
__device__ __forceinline__ void store_f<__nv_bfloat16>(__nv_bfloat16* p, int64_t i, float v) {
  p[i] = __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ void store_f<__nv_fp8_e4m3>(__nv_fp8_e4m3* p, int64_t i, float v) {
  p[i].__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
}
template <>
__device__ __forceinline__ void store_f<__nv_fp8_e5m2>(__nv_fp8_e5m2* p, int64_t i, float v) {
  p[i].__x = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E5M2);
}
template <>
__device__ __forceinline__ void store_f<int32_t>(int32_t* p, int64_t i, float v) {
  p[i] = int32_t(v);
}
template <>
__device__ __forceinline__ void store_f<int64_t>(int64_t* p, int64_t i, float v) {
  p[i] = int64_t(v);
}
template <>
__device__ __forceinline__ void store_f<uint8_t>(uint8_t* p, int64_t i, float v) {
  p[i] = uint8_t(v);
}

template <class Dst, class Src>
__global__ void cast_kernel(Dst* __restrict__ dst, const Src* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_f(dst, i, load_f(src, i));
}

// Integer-to-integer casts stay exact (no float round trip).
template <class Dst, class Src>
__global__ void int_cast_kernel(Dst* __restrict__ dst, const Src* __restrict__ src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = Dst(src[i]);
}

template <class Dst>
__global__ void fill_kernel(Dst* __restrict__ dst, float value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    store_f(dst, i, value);
}

// ---- launchers --------------------------------------------------------------------------------

void strided_copy_cuda(void* dst, const void* src, size_t elem_size, const StridedLayout& L, cudaStream_t stream) {
  FLOWMOE_CHECK(L.ndim >= 0 && L.ndim <= kMaxDims, ShapeError, "strided_copy: ", L.ndim, " dims > ", kMaxDims);
  int64_t n = 1;
  for (int d = 0; d < L.ndim; ++d) n *= L.shape[d];
  if (n == 0) return;
  const int threads = 256;
  switch (elem_size) {
    case 1:
      strided_copy_kernel<<<grid_size(n, threads), threads, 0, stream>>>((uint8_t*)dst, (const uint8_t*)src, L, n);
      break;
    case 2:
      strided_copy_kernel<<<grid_size(n, threads), threads, 0, stream>>>((uint16_t*)dst, (const uint16_t*)src, L, n);
      break;
    case 4:
      strided_copy_kernel<<<grid_size(n, threads), threads, 0, stream>>>((uint32_t*)dst, (const uint32_t*)src, L, n);
      break;
    case 8:
      strided_copy_kernel<<<grid_size(n, threads), threads, 0, stream>>>((uint64_t*)dst, (const uint64_t*)src, L, n);
      break;
    default:
      FLOWMOE_THROW(DTypeError, "strided_copy: element size ", elem_size, " not supported");
  }
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

// Calls f with a typed null pointer for the CUDA element type of `t` (f64 is CPU-only).
template <class F>
static void with_cuda_type(DType t, const char* what, F&& f) {
  switch (t) {
    case DType::f32:
      f((float*)nullptr);
      break;
    case DType::bf16:
      f((__nv_bfloat16*)nullptr);
      break;
    case DType::e4m3:
      f((__nv_fp8_e4m3*)nullptr);
      break;
    case DType::e5m2:
      f((__nv_fp8_e5m2*)nullptr);
      break;
    case DType::i32:
      f((int32_t*)nullptr);
      break;
    case DType::i64:
      f((int64_t*)nullptr);
      break;
    case DType::u8:
      f((uint8_t*)nullptr);
      break;
    default:
      FLOWMOE_THROW(DTypeError, what, " on cuda does not support ", dtype_name(t));
  }
}

void cast_cuda(void* dst, DType dst_type, const void* src, DType src_type, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (dst_type == src_type) {
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(n) * dtype_size(dst_type), cudaMemcpyDeviceToDevice, stream));
    return;
  }
  const int threads = 256;
  if (dst_type == DType::i32 && src_type == DType::i64) {
    int_cast_kernel<<<grid_size(n, threads), threads, 0, stream>>>((int32_t*)dst, (const int64_t*)src, n);
    FLOWMOE_CUDA_CHECK_LAUNCH();
    return;
  }
  if (dst_type == DType::i64 && src_type == DType::i32) {
    int_cast_kernel<<<grid_size(n, threads), threads, 0, stream>>>((int64_t*)dst, (const int32_t*)src, n);
    FLOWMOE_CUDA_CHECK_LAUNCH();
    return;
  }
  with_cuda_type(dst_type, "cast", [&](auto* d) {
    using D = std::remove_pointer_t<decltype(d)>;
    with_cuda_type(src_type, "cast", [&](auto* s) {
      using S = std::remove_pointer_t<decltype(s)>;
      cast_kernel<<<grid_size(n, threads), threads, 0, stream>>>(static_cast<D*>(dst), static_cast<const S*>(src), n);
    });
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

void fill_cuda(void* dst, DType type, double value, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  const int threads = 256;
  with_cuda_type(type, "fill", [&](auto* d) {
    using D = std::remove_pointer_t<decltype(d)>;
    fill_kernel<<<grid_size(n, threads), threads, 0, stream>>>(static_cast<D*>(dst), float(value), n);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
