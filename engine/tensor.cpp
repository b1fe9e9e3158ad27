#include "engine/tensor.h"

#include <cstring>
#include <sstream>

#include "engine/allocator.h"
#include "kernels/common/device_api.h"
#include "kernels/copy.h"

namespace flowmoe {

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

const char* scaling_mode_name(ScalingMode m) {
  switch (m) {
    case ScalingMode::rowwise_1x128:
      return "rowwise_1x128";
    case ScalingMode::colwise_1x128:
      return "colwise_1x128";
    case ScalingMode::block_128x128:
      return "block_128x128";
  }
  return "unknown";
}

Device Device::parse(const std::string& s) {
  if (s == "cpu") return cpu();
  if (s == "cuda") return cuda(0);
  if (s.rfind("cuda:", 0) == 0) {
    try {
      size_t used = 0;
      int i = std::stoi(s.substr(5), &used);
      if (used == s.size() - 5 && i >= 0) return cuda(i);
    } catch (const std::exception&) {
    }
  }
  FLOWMOE_THROW(DeviceError, "unknown device '", s, "' (expected cpu, cuda or cuda:N)");
}

// ---- Storage ----------------------------------------------------------------------------------

Storage::Storage(size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  data_ = device_allocate(nbytes, device);
}
Storage::~Storage() { device_release(data_, device_); }

// ---- construction -----------------------------------------------------------------------------

Shape Tensor::contiguous_strides(const Shape& s) {
  Shape st(s.size());
  int64_t acc = 1;
  for (int i = int(s.size()) - 1; i >= 0; --i) {
    st[size_t(i)] = acc;
    acc *= s[size_t(i)];
  }
  return st;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape) FLOWMOE_CHECK(d >= 0, ShapeError, "negative dimension in shape ", shape_str(shape));
  Tensor t;
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  size_t nbytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  if (nbytes > 0)
    t.storage_ = std::make_shared<Storage>(nbytes, device);
  else
    t.defined_empty_ = true;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.fill_(value);
  return t;
}

Tensor Tensor::from_floats(const std::vector<float>& values, const Shape& shape, DType dtype, Device device) {
  FLOWMOE_CHECK(int64_t(values.size()) == shape_numel(shape), ShapeError, "from_floats: ", values.size(),
                " values for shape ", shape_str(shape));
  Tensor host = empty(shape, dtype, Device::cpu());
  cast_cpu(host.raw_data(), dtype, values.data(), DType::f32, host.numel());
  return host.to(device);
}

Tensor Tensor::from_doubles(const std::vector<double>& values, const Shape& shape, DType dtype, Device device) {
  FLOWMOE_CHECK(int64_t(values.size()) == shape_numel(shape), ShapeError, "from_doubles: ", values.size(),
                " values for shape ", shape_str(shape));
  Tensor host = empty(shape, dtype, Device::cpu());
  cast_cpu(host.raw_data(), dtype, values.data(), DType::f64, host.numel());
  return host.to(device);
}

Tensor Tensor::from_ints(const std::vector<int64_t>& values, const Shape& shape, DType dtype, Device device) {
  FLOWMOE_CHECK(int64_t(values.size()) == shape_numel(shape), ShapeError, "from_ints: ", values.size(),
                " values for shape ", shape_str(shape));
  Tensor host = empty(shape, dtype, Device::cpu());
  cast_cpu(host.raw_data(), dtype, values.data(), DType::i64, host.numel());
  return host.to(device);
}

// ---- queries ----------------------------------------------------------------------------------

int64_t Tensor::size(int d) const {
  int nd = dim();
  int i = d < 0 ? d + nd : d;
  FLOWMOE_CHECK(i >= 0 && i < nd, ShapeError, "dim ", d, " out of range for shape ", shape_str(shape_));
  return shape_[size_t(i)];
}

bool Tensor::is_contiguous() const {
  int64_t acc = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape_[size_t(i)] != 1 && strides_[size_t(i)] != acc) return false;
    acc *= shape_[size_t(i)];
  }
  return true;
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  return std::string(dtype_name(dtype_)) + shape_str(shape_) + " on " + device_.str();
}

void* Tensor::raw_data() const {
  if (!storage_) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_ * int64_t(dtype_size(dtype_));
}

void Tensor::check_elem_type(DType requested) const {
  bool ok = requested == dtype_ || (requested == DType::u8 && is_fp8(dtype_));
  FLOWMOE_CHECK(ok, DTypeError, "data<", dtype_name(requested), ">() on a ", describe());
}

// ---- views ------------------------------------------------------------------------------------

Tensor Tensor::view(const Shape& shape) const {
  FLOWMOE_CHECK(is_contiguous(), ShapeError, "view ", shape_str(shape), " of a non-contiguous ", describe());
  Shape s = shape;
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      FLOWMOE_CHECK(infer < 0, ShapeError, "view ", shape_str(shape), ": more than one -1");
      infer = int(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    FLOWMOE_CHECK(known > 0 && numel() % known == 0, ShapeError, "view ", shape_str(shape), " of ", describe());
    s[size_t(infer)] = numel() / known;
  }
  FLOWMOE_CHECK(shape_numel(s) == numel(), ShapeError, "view ", shape_str(shape), " of ", describe(),
                ": element counts differ");
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  t.fp8_ = nullptr;  // scales describe the original layout only
  return t;
}

Tensor Tensor::reshape(const Shape& shape) const { return is_contiguous() ? view(shape) : contiguous().view(shape); }

Tensor Tensor::transpose(int a, int b) const {
  int nd = dim();
  int ia = a < 0 ? a + nd : a, ib = b < 0 ? b + nd : b;
  FLOWMOE_CHECK(ia >= 0 && ia < nd && ib >= 0 && ib < nd, ShapeError, "transpose(", a, ", ", b, ") of ", describe());
  Tensor t = *this;
  std::swap(t.shape_[size_t(ia)], t.shape_[size_t(ib)]);
  std::swap(t.strides_[size_t(ia)], t.strides_[size_t(ib)]);
  t.fp8_ = nullptr;
  return t;
}

Tensor Tensor::slice(int d, int64_t start, int64_t end) const {
  int nd = dim();
  int i = d < 0 ? d + nd : d;
  FLOWMOE_CHECK(i >= 0 && i < nd, ShapeError, "slice dim ", d, " of ", describe());
  FLOWMOE_CHECK(0 <= start && start <= end && end <= shape_[size_t(i)], ShapeError, "slice [", start, ", ", end,
                ") of dim ", d, " of ", describe());
  Tensor t = *this;
  t.offset_ += start * strides_[size_t(i)];
  t.shape_[size_t(i)] = end - start;
  t.fp8_ = nullptr;
  if (t.numel() == 0) {
    t.storage_ = nullptr;
    t.defined_empty_ = true;
  }
  return t;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  Tensor out = empty(shape_, dtype_, device_);
  if (out.numel() == 0) return out;
  FLOWMOE_CHECK(dim() <= kMaxDims, ShapeError, "contiguous(): more than ", kMaxDims, " dims in ", describe());
  StridedLayout L;
  L.ndim = dim();
  for (int i = 0; i < dim(); ++i) {
    L.shape[i] = shape_[size_t(i)];
    L.strides[i] = strides_[size_t(i)];
  }
  if (device_.is_cuda())
    strided_copy_cuda(out.raw_data(), raw_data(), dtype_size(dtype_), L, current_stream(device_.index));
  else
    strided_copy_cpu(out.raw_data(), raw_data(), dtype_size(dtype_), L);
  return out;
}

Tensor Tensor::clone() const {
  Tensor src = contiguous();
  Tensor out = empty(shape_, dtype_, device_);
  out.copy_(src);
  out.fp8_ = fp8_;
  return out;
}

Tensor Tensor::to(Device device) const {
  if (device == device_) return *this;
  Tensor src = contiguous();
  Tensor out = empty(shape_, dtype_, device);
  out.copy_(src);
  if (fp8_) {
    const Tensor& counts = fp8_->segment_counts;
    out.fp8_ = std::make_shared<Fp8Scales>(Fp8Scales{fp8_->scale_inv.to(device), fp8_->mode, fp8_->rows_per_segment,
                                                     counts.defined() ? counts.to(device) : Tensor()});
  }
  return out;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  Tensor src = contiguous();
  Tensor out = empty(shape_, dtype, device_);
  if (out.numel() == 0) return out;
  if (device_.is_cuda())
    cast_cuda(out.raw_data(), dtype, src.raw_data(), dtype_, numel(), current_stream(device_.index));
  else
    cast_cpu(out.raw_data(), dtype, src.raw_data(), dtype_, numel());
  return out;
}

void Tensor::copy_(const Tensor& src) {
  check_same_shape(*this, src, "copy_");
  check_same_dtype(*this, src, "copy_");
  FLOWMOE_CHECK(is_contiguous(), ShapeError, "copy_ into a non-contiguous ", describe());
  if (numel() == 0) return;
  Tensor s = src.contiguous();
  // Counted here, once for every way a tensor is read to the host: the trainer captures a step as a CUDA
  // graph only after an eager one made no such read, which no capture could replay.
  if (device_.is_cpu() && s.device_.is_cuda()) note_host_sync();
  copy_bytes(raw_data(), device_.is_cuda() ? device_.index : -1, s.raw_data(),
             s.device_.is_cuda() ? s.device_.index : -1, nbytes());
}

void Tensor::fill_(double value) {
  FLOWMOE_CHECK(is_contiguous(), ShapeError, "fill_ of a non-contiguous ", describe());
  if (numel() == 0) return;
  if (device_.is_cuda()) {
    fill_cuda(raw_data(), dtype_, value, numel(), current_stream(device_.index));
  } else {
    std::vector<double> v(size_t(numel()), value);
    cast_cpu(raw_data(), dtype_, v.data(), DType::f64, numel());
  }
}

void Tensor::zero_() { fill_bytes_(0); }

void Tensor::fill_bytes_(uint8_t byte) {
  FLOWMOE_CHECK(is_contiguous(), ShapeError, "fill_bytes_ of a non-contiguous ", describe());
  if (numel() == 0) return;
  if (device_.is_cuda())
    cuda_memset(raw_data(), byte, nbytes(), device_.index);
  else
    std::memset(raw_data(), byte, nbytes());
}

std::vector<double> Tensor::to_doubles() const {
  Tensor h = to(Device::cpu()).contiguous();
  std::vector<double> out(static_cast<size_t>(numel()));
  if (!out.empty()) cast_cpu(out.data(), DType::f64, h.raw_data(), dtype_, numel());
  return out;
}

std::vector<float> Tensor::to_floats() const {
  Tensor h = to(Device::cpu()).contiguous();
  std::vector<float> out(static_cast<size_t>(numel()));
  if (!out.empty()) cast_cpu(out.data(), DType::f32, h.raw_data(), dtype_, numel());
  return out;
}

std::vector<int64_t> Tensor::to_ints() const {
  FLOWMOE_CHECK(!is_floating(dtype_), DTypeError, "to_ints() of a ", describe());
  Tensor h = to(Device::cpu()).contiguous();
  std::vector<int64_t> out(static_cast<size_t>(numel()));
  if (!out.empty()) cast_cpu(out.data(), DType::i64, h.raw_data(), dtype_, numel());
  return out;
}

Tensor Tensor::with_fp8_scales(Fp8Scales scales) const {
  FLOWMOE_CHECK(is_fp8(dtype_), DTypeError, "with_scales on a ", describe(), " (FP8 data expected)");
  FLOWMOE_CHECK(scales.scale_inv.dtype() == DType::f32, DTypeError, "scale_inv must be f32, got ",
                scales.scale_inv.describe());
  check_same_device(*this, scales.scale_inv, "with_scales");
  Tensor t = *this;
  t.fp8_ = std::make_shared<Fp8Scales>(std::move(scales));
  return t;
}

Tensor Tensor::with_scales(const Tensor& scale_inv, ScalingMode mode, std::vector<int64_t> rows_per_segment) const {
  const bool segmented = !rows_per_segment.empty();
  Tensor t = with_fp8_scales(Fp8Scales{scale_inv, mode, std::move(rows_per_segment), Tensor()});
  FLOWMOE_CHECK(!segmented || mode == ScalingMode::colwise_1x128, Error,
                "with_scales: segments apply to colwise_1x128 only, got ", scaling_mode_name(mode));
  return t;
}

Tensor Tensor::with_segment_counts(const Tensor& scale_inv, const Tensor& segment_counts) const {
  FLOWMOE_CHECK(segment_counts.dtype() == DType::i32 && segment_counts.dim() == 1, DTypeError,
                "with_segment_counts: the counts must be [E] i32, got ", segment_counts.describe());
  check_same_device(*this, segment_counts, "with_segment_counts");
  return with_fp8_scales(Fp8Scales{scale_inv, ScalingMode::colwise_1x128, {}, segment_counts});
}

// ---- checks -----------------------------------------------------------------------------------

void check_same_shape(const Tensor& a, const Tensor& b, const char* what) {
  FLOWMOE_CHECK(a.shape() == b.shape(), ShapeError, what, ": shape mismatch ", shape_str(a.shape()), " vs ",
                shape_str(b.shape()));
}
void check_same_dtype(const Tensor& a, const Tensor& b, const char* what) {
  FLOWMOE_CHECK(a.dtype() == b.dtype(), DTypeError, what, ": dtype mismatch ", dtype_name(a.dtype()), " vs ",
                dtype_name(b.dtype()));
}
void check_same_device(const Tensor& a, const Tensor& b, const char* what) {
  FLOWMOE_CHECK(a.device() == b.device(), DeviceError, what, ": device mismatch ", a.device().str(), " vs ",
                b.device().str());
}
void check_dtype(const Tensor& t, std::initializer_list<DType> allowed, const char* what) {
  for (DType d : allowed)
    if (t.dtype() == d) return;
  std::string names;
  for (DType d : allowed) names += std::string(names.empty() ? "" : ", ") + dtype_name(d);
  FLOWMOE_THROW(DTypeError, what, ": dtype ", dtype_name(t.dtype()), " not supported (expected ", names, ")");
}

}  // namespace flowmoe
