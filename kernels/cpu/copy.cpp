// CPU reference for strided copies and casts (see kernels/copy.h).
#include <cstring>

#include "kernels/copy.h"

namespace flowmoe {

void strided_copy_cpu(void* dst, const void* src, size_t elem_size, const StridedLayout& L) {
  int64_t n = 1;
  for (int d = 0; d < L.ndim; ++d) n *= L.shape[d];
  auto* out = static_cast<char*>(dst);
  auto* in = static_cast<const char*>(src);
  int64_t idx[kMaxDims] = {};
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < L.ndim; ++d) off += idx[d] * L.strides[d];
    std::memcpy(out + i * int64_t(elem_size), in + off * int64_t(elem_size), elem_size);
    for (int d = L.ndim - 1; d >= 0; --d) {  // odometer increment, last dim fastest
      if (++idx[d] < L.shape[d]) break;
      idx[d] = 0;
    }
  }
}

static double load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32:
      return static_cast<const float*>(p)[i];
    case DType::f64:
      return static_cast<const double*>(p)[i];
    case DType::bf16:
      return bf16_bits_to_f32(static_cast<const uint16_t*>(p)[i]);
    case DType::e4m3:
      return e4m3_to_f32(static_cast<const uint8_t*>(p)[i]);
    case DType::e5m2:
      return e5m2_to_f32(static_cast<const uint8_t*>(p)[i]);
    case DType::i32:
      return static_cast<const int32_t*>(p)[i];
    case DType::i64:
      return double(static_cast<const int64_t*>(p)[i]);
    case DType::u8:
      return static_cast<const uint8_t*>(p)[i];
  }
  return 0;
}

static void store(void* p, DType t, int64_t i, double v) {
  // Narrow types convert from float, as the GPU does, so both round identically.
  switch (t) {
    case DType::f32:
      static_cast<float*>(p)[i] = float(v);
      break;
    case DType::f64:
      static_cast<double*>(p)[i] = v;
      break;
    case DType::bf16:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16_bits(float(v));
      break;
    case DType::e4m3:
      static_cast<uint8_t*>(p)[i] = f32_to_e4m3(float(v));
      break;
    case DType::e5m2:
      static_cast<uint8_t*>(p)[i] = f32_to_e5m2(float(v));
      break;
    case DType::i32:
      static_cast<int32_t*>(p)[i] = int32_t(v);
      break;
    case DType::i64:
      static_cast<int64_t*>(p)[i] = int64_t(v);
      break;
    case DType::u8:
      static_cast<uint8_t*>(p)[i] = uint8_t(v);
      break;
  }
}

void cast_cpu(void* dst, DType dst_type, const void* src, DType src_type, int64_t n) {
  if (dst_type == src_type) {
    if (n > 0) std::memcpy(dst, src, size_t(n) * dtype_size(dst_type));  // an empty tensor may have no storage
    return;
  }
  if (src_type == DType::i64 && dst_type == DType::i32) {  // exact path, no double round trip
    for (int64_t i = 0; i < n; ++i) static_cast<int32_t*>(dst)[i] = int32_t(static_cast<const int64_t*>(src)[i]);
    return;
  }
  if (src_type == DType::i32 && dst_type == DType::i64) {
    for (int64_t i = 0; i < n; ++i) static_cast<int64_t*>(dst)[i] = static_cast<const int32_t*>(src)[i];
    return;
  }
  for (int64_t i = 0; i < n; ++i) store(dst, dst_type, i, load(src, src_type, i));
}

}  // namespace flowmoe
