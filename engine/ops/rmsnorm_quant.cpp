// rmsnorm_quantize (engine/ops/rmsnorm_quant.h) as an autograd primitive. It saves x and the weight: its
// backward is rmsnorm's (rstd recomputed from x), the quantize straight-through. The cast is counted in the
// public function, once per call, as quantize_rowwise counts its own.
#include "engine/ops/rmsnorm_quant.h"

#include <memory>

#include "engine/cast_stats.h"
#include "engine/ops/ops.h"
#include "engine/ops/quantize.h"
#include "engine/ops/rmsnorm.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "kernels/rmsnorm_quant.h"

namespace flowmoe {

namespace {

// {x [..., H], weight [H]} -> {q [rows, H] e4m3 with scales, y (keep_y)}.
class RmsnormQuantize : public SharedBodyPrimitive<Primitive> {
 public:
  RmsnormQuantize(double eps, const std::string& site, bool keep_y)
      : eps_(eps), keep_y_(keep_y), what_("rmsnorm_quantize at '" + site + "'") {}
  const char* name() const override { return "rmsnorm_quantize"; }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    const Tensor& x = in[0];
    Tensor d_n = straight_through_grad(d_out[0], x.dtype()).reshape(x.shape());
    if (keep_y_) d_n = tensor_add(d_n, d_out[1].to(x.dtype()));
    std::vector<Tensor> d = rmsnorm_backward(d_n, x, in[1], eps_);
    return {needs[0] ? d[0] : Tensor(), needs[1] ? d[1] : Tensor()};
  }

 private:
  double eps_;
  bool keep_y_;
  std::string what_;

  std::vector<Tensor> run(const std::vector<Tensor>& in, bool cuda) override {
    const int64_t hidden = check_rmsnorm(in[0], in[1], eps_, what_.c_str());
    if (cuda)
      check_dtype(in[0], {DType::f32, DType::bf16}, what_.c_str());
    else
      check_dtype(in[0], {DType::f32, DType::f64}, what_.c_str());
    const Tensor x = in[0].contiguous(), w = in[1].contiguous();
    const Device dev = x.device();
    const int64_t rows = leading_rows(x);
    Tensor q = Tensor::empty({rows, hidden}, DType::e4m3, dev);
    Tensor s = Tensor::empty({rows, fp8_num_blocks(hidden)}, DType::f32, dev);
    Tensor y = keep_y_ ? Tensor::empty(x.shape(), x.dtype(), dev) : Tensor();
    auto* q_ptr = static_cast<uint8_t*>(q.raw_data());
    void* y_ptr = keep_y_ ? y.raw_data() : nullptr;
    if (cuda) {
      rmsnorm_quant_forward_cuda(x.dtype(), y_ptr, q_ptr, s.data<float>(), x.raw_data(), w.raw_data(), rows, hidden,
                                 eps_, current_stream(dev.index));
    } else {
      FLOWMOE_DISPATCH_CPU_FLOAT(
          x.dtype(), name(),
          rmsnorm_quant_forward_cpu<scalar_t>(static_cast<scalar_t*>(y_ptr), q_ptr, s.data<float>(), x.data<scalar_t>(),
                                              w.data<scalar_t>(), rows, hidden, eps_));
    }
    Tensor fp8 = q.with_scales(s, ScalingMode::rowwise_1x128);
    if (keep_y_) return {fp8, y};
    return {fp8};
  }
};

}  // namespace

NormQuantized rmsnorm_quantize(const Variable& x, const Variable& weight, double eps, const std::string& site,
                               bool keep_y) {
  std::vector<Variable> out = apply(std::make_shared<RmsnormQuantize>(eps, site, keep_y), {x, weight});
  note_cast(CastKind::quantize, site);
  return {out[0], keep_y ? out[1] : Variable()};
}

}  // namespace flowmoe
