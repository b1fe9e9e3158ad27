// Causal self-attention as an autograd primitive. The CPU path recomputes probabilities in its vjp;
// the GPU path keeps the forward's per-row logsumexp in the primitive (one primitive per call) and
// saves the output, as flash-attention's backward needs both.
// v may be narrower than q and k (MLA's value head, layers/mla.h): the CPU kernels take its own width; the CUDA
// kernels take the widths of attention_value_width_cuda (one width up to 128, or q/k heads up to 192 with v heads
// up to 128), so the GPU path pads v with zero columns to that width, runs them, and keeps the output's first v
// columns (the padded columns of o are P·0 = 0, so dO·o, the backward's delta, is unchanged).
// On the GPU the backend (model.attention_kernel) is resolved once per call, in its forward (use_cudnn), and the
// backward runs on the same one: cuDNN's fused SDPA (kernels/attention_cudnn.h) or the flash kernels, on the same
// padded operands and the same [B, nh, T] natural-log lse.
// Reference: kernels/cpu/attention.cpp. Tests: tests/test_attention.cpp, tests/test_attention_cudnn.cpp.
#include "kernels/attention.h"
#include "engine/ops/ops.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

namespace {

void check_qkv(const Tensor& q, const Tensor& k, const Tensor& v, const char* what) {
  FLOWMOE_CHECK(q.dim() == 4, ShapeError, what, ": expects q, k, v [B, T, nh, hd], got q ", shape_str(q.shape()));
  check_same_shape(q, k, "causal_attention (q vs k)");
  FLOWMOE_CHECK(
      v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2) && v.size(3) >= 1,
      ShapeError, what, ": v ", shape_str(v.shape()), " must be [B, T, nh, v_hd] for q ", shape_str(q.shape()));
  check_same_dtype(q, k, "causal_attention (q vs k)");
  check_same_dtype(q, v, "causal_attention (q vs v)");
  check_same_device(q, k, "causal_attention (q vs k)");
  check_same_device(q, v, "causal_attention (q vs v)");
}

// The width the CUDA kernels run v at (module comment), for q [B, T, nh, hd] and v [B, T, nh, v_hd].
int64_t cuda_value_width(const Tensor& q, const Tensor& v, const char* what) {
  const int64_t width = attention_value_width_cuda(q.size(3), v.size(3));
  FLOWMOE_CHECK(width > 0, ShapeError, what, ": q ", shape_str(q.shape()), " with v ", shape_str(v.shape()),
                " is no shape the CUDA kernels take (one head width up to ", kAttentionMaxHeadDimCuda,
                ", v no wider than q; or q, k heads up to ", kAttentionMaxWideHeadDimCuda, " with v heads up to ",
                kAttentionMaxHeadDimCuda, ", multiples of 8, in bf16)");
  return width;
}

// x [.., d] as [.., width] with zero columns after its d.
Tensor pad_last(const Tensor& x, int64_t width) {
  const int64_t d = x.size(x.dim() - 1), n = x.numel() / d;
  Tensor cols = Tensor::zeros({width, n}, x.dtype(), x.device());
  cols.slice(0, 0, d).copy_(x.contiguous().reshape({n, d}).transpose(0, 1));
  Shape shape = x.shape();
  shape.back() = width;
  return cols.transpose(0, 1).contiguous().reshape(shape);
}
Tensor narrow_last(const Tensor& x, int64_t d) { return x.slice(x.dim() - 1, 0, d).contiguous(); }

AttentionCudnnShape cudnn_shape(const Tensor& q, int64_t v_width) {
  return {q.size(0), q.size(1), q.size(2), q.size(3), v_width};
}

// Whether this call runs on cuDNN: `backend` against this build, the dtype and the shape (q and v at v_width) on this
// device. automatic takes cuDNN wherever it runs the call; cudnn insists, naming the key when it cannot.
bool use_cudnn(AttentionBackend backend, const Tensor& q, int64_t v_width) {
  if (backend == AttentionBackend::flash) return false;
  const bool bf16 = q.dtype() == DType::bf16;
  if (backend == AttentionBackend::automatic) return bf16 && attention_cudnn_supports(cudnn_shape(q, v_width));
  FLOWMOE_CHECK(bf16, DTypeError, "causal_attention: model.attention_kernel=cudnn runs bf16 only, got ",
                dtype_name(q.dtype()));
  std::string why;
  FLOWMOE_CHECK(attention_cudnn_supports(cudnn_shape(q, v_width), &why), Error,
                "causal_attention: model.attention_kernel=cudnn cannot run q ", shape_str(q.shape()), " with v width ",
                v_width, ": ", why);
  return true;
}

// cuDNN's workspace for one execution, from the engine's allocator (an empty tensor when none is needed).
Tensor cudnn_workspace(const AttentionCudnnShape& shape, bool backward, Device device) {
  return Tensor::empty({attention_cudnn_workspace_bytes(shape, backward)}, DType::u8, device);
}

class CausalAttention : public Primitive {
 public:
  explicit CausalAttention(AttentionBackend backend) : backend_(backend) {}
  const char* name() const override { return "causal_attention"; }
  // q·kᵀ and p·v over the causal half: 2·B·nh·T²·hd; the backward's four GEMMs and one recomputed
  // product, 2.5 times that (flash attention's count).
  double flops(const std::vector<Tensor>& in) const override {
    if (in.empty() || in[0].dim() != 4) return 0;
    const double B = double(in[0].size(0)), T = double(in[0].size(1)), nh = double(in[0].size(2));
    const double dv = in.size() > 2 && in[2].dim() == 4 ? double(in[2].size(3)) : double(in[0].size(3));
    return B * nh * T * T * (double(in[0].size(3)) + dv);
  }
  double vjp_flops(const std::vector<Tensor>& in) const override { return 2.5 * flops(in); }
  bool saves_outputs() const override { return true; }  // the GPU backward reads o (delta = dO·o)

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    check_qkv(in[0], in[1], in[2], name());
    Tensor q = in[0].contiguous(), k = in[1].contiguous(), v = in[2].contiguous();
    Tensor out = Tensor::empty(v.shape(), q.dtype(), q.device());
    const Shape& s = q.shape();
    FLOWMOE_DISPATCH_CPU_FLOAT(
        q.dtype(), name(),
        attention_forward_cpu<scalar_t>(out.data<scalar_t>(), q.data<scalar_t>(), k.data<scalar_t>(),
                                        v.data<scalar_t>(), s[0], s[1], s[2], s[3], v.size(3)));
    return {out};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    check_qkv(in[0], in[1], in[2], name());
    Tensor q = in[0].contiguous(), k = in[1].contiguous(), v = in[2].contiguous();
    const Shape& s = q.shape();
    const int64_t v_hd = v.size(3), v_width = cuda_value_width(q, v, name());
    if (v_hd != v_width) v = pad_last(v, v_width);
    Tensor out = Tensor::empty({s[0], s[1], s[2], v_width}, q.dtype(), q.device());
    lse_ = Tensor::empty({s[0], s[2], s[1]}, DType::f32, q.device());
    cudaStream_t stream = current_stream(q.device().index);
    cudnn_ = use_cudnn(backend_, q, v_width);
    if (cudnn_) {
      const AttentionCudnnShape shape = cudnn_shape(q, v_width);
      Tensor workspace = cudnn_workspace(shape, false, q.device());
      attention_forward_cudnn(out.raw_data(), lse_.data<float>(), q.raw_data(), k.raw_data(), v.raw_data(), shape,
                              workspace.raw_data(), stream);
    } else {
      attention_forward_cuda(q.dtype(), out.raw_data(), lse_.data<float>(), q.raw_data(), k.raw_data(), v.raw_data(),
                             s[0], s[1], s[2], s[3], v_width, stream);
    }
    return {v_hd == v_width ? out : narrow_last(out, v_hd)};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>& outs,
                          const std::vector<Tensor>& d_outs, const std::vector<bool>&) override {
    Tensor q = in[0].contiguous(), k = in[1].contiguous(), v = in[2].contiguous();
    Tensor d_out = d_outs[0].contiguous();
    check_same_shape(v, d_out, "causal_attention backward (v vs d_out)");
    check_same_dtype(q, d_out, "causal_attention backward (q vs d_out)");
    Tensor d_q = Tensor::empty(q.shape(), q.dtype(), q.device());
    Tensor d_k = Tensor::empty(q.shape(), q.dtype(), q.device());
    const Shape& s = q.shape();
    const int64_t v_hd = v.size(3);
    if (q.device().is_cpu()) {
      Tensor d_v = Tensor::empty(v.shape(), q.dtype(), q.device());
      FLOWMOE_DISPATCH_CPU_FLOAT(
          q.dtype(), "causal_attention backward",
          attention_backward_cpu<scalar_t>(d_q.data<scalar_t>(), d_k.data<scalar_t>(), d_v.data<scalar_t>(),
                                           d_out.data<scalar_t>(), q.data<scalar_t>(), k.data<scalar_t>(),
                                           v.data<scalar_t>(), s[0], s[1], s[2], s[3], v_hd));
      return {d_q, d_k, d_v};
    }
    Tensor out = outs[0].contiguous();
    const int64_t v_width = cuda_value_width(q, v, "causal_attention backward");
    if (v_hd != v_width) {  // the forward's padded operands again (module comment)
      v = pad_last(v, v_width);
      out = pad_last(out, v_width);
      d_out = pad_last(d_out, v_width);
    }
    Tensor d_v = Tensor::empty({s[0], s[1], s[2], v_width}, q.dtype(), q.device());
    cudaStream_t stream = current_stream(q.device().index);
    if (cudnn_) {
      const AttentionCudnnShape shape = cudnn_shape(q, v_width);
      Tensor workspace = cudnn_workspace(shape, true, q.device());
      attention_backward_cudnn(d_q.raw_data(), d_k.raw_data(), d_v.raw_data(), d_out.raw_data(), q.raw_data(),
                               k.raw_data(), v.raw_data(), out.raw_data(), lse_.data<float>(), shape,
                               workspace.raw_data(), stream);
    } else {
      Tensor delta = Tensor::empty({s[0], s[2], s[1]}, DType::f32, q.device());
      attention_backward_cuda(q.dtype(), d_q.raw_data(), d_k.raw_data(), d_v.raw_data(), delta.data<float>(),
                              d_out.raw_data(), q.raw_data(), k.raw_data(), v.raw_data(), out.raw_data(),
                              lse_.data<float>(), s[0], s[1], s[2], s[3], v_width, stream);
    }
    return {d_q, d_k, v_hd == v_width ? d_v : narrow_last(d_v, v_hd)};
  }

 private:
  AttentionBackend backend_;
  bool cudnn_ = false;  // the forward ran on cuDNN, so the backward does too (GPU only)
  Tensor lse_;          // [B, nh, T] f32, natural-log softmax normaliser of each query row (GPU only)
};

}  // namespace

Variable causal_attention(const Variable& q, const Variable& k, const Variable& v, AttentionBackend backend) {
  return apply(std::make_shared<CausalAttention>(backend), {q, k, v})[0];
}

}  // namespace flowmoe
