// swiglu(gate_up) = silu(gate_up[..., :F]) * gate_up[..., F:] as an autograd primitive, with its
// backward as a primitive on the same device; with row counts, over the rows they cover only.
// Reference: kernels/cpu/swiglu.cpp. Tests: tests/test_swiglu.cpp.
#include "kernels/swiglu.h"

#include <algorithm>

#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

// The last dim holds [gate | up] and must be even; returns F.
int64_t swiglu_width(const Tensor& gate_up, const char* what) {
  FLOWMOE_CHECK(gate_up.dim() >= 1, ShapeError, what, ": gate_up must have a last dim [..., 2F], got ",
                gate_up.describe());
  int64_t two_f = gate_up.size(-1);
  FLOWMOE_CHECK(two_f % 2 == 0, ShapeError, what, ": gate_up's last dim must be even (2F), got ", gate_up.describe());
  return two_f / 2;
}

Shape out_shape(const Tensor& gate_up, int64_t F) {
  Shape s = gate_up.shape();
  s.back() = F;
  return s;
}

// d_gate_up from {d_out [..., F], gate_up [..., 2F]}.
class SwigluBackward : public BackwardPrimitive {
 public:
  explicit SwigluBackward(Tensor row_counts) : row_counts_(std::move(row_counts)) {}
  const char* name() const override { return "swiglu_backward"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    int64_t F = check(in);
    Tensor d_out = in[0].contiguous(), gate_up = in[1].contiguous();
    Tensor d_gate_up = Tensor::empty(gate_up.shape(), gate_up.dtype(), gate_up.device());
    const int64_t rows = counted_host_rows(gate_up, row_counts_, name(), nullptr);
    FLOWMOE_DISPATCH_CPU_FLOAT(gate_up.dtype(), name(),
                               swiglu_backward_cpu<scalar_t>(d_gate_up.data<scalar_t>(), d_out.data<scalar_t>(),
                                                             gate_up.data<scalar_t>(), rows, F));
    return {d_gate_up};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    int64_t F = check(in);
    check_dtype(in[1], {DType::f32, DType::bf16}, name());
    Tensor d_out = in[0].contiguous(), gate_up = in[1].contiguous();
    Tensor d_gate_up = Tensor::empty(gate_up.shape(), gate_up.dtype(), gate_up.device());
    CountedRows counted;
    const int64_t rows = counted_host_rows(gate_up, row_counts_, name(), &counted);
    swiglu_backward_cuda(gate_up.dtype(), d_gate_up.raw_data(), d_out.raw_data(), gate_up.raw_data(), rows, F,
                         current_stream(gate_up.device().index), counted);
    return {d_gate_up};
  }

 private:
  static int64_t check(const std::vector<Tensor>& in) {
    check_same_dtype(in[0], in[1], "swiglu_backward (d_out vs gate_up)");
    int64_t F = swiglu_width(in[1], "swiglu_backward");
    FLOWMOE_CHECK(in[0].shape() == out_shape(in[1], F), ShapeError, "swiglu_backward: d_out ", in[0].describe(),
                  " does not match gate_up ", in[1].describe());
    return F;
  }

  Tensor row_counts_;
};

class Swiglu : public Primitive {
 public:
  explicit Swiglu(Tensor row_counts) : row_counts_(std::move(row_counts)) {}
  const char* name() const override { return "swiglu"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    int64_t F = swiglu_width(in[0], name());
    Tensor gate_up = in[0].contiguous();
    Tensor out = Tensor::empty(out_shape(gate_up, F), gate_up.dtype(), gate_up.device());
    const int64_t rows = counted_host_rows(gate_up, row_counts_, name(), nullptr);
    FLOWMOE_DISPATCH_CPU_FLOAT(gate_up.dtype(), name(),
                               swiglu_forward_cpu<scalar_t>(out.data<scalar_t>(), gate_up.data<scalar_t>(), rows, F));
    return {out};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    int64_t F = swiglu_width(in[0], name());
    check_dtype(in[0], {DType::f32, DType::bf16}, name());
    Tensor gate_up = in[0].contiguous();
    Tensor out = Tensor::empty(out_shape(gate_up, F), gate_up.dtype(), gate_up.device());
    CountedRows counted;
    const int64_t rows = counted_host_rows(gate_up, row_counts_, name(), &counted);
    swiglu_forward_cuda(gate_up.dtype(), out.raw_data(), gate_up.raw_data(), rows, F,
                        current_stream(gate_up.device().index), counted);
    return {out};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    SwigluBackward bwd(row_counts_);
    return {eval(bwd, {d_out[0], in[0]})[0]};
  }

 private:
  Tensor row_counts_;
};

}  // namespace

int64_t counted_host_rows(const Tensor& x, const Tensor& row_counts, const char* what, CountedRows* counted) {
  const int64_t rows = leading_rows(x);
  if (!row_counts.defined()) return rows;
  FLOWMOE_CHECK(x.dim() == 2, ShapeError, what, ": row counts need a 2-D [M, ...], got ", x.describe());
  FLOWMOE_CHECK(row_counts.dim() == 1 && row_counts.dtype() == DType::i32 && row_counts.is_contiguous(), ShapeError,
                what, ": row counts must be a contiguous [E] i32, got ", row_counts.describe());
  FLOWMOE_CHECK(row_counts.device() == x.device(), DeviceError, what, ": row counts on ", row_counts.device().str(),
                ", rows on ", x.device().str());
  if (row_counts.device().is_cuda()) {
    if (counted) *counted = {row_counts.data<int32_t>(), int(row_counts.numel())};
    return rows;
  }
  int64_t sum = 0;
  const int32_t* c = row_counts.data<int32_t>();
  for (int64_t i = 0; i < row_counts.numel(); ++i) sum += c[i];
  return std::min(rows, sum);
}

Variable swiglu(const Variable& gate_up, const Tensor& row_counts) {
  return apply(std::make_shared<Swiglu>(row_counts), {gate_up})[0];
}

}  // namespace flowmoe
