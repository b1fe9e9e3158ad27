// Elementwise add / mul / scale / cast and reshape as autograd primitives.
// References: kernels/cpu/elementwise.cpp, kernels/cpu/copy.cpp. Tests: tests/test_elementwise.cpp.
#include "kernels/elementwise.h"
#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

// Both operands must agree in shape, dtype and device before any kernel runs.
void check_binary(const Tensor& a, const Tensor& b, const char* what) {
  check_same_device(a, b, what);
  check_same_dtype(a, b, what);
  check_same_shape(a, b, what);
}

class Binary : public Primitive {
 public:
  explicit Binary(BinaryOp op) : op_(op) {}
  const char* name() const override { return op_ == BinaryOp::add ? "add" : "mul"; }
  bool saves_inputs() const override { return op_ == BinaryOp::mul; }  // add's vjp needs nothing

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check_binary(in[0], in[1], name());
    Tensor a = in[0].contiguous(), b = in[1].contiguous();
    Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        a.dtype(), name(),
        binary_cpu<scalar_t>(op_, out.data<scalar_t>(), a.data<scalar_t>(), b.data<scalar_t>(), a.numel()));
    return {out};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check_binary(in[0], in[1], name());
    Tensor a = in[0].contiguous(), b = in[1].contiguous();
    Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
    binary_cuda(op_, a.dtype(), out.raw_data(), a.raw_data(), b.raw_data(), a.numel(),
                current_stream(a.device().index));
    return {out};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    if (op_ == BinaryOp::add) return {d_out[0], d_out[0]};
    return {needs[0] ? tensor_mul(d_out[0], in[1]) : Tensor(), needs[1] ? tensor_mul(d_out[0], in[0]) : Tensor()};
  }

 private:
  BinaryOp op_;
};

class Scale : public Primitive {
 public:
  explicit Scale(double s) : s_(s) {}
  const char* name() const override { return "scale"; }
  bool saves_inputs() const override { return false; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor a = in[0].contiguous();
    Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(a.dtype(), name(),
                               scale_cpu<scalar_t>(out.data<scalar_t>(), a.data<scalar_t>(), s_, a.numel()));
    return {out};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Tensor a = in[0].contiguous();
    Tensor out = Tensor::empty(a.shape(), a.dtype(), a.device());
    scale_cuda(a.dtype(), out.raw_data(), a.raw_data(), s_, a.numel(), current_stream(a.device().index));
    return {out};
  }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    return {tensor_scale(d_out[0], s_)};
  }

 private:
  double s_;
};

// Cast's kernels live with the tensor copies (kernels/copy.h); Tensor::to(DType) picks the device.
class Cast : public Primitive {
 public:
  explicit Cast(DType to) : to_(to) {}
  const char* name() const override { return "cast"; }
  bool saves_inputs() const override { return false; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    from_ = in[0].dtype();
    return {in[0].to(to_)};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return eval_cpu(in); }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    return {d_out[0].to(from_)};
  }

 private:
  DType to_, from_ = DType::f32;
};

class Reshape : public Primitive {
 public:
  explicit Reshape(Shape shape) : shape_(std::move(shape)) {}
  const char* name() const override { return "reshape"; }
  bool saves_inputs() const override { return false; }
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    from_ = in[0].shape();
    return {in[0].reshape(shape_)};
  }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return eval_cpu(in); }
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    return {d_out[0].reshape(from_)};
  }

 private:
  Shape shape_, from_;
};

}  // namespace

Tensor tensor_add(const Tensor& a, const Tensor& b) {
  Binary p(BinaryOp::add);
  return eval(p, {a, b})[0];
}
Tensor tensor_mul(const Tensor& a, const Tensor& b) {
  Binary p(BinaryOp::mul);
  return eval(p, {a, b})[0];
}
Tensor tensor_scale(const Tensor& a, double s) {
  Scale p(s);
  return eval(p, {a})[0];
}

Variable add(const Variable& a, const Variable& b) { return apply(std::make_shared<Binary>(BinaryOp::add), {a, b})[0]; }
Variable mul(const Variable& a, const Variable& b) { return apply(std::make_shared<Binary>(BinaryOp::mul), {a, b})[0]; }
Variable scale(const Variable& a, double s) { return apply(std::make_shared<Scale>(s), {a})[0]; }
Variable cast(const Variable& a, DType to) { return apply(std::make_shared<Cast>(to), {a})[0]; }
Variable reshape(const Variable& x, const Shape& shape) { return apply(std::make_shared<Reshape>(shape), {x})[0]; }

}  // namespace flowmoe
