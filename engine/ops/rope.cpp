// Rotary position embedding as an autograd primitive; its vjp is the same primitive rotating the
// other way. Reference: kernels/cpu/rope.cpp. Tests: tests/test_rope.cpp.
#include <cmath>

#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"
#include "kernels/rope.h"

namespace flowmoe {

namespace {

class Rope : public Primitive {
 public:
  Rope(double theta, int64_t pos_offset, bool inverse) : theta_(theta), pos_offset_(pos_offset), inverse_(inverse) {}
  const char* name() const override { return inverse_ ? "rope_backward" : "rope"; }
  bool saves_inputs() const override { return false; }  // a rotation's vjp needs only the angles

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check(in[0]);
    Tensor x = in[0].contiguous();
    Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
    const Shape& s = x.shape();
    FLOWMOE_DISPATCH_CPU_FLOAT(x.dtype(), name(), {
      if (inverse_)
        rope_backward_cpu<scalar_t>(out.data<scalar_t>(), x.data<scalar_t>(), s[0], s[1], s[2], s[3], theta_,
                                    pos_offset_);
      else
        rope_forward_cpu<scalar_t>(out.data<scalar_t>(), x.data<scalar_t>(), s[0], s[1], s[2], s[3], theta_,
                                   pos_offset_);
    });
    return {out};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check(in[0]);
    Tensor x = in[0].contiguous();
    Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
    const Shape& s = x.shape();
    cudaStream_t stream = current_stream(x.device().index);
    if (inverse_)
      rope_backward_cuda(x.dtype(), out.raw_data(), x.raw_data(), s[0], s[1], s[2], s[3], theta_, pos_offset_, stream);
    else
      rope_forward_cuda(x.dtype(), out.raw_data(), x.raw_data(), s[0], s[1], s[2], s[3], theta_, pos_offset_, stream);
    return {out};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    Rope back(theta_, pos_offset_, !inverse_);
    return {eval(back, {d_out[0]})[0]};
  }

 private:
  double theta_;
  int64_t pos_offset_;
  bool inverse_;

  void check(const Tensor& x) const {
    FLOWMOE_CHECK(x.dim() == 4, ShapeError, name(), ": expects x [B, T, nh, hd], got ", shape_str(x.shape()));
    FLOWMOE_CHECK(x.size(3) % 2 == 0, ShapeError, name(), ": head_dim must be even (pairs are rotated), got ",
                  x.size(3), " in x ", shape_str(x.shape()));
    FLOWMOE_CHECK(theta_ > 0 && std::isfinite(theta_), Error, name(), ": theta must be positive and finite, got ",
                  theta_);
  }
};

}  // namespace

Variable rope(const Variable& x, double theta, int64_t pos_offset) {
  return apply(std::make_shared<Rope>(theta, pos_offset, false), {x})[0];
}

}  // namespace flowmoe
