// Causal self-attention as an autograd primitive. The CPU path recomputes probabilities in its vjp;
// the GPU path keeps the forward's per-row logsumexp in the primitive (one primitive per call) and
// saves the output, as flash-attention's backward needs both.
// Reference: kernels/cpu/attention.cpp. Tests: tests/test_attention.cpp.
#include "kernels/attention.h"
#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const char* what) {
  FLOWMOE_CHECK(q.dim() == 4, ShapeError, what, ": expects q, k, v [B, T, nh, hd], got q ", shape_str(q.shape()));
  check_same_shape(q, k, "causal_attention (q vs k)");
  check_same_shape(q, v, "causal_attention (q vs v)");
  check_same_dtype(q, k, "causal_attention (q vs k)");
  check_same_dtype(q, v, "causal_attention (q vs v)");
  check_same_device(q, k, "causal_attention (q vs k)");
  check_same_device(q, v, "causal_attention (q vs v)");
}

class CausalAttention : public Primitive {
 public:
  const char* name() const override { return "causal_attention"; }
  // q·kᵀ and p·v over the causal half: 2·B·nh·T²·hd; the backward's four GEMMs and one recomputed
  // product, 2.5 times that (flash attention's count).
  double flops(const std::vector<Tensor>& in) const override {
    if (in.empty() || in[0].dim() != 4) return 0;
    const double B = double(in[0].size(0)), T = double(in[0].size(1)), nh = double(in[0].size(2));
    return 2.0 * B * nh * T * T * double(in[0].size(3));
  }
  double vjp_flops(const std::vector<Tensor>& in) const override { return 2.5 * flops(in); }
  bool saves_outputs() const override { return true; }  // the GPU backward reads o (delta = dO·o)

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check_qkv(in[0], in[1], in[2], name());
    Tensor q = in[0].contiguous(), k = in[1].contiguous(), v = in[2].contiguous();
    Tensor out = Tensor::empty(q.shape(), q.dtype(), q.device());
    const Shape& s = q.shape();
    FLOWMOE_DISPATCH_CPU_FLOAT(
        q.dtype(), name(),
        attention_forward_cpu<scalar_t>(out.data<scalar_t>(), q.data<scalar_t>(), k.data<scalar_t>(),
                                        v.data<scalar_t>(), s[0], s[1], s[2], s[3]));
    return {out};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check_qkv(in[0], in[1], in[2], name());
    Tensor q = in[0].contiguous(), k = in[1].contiguous(), v = in[2].contiguous();
    Tensor out = Tensor::empty(q.shape(), q.dtype(), q.device());
    const Shape& s = q.shape();
    lse_ = Tensor::empty({s[0], s[2], s[1]}, DType::f32, q.device());
    attention_forward_cuda(q.dtype(), out.raw_data(), lse_.data<float>(), q.raw_data(), k.raw_data(), v.raw_data(),
                           s[0], s[1], s[2], s[3], current_stream(q.device().index));
    return {out};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>& outs,
                          const std::vector<Tensor>& d_outs, const std::vector<bool>&) override {
    Tensor q = in[0].contiguous(), k = in[1].contiguous(), v = in[2].contiguous();
    Tensor d_out = d_outs[0].contiguous();
    check_same_shape(q, d_out, "causal_attention backward (q vs d_out)");
    check_same_dtype(q, d_out, "causal_attention backward (q vs d_out)");
    Tensor d_q = Tensor::empty(q.shape(), q.dtype(), q.device());
    Tensor d_k = Tensor::empty(q.shape(), q.dtype(), q.device());
    Tensor d_v = Tensor::empty(q.shape(), q.dtype(), q.device());
    const Shape& s = q.shape();
    if (q.device().is_cpu()) {
      FLOWMOE_DISPATCH_CPU_FLOAT(
          q.dtype(), "causal_attention backward",
          attention_backward_cpu<scalar_t>(d_q.data<scalar_t>(), d_k.data<scalar_t>(), d_v.data<scalar_t>(),
                                           d_out.data<scalar_t>(), q.data<scalar_t>(), k.data<scalar_t>(),
                                           v.data<scalar_t>(), s[0], s[1], s[2], s[3]));
      return {d_q, d_k, d_v};
    }
    Tensor out = outs[0].contiguous();
    Tensor delta = Tensor::empty({s[0], s[2], s[1]}, DType::f32, q.device());
    attention_backward_cuda(q.dtype(), d_q.raw_data(), d_k.raw_data(), d_v.raw_data(), delta.data<float>(),
                            d_out.raw_data(), q.raw_data(), k.raw_data(), v.raw_data(), out.raw_data(),
                            lse_.data<float>(), s[0], s[1], s[2], s[3], current_stream(q.device().index));
    return {d_q, d_k, d_v};
  }

 private:
  Tensor lse_;  // [B, nh, T] f32, natural-log softmax normaliser of each query row (GPU only)
};

}  // namespace

Variable causal_attention(const Variable& q, const Variable& k, const Variable& v) {
  return apply(std::make_shared<CausalAttention>(), {q, k, v})[0];
}

}  // namespace flowmoe
