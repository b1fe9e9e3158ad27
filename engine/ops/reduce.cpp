// sum / mean over all elements as autograd primitives; the vjp broadcasts the scalar gradient back
// to the input's shape and dtype (ReduceBackward). References: kernels/cpu/reduce.cpp.
// Tests: tests/test_reduce.cpp.
#include "kernels/reduce.h"
#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

const char* reduce_name(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "mean"; }

// inputs {d_out []} -> {d_x} of the shape and dtype the forward saw.
class ReduceBackward : public BackwardPrimitive {
 public:
  ReduceBackward(ReduceOp op, Shape shape, DType dtype) : op_(op), shape_(std::move(shape)), dtype_(dtype) {}
  const char* name() const override { return op_ == ReduceOp::sum ? "sum_backward" : "mean_backward"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    FLOWMOE_CHECK(in[0].numel() == 1, ShapeError, name(), ": gradient must have one element, got ", in[0].describe());
    FLOWMOE_CHECK(in[0].dtype() == dtype_, DTypeError, name(), ": gradient ", in[0].describe(), " for a ",
                  dtype_name(dtype_), " input");
    Tensor d_x = Tensor::empty(shape_, dtype_, in[0].device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        dtype_, name(),
        reduce_backward_cpu<scalar_t>(op_, d_x.data<scalar_t>(), in[0].data<scalar_t>()[0], d_x.numel()));
    return {d_x};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    FLOWMOE_CHECK(in[0].numel() == 1, ShapeError, name(), ": gradient must have one element, got ", in[0].describe());
    check_dtype(in[0], {DType::f32}, name());  // on the GPU the reduction's output is f32
    Tensor d_x = Tensor::empty(shape_, dtype_, in[0].device());
    reduce_backward_cuda(op_, dtype_, d_x.raw_data(), in[0].data<float>(), d_x.numel(),
                         current_stream(in[0].device().index));
    return {d_x};
  }

 private:
  ReduceOp op_;
  Shape shape_;
  DType dtype_;
};

class Reduce : public Primitive {
 public:
  explicit Reduce(ReduceOp op) : op_(op) {}
  const char* name() const override { return reduce_name(op_); }
  bool saves_inputs() const override { return false; }  // the vjp needs only x's shape and dtype

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Tensor x = in[0].contiguous();
    shape_ = x.shape(), dtype_ = x.dtype();
    Tensor out = Tensor::empty({}, x.dtype(), x.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(x.dtype(), name(),
                               out.data<scalar_t>()[0] = reduce_cpu<scalar_t>(op_, x.data<scalar_t>(), x.numel()));
    return {out};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Tensor x = in[0].contiguous();
    shape_ = x.shape(), dtype_ = x.dtype();
    Tensor out = Tensor::empty({}, DType::f32, x.device());  // f32 for f32 and bf16 input
    Tensor partials = Tensor::empty({kReducePartials}, DType::f32, x.device());
    reduce_cuda(op_, x.dtype(), out.data<float>(), partials.data<float>(), x.raw_data(), x.numel(),
                current_stream(x.device().index));
    return {out};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    ReduceBackward p(op_, shape_, dtype_);
    return {eval(p, {d_out[0]})[0]};
  }

 private:
  ReduceOp op_;
  Shape shape_;
  DType dtype_ = DType::f32;
};

}  // namespace

Variable sum(const Variable& x) { return apply(std::make_shared<Reduce>(ReduceOp::sum), {x})[0]; }
Variable mean(const Variable& x) { return apply(std::make_shared<Reduce>(ReduceOp::mean), {x})[0]; }

}  // namespace flowmoe
