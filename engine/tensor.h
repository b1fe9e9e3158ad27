// Tensor: a typed, shaped, strided view of a reference-counted Storage on one device.
//
// Views (view/reshape of contiguous data, transpose, slice) share storage; contiguous(), clone(),
// to(Device) and to(DType) copy. An FP8 tensor may carry its scales (Fp8Scales) as part of its
// value, so quantized activations flow through the autograd graph with their scale_inv attached.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/device.h"
#include "kernels/common/dtype.h"
#include "kernels/common/error.h"

namespace flowmoe {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "[4, 8]"
int64_t shape_numel(const Shape& s);

// Owns one allocation; frees it through the allocator that made it.
class Storage {
 public:
  Storage(size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
};

// How an FP8 tensor's scale_inv maps onto its data (DESIGN.md §3-4).
enum class ScalingMode : uint8_t {
  rowwise_1x128,  // data [M,K]; one scale per (row, 128-column block)
  colwise_1x128,  // data [K,M] (transposed); one scale per (column of the original, 128-row block)
  block_128x128,  // weights [N,K]; one scale per 128x128 tile, scale_inv [N/128, K/128]
};
const char* scaling_mode_name(ScalingMode m);

class Tensor;
struct Fp8Scales;

template <class T>
DType dtype_of();

class Tensor {
 public:
  Tensor() = default;  // undefined tensor (defined() == false)

  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor full(const Shape& shape, double value, DType dtype, Device device = Device::cpu());
  // Host values converted to `dtype` (rounding as the dtype does), then placed on `device`.
  static Tensor from_floats(const std::vector<float>& values, const Shape& shape, DType dtype = DType::f32,
                            Device device = Device::cpu());
  static Tensor from_doubles(const std::vector<double>& values, const Shape& shape, DType dtype = DType::f64,
                             Device device = Device::cpu());
  static Tensor from_ints(const std::vector<int64_t>& values, const Shape& shape, DType dtype = DType::i32,
                          Device device = Device::cpu());

  bool defined() const { return storage_ != nullptr || defined_empty_; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }
  int dim() const { return int(shape_.size()); }
  int64_t size(int d) const;  // negative d counts from the end
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return size_t(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  bool is_contiguous() const;
  std::string describe() const;  // "bf16[4, 8] on cuda:0"

  void* raw_data() const;  // address of element 0 (nullptr when numel() == 0)
  template <class T>
  T* data() const {  // typed pointer; throws DTypeError if T does not match dtype()
    check_elem_type(dtype_of<T>());
    return static_cast<T*>(raw_data());
  }

  Tensor view(const Shape& shape) const;                    // contiguous tensors only; one dim may be -1
  Tensor reshape(const Shape& shape) const;                 // view when possible, else a contiguous copy
  Tensor transpose(int a, int b) const;                     // strided view
  Tensor slice(int dim, int64_t start, int64_t end) const;  // strided view of [start, end)
  Tensor contiguous() const;                                // self if already contiguous
  Tensor clone() const;                                     // contiguous copy on the same device
  Tensor to(Device device) const;                           // copy across devices (self if already there)
  Tensor to(DType dtype) const;                             // cast (self if already that dtype)
  // Same shape and dtype; any devices. A copy from a GPU into host memory waits for the GPU's stream: it
  // counts as a host synchronisation (note_host_sync), as to(cpu), to_floats, to_doubles and to_ints do.
  void copy_(const Tensor& src);
  void zero_();
  void fill_bytes_(uint8_t byte);  // every byte (contiguous tensors): 0xFF is NaN in every float dtype
  void fill_(double value);        // every element = value rounded to the dtype (contiguous tensors)

  std::vector<float> to_floats() const;    // host copy, every element converted to float
  std::vector<double> to_doubles() const;  // host copy, converted to double
  std::vector<int64_t> to_ints() const;    // host copy of an integer tensor

  // FP8: the attached scales (nullptr when none) and a copy of this tensor with scales attached.
  const std::shared_ptr<const Fp8Scales>& fp8_scales() const { return fp8_; }
  // rows_per_segment: colwise_1x128 only, the segments (experts) its 128-row blocks follow
  // (kernels/fp8.h); empty means one segment of all rows.
  Tensor with_scales(const Tensor& scale_inv, ScalingMode mode, std::vector<int64_t> rows_per_segment = {}) const;
  // colwise_1x128 whose segments are per-expert counts the host does not know: segment_counts [E] i32 on
  // this tensor's device, scale_inv sized for the worst case [fp8_colwise_max_blocks(M, E), K] (kernels/fp8.h).
  Tensor with_segment_counts(const Tensor& scale_inv, const Tensor& segment_counts) const;

  bool shares_storage_with(const Tensor& o) const { return storage_ && storage_ == o.storage_; }
  // No other Tensor (view or copy) refers to this storage: handing it over cannot alias anything.
  bool is_sole_owner() const { return storage_ && storage_.use_count() == 1; }

 private:
  std::shared_ptr<Storage> storage_;
  Shape shape_, strides_;
  int64_t offset_ = 0;  // in elements
  DType dtype_ = DType::f32;
  Device device_;
  bool defined_empty_ = false;  // a defined tensor with no elements has no storage
  std::shared_ptr<const Fp8Scales> fp8_;

  void check_elem_type(DType requested) const;
  // A copy with `scales` attached, after the checks every FP8 form shares (FP8 data, f32 scales beside it).
  Tensor with_fp8_scales(Fp8Scales scales) const;
  static Shape contiguous_strides(const Shape& s);
};

struct Fp8Scales {
  Tensor scale_inv;  // f32, layout given by mode (kernels/fp8.h has the exact shapes)
  ScalingMode mode;
  std::vector<int64_t> rows_per_segment;  // colwise_1x128: its segments (empty: one segment of all rows)
  Tensor segment_counts;  // colwise_1x128 over device counts ([E] i32; rows_per_segment then empty), or undefined
};

// Checks that raise ShapeError / DTypeError / DeviceError naming both sides.
void check_same_shape(const Tensor& a, const Tensor& b, const char* what);
void check_same_dtype(const Tensor& a, const Tensor& b, const char* what);
void check_same_device(const Tensor& a, const Tensor& b, const char* what);
void check_dtype(const Tensor& t, std::initializer_list<DType> allowed, const char* what);

template <>
inline DType dtype_of<float>() {
  return DType::f32;
}
template <>
inline DType dtype_of<double>() {
  return DType::f64;
}
template <>
inline DType dtype_of<bf16>() {
  return DType::bf16;
}
template <>
inline DType dtype_of<int32_t>() {
  return DType::i32;
}
template <>
inline DType dtype_of<int64_t>() {
  return DType::i64;
}
template <>
inline DType dtype_of<uint8_t>() {
  return DType::u8;
}  // also accepted for e4m3/e5m2 data
template <>
inline DType dtype_of<uint16_t>() {
  return DType::bf16;
}  // raw bf16 bits (used by CUDA launchers)

}  // namespace flowmoe

// Runs the statement with `scalar_t` bound to the C++ type of a CPU floating dtype (f32 or f64).
#define FLOWMOE_DISPATCH_CPU_FLOAT(dtype, what, ...)                                     \
  do {                                                                                   \
    switch (dtype) {                                                                     \
      case ::flowmoe::DType::f32: {                                                      \
        using scalar_t = float;                                                          \
        __VA_ARGS__;                                                                     \
        break;                                                                           \
      }                                                                                  \
      case ::flowmoe::DType::f64: {                                                      \
        using scalar_t = double;                                                         \
        __VA_ARGS__;                                                                     \
        break;                                                                           \
      }                                                                                  \
      default:                                                                           \
        FLOWMOE_THROW(::flowmoe::DTypeError, what, " on cpu supports f32 and f64, got ", \
                      ::flowmoe::dtype_name(dtype));                                     \
    }                                                                                    \
  } while (0)
