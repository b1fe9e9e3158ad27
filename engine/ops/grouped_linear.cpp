// grouped_linear as an autograd primitive (see engine/ops/grouped_linear.h), and read_counts_once.
//   y_e = x_e · w_eᵀ;  vjp: d_x_e = d_y_e · w_e,  d_w_e = d_y_eᵀ · x_e  (0 for an expert with no rows)
// Reference: kernels/cpu/grouped_linear.cpp. CUDA: kernels/cuda/grouped_linear.cu. Tests:
// tests/test_grouped_linear.cpp.
#include "engine/ops/grouped_linear.h"

#include <memory>
#include <utility>

#include "engine/op_tensor_hook.h"
#include "kernels/common/device_api.h"
#include "kernels/grouped_gemm_device.h"
#include "kernels/grouped_linear.h"

namespace flowmoe {

std::vector<int64_t> read_counts_once(const Tensor& padded_tokens_per_expert) {
  const Tensor& c = padded_tokens_per_expert;
  FLOWMOE_CHECK(c.dim() == 1 && (c.dtype() == DType::i32 || c.dtype() == DType::i64), DTypeError,
                "read_counts_once: expected per-expert counts [L] i32 or i64, got ", c.describe());
  // The device -> host copy synchronises the engine stream and counts itself (Tensor::copy_): this is
  // the layer's one sync.
  return c.to_ints();
}

double grouped_gemm_flops(const std::vector<int64_t>& padded_tokens_per_expert, const Tensor& weight) {
  if (weight.dim() != 3) return 0;
  double rows = 0;
  for (int64_t r : padded_tokens_per_expert) rows += double(r);
  return 2.0 * rows * double(weight.size(1)) * double(weight.size(2));
}

void check_device_counts(const Tensor& counts, const Tensor& x, const std::string& what, int64_t num_experts) {
  const std::string want = num_experts < 0 ? "E" : std::to_string(num_experts);
  FLOWMOE_CHECK(counts.dtype() == DType::i32, DTypeError, what, ": the device counts ", counts.describe(),
                " must be a contiguous [", want, "] i32");
  FLOWMOE_CHECK(counts.dim() == 1 && counts.is_contiguous() && (num_experts < 0 || counts.numel() == num_experts),
                ShapeError, what, ": the device counts ", counts.describe(), " must be a contiguous [", want, "] i32");
  check_same_device(x, counts, (what + " (data vs expert counts)").c_str());
}

double grouped_gemm_flops(const ExpertCounts& counts, const Tensor& x, const Tensor& weight) {
  if (counts.host_known()) return grouped_gemm_flops(counts.host, weight);
  return grouped_gemm_flops(std::vector<int64_t>{x.dim() >= 1 ? x.size(0) : 0}, weight);
}

namespace {

struct Dims {
  int64_t num_experts, m_total, n, k;
};

// Inputs {x [M_total,K], weight [E,N,K]}; throws naming both shapes (or the counts) when they disagree.
Dims check_inputs(const Tensor& x, const Tensor& w, const std::vector<int64_t>& rows) {
  FLOWMOE_CHECK(x.dim() == 2 && w.dim() == 3, ShapeError, "grouped_linear: x ", shape_str(x.shape()), " and weight ",
                shape_str(w.shape()), ": x must be [M_total, K] and weight [E, N, K]");
  FLOWMOE_CHECK(x.size(1) == w.size(2), ShapeError, "grouped_linear: x ", shape_str(x.shape()), " and weight ",
                shape_str(w.shape()), " disagree on in-features K (", x.size(1), " vs ", w.size(2), ")");
  FLOWMOE_CHECK(int64_t(rows.size()) == w.size(0), ShapeError, "grouped_linear: padded_tokens_per_expert has ",
                rows.size(), " entries but weight ", shape_str(w.shape()), " has ", w.size(0), " experts");
  Dims d{w.size(0), x.size(0), w.size(1), w.size(2)};
  check_grouped_rows(rows.data(), d.num_experts, d.m_total, "grouped_linear");
  return d;
}

void check_gpu_dtypes(const Tensor& x, const Tensor& w) {
  check_dtype(x, {DType::bf16, DType::f32}, "grouped_linear x on cuda");
  FLOWMOE_CHECK(w.dtype() == DType::f32 || w.dtype() == x.dtype(), DTypeError, "grouped_linear: weight ", w.describe(),
                " must be f32 or x's dtype (x ", x.describe(), ")");
}

class GroupedLinear : public Primitive {
 public:
  GroupedLinear(ExpertCounts counts, std::string weight_name)
      : counts_(std::move(counts)), weight_name_(std::move(weight_name)) {}
  const char* name() const override { return "grouped_linear"; }
  double flops(const std::vector<Tensor>& in) const override {
    return in.size() < 2 ? 0 : grouped_gemm_flops(counts_, in[0], in[1]);
  }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Dims d = check_inputs(in[0], in[1], counts_.host);
    check_same_dtype(in[0], in[1], "grouped_linear (x vs weight)");
    Tensor x = in[0].contiguous(), w = in[1].contiguous();
    Tensor y = Tensor::empty({d.m_total, d.n}, x.dtype(), x.device());
    FLOWMOE_DISPATCH_CPU_FLOAT(
        x.dtype(), name(),
        grouped_linear_forward_cpu<scalar_t>(x.data<scalar_t>(), w.data<scalar_t>(), y.data<scalar_t>(),
                                             counts_.host.data(), d.num_experts, d.m_total, d.n, d.k));
    return {y};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    if (counts_.on_device()) return eval_gpu_device_counts(in);
    Dims d = check_inputs(in[0], in[1], counts_.host);
    check_gpu_dtypes(in[0], in[1]);
    Tensor x = in[0].contiguous();
    w_compute_ = in[1].to(x.dtype()).contiguous();  // the one cast of this call; the vjp reuses it
    Tensor y = Tensor::empty({d.m_total, d.n}, x.dtype(), x.device());
    grouped_linear_forward_cuda(x.dtype(), x.raw_data(), w_compute_.raw_data(), y.raw_data(), counts_.host.data(),
                                d.num_experts, d.m_total, d.n, d.k, current_stream(x.device().index));
    return {y};
  }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    if (counts_.on_device()) return vjp_device_counts(in, d_out, needs);
    const Tensor &x_in = in[0], &w_in = in[1];
    Dims d = check_inputs(x_in, w_in, counts_.host);
    check_same_dtype(d_out[0], x_in, "grouped_linear backward (d_y vs x)");
    FLOWMOE_CHECK(d_out[0].shape() == (Shape{d.m_total, d.n}), ShapeError, "grouped_linear backward: d_y ",
                  d_out[0].describe(), " does not match y [", d.m_total, ", ", d.n, "]");
    Tensor x = x_in.contiguous(), dy = d_out[0].contiguous();
    if (needs[1] && op_tensor_hook_installed())
      hand_op_tensors(weight_name_ + " wgrad", {x, dy}, counts_.host);  // the wgrad operands
    Tensor dx, dw;
    if (x.device().is_cpu()) {
      Tensor w = w_in.contiguous();
      FLOWMOE_DISPATCH_CPU_FLOAT(x.dtype(), "grouped_linear backward", {
        if (needs[0]) {
          dx = Tensor::empty(x.shape(), x.dtype());
          grouped_linear_dgrad_cpu<scalar_t>(dy.data<scalar_t>(), w.data<scalar_t>(), dx.data<scalar_t>(),
                                             counts_.host.data(), d.num_experts, d.m_total, d.n, d.k);
        }
        if (needs[1]) {
          dw = Tensor::empty(w.shape(), w.dtype());
          grouped_linear_wgrad_cpu<scalar_t>(x.data<scalar_t>(), dy.data<scalar_t>(), dw.data<scalar_t>(),
                                             counts_.host.data(), d.num_experts, d.n, d.k, false);
        }
      });
      return {dx, dw};
    }
    const Device dev = x.device();
    if (cuda_current_device() != dev.index) cuda_set_device(dev.index);  // vjps run outside eval()
    cudaStream_t stream = current_stream(dev.index);
    // Released here, so the copy does not outlive this backward (a retained graph casts again).
    Tensor w = w_compute_.defined() ? std::exchange(w_compute_, Tensor()) : w_in.to(x.dtype()).contiguous();
    if (needs[0]) {
      dx = Tensor::empty(x.shape(), x.dtype(), dev);
      grouped_linear_dgrad_cuda(x.dtype(), dy.raw_data(), w.raw_data(), dx.raw_data(), counts_.host.data(),
                                d.num_experts, d.m_total, d.n, d.k, stream);
    }
    if (needs[1]) {
      // f32 straight from the GEMM epilogue, whatever the weight's dtype (a bf16 weight's leaf keeps an f32
      // gradient: Variable::store_as).
      dw = Tensor::empty(w_in.shape(), DType::f32, dev);
      grouped_linear_wgrad_cuda(x.dtype(), x.raw_data(), dy.raw_data(), dw.data<float>(), counts_.host.data(),
                                d.num_experts, d.m_total, d.n, d.k, false, stream);
    }
    return {dx, dw};
  }

 private:
  // The one-launch GEMMs on the device counts: the host never learns the rows.
  std::vector<Tensor> eval_gpu_device_counts(const std::vector<Tensor>& in) {
    const Dims d = check_device_inputs(in[0], in[1]);
    Tensor x = in[0].contiguous();
    w_compute_ = in[1].to(x.dtype()).contiguous();
    Tensor y = Tensor::empty({d.m_total, d.n}, x.dtype(), x.device());
    Tensor ws = grouped_gemm_device_workspace(x, d.num_experts);
    grouped_gemm_fprop_device_cuda(x.dtype(), x.raw_data(), w_compute_.raw_data(), y.raw_data(),
                                   counts_.device.data<int32_t>(), d.num_experts, d.m_total, d.n, d.k, ws.raw_data(),
                                   size_t(ws.numel()), current_stream(x.device().index), !counts_.tail_unread);
    return {y};
  }

  std::vector<Tensor> vjp_device_counts(const std::vector<Tensor>& in, const std::vector<Tensor>& d_out,
                                        const std::vector<bool>& needs) {
    const Dims d = check_device_inputs(in[0], in[1]);
    check_same_dtype(d_out[0], in[0], "grouped_linear backward (d_y vs x)");
    FLOWMOE_CHECK(d_out[0].shape() == (Shape{d.m_total, d.n}), ShapeError, "grouped_linear backward: d_y ",
                  d_out[0].describe(), " does not match y [", d.m_total, ", ", d.n, "]");
    const Device dev = in[0].device();
    if (cuda_current_device() != dev.index) cuda_set_device(dev.index);  // vjps run outside eval()
    cudaStream_t stream = current_stream(dev.index);
    Tensor x = in[0].contiguous(), dy = d_out[0].contiguous();
    Tensor w = w_compute_.defined() ? std::exchange(w_compute_, Tensor()) : in[1].to(x.dtype()).contiguous();
    Tensor ws = grouped_gemm_device_workspace(x, d.num_experts);
    const int32_t* counts = counts_.device.data<int32_t>();
    Tensor dx, dw;
    if (needs[0]) {
      dx = Tensor::empty(x.shape(), x.dtype(), dev);
      grouped_gemm_dgrad_device_cuda(x.dtype(), dy.raw_data(), w.raw_data(), dx.raw_data(), counts, d.num_experts,
                                     d.m_total, d.n, d.k, ws.raw_data(), size_t(ws.numel()), stream,
                                     !counts_.tail_unread);
    }
    if (needs[1]) {
      dw = Tensor::empty(in[1].shape(), DType::f32, dev);  // f32 whatever the weight's dtype, as above
      grouped_gemm_wgrad_device_cuda(x.dtype(), x.raw_data(), dy.raw_data(), dw.data<float>(), counts, d.num_experts,
                                     d.m_total, d.n, d.k, false, ws.raw_data(), size_t(ws.numel()), stream);
    }
    return {dx, dw};
  }

  Dims check_device_inputs(const Tensor& x, const Tensor& w) const {
    FLOWMOE_CHECK(grouped_linear_takes_device_counts(x), DTypeError, "grouped_linear: device counts need a bf16 x on ",
                  "a GPU of a CUDA build, got x ", x.describe());
    FLOWMOE_CHECK(x.dim() == 2 && w.dim() == 3 && x.size(1) == w.size(2), ShapeError, "grouped_linear: x ",
                  shape_str(x.shape()), " and weight ", shape_str(w.shape()), " must be [M_total, K] and [E, N, K]");
    check_device_counts(counts_.device, x, "grouped_linear", w.size(0));
    check_gpu_dtypes(x, w);
    return {w.size(0), x.size(0), w.size(1), w.size(2)};
  }

  ExpertCounts counts_;      // host counts, read once per layer by the caller, or device counts [E] i32 on x's device
  std::string weight_name_;  // names the hook site
  Tensor w_compute_;         // GPU: the weight in x's dtype, from the forward to the backward
};

}  // namespace

Tensor grouped_gemm_device_workspace(const Tensor& like, int64_t num_experts) {
  return Tensor::empty({int64_t(grouped_gemm_device_workspace_bytes(num_experts))}, DType::u8, like.device());
}

bool grouped_linear_takes_device_counts(const Tensor& x) {
  return built_with_cuda() && x.device().is_cuda() && x.dtype() == DType::bf16;
}

ExpertCounts gemm_counts(const Tensor& counts, const Tensor& rows, bool fp8_experts) {
  if (fp8_experts || grouped_linear_takes_device_counts(rows)) return {{}, counts};
  return {read_counts_once(counts), Tensor()};
}

Variable grouped_linear(const Variable& x, const Variable& weight,
                        const std::vector<int64_t>& padded_tokens_per_expert) {
  return grouped_linear(x, weight, ExpertCounts{padded_tokens_per_expert, Tensor()});
}

Variable grouped_linear(const Variable& x, const Variable& weight, const ExpertCounts& counts) {
  return apply(std::make_shared<GroupedLinear>(counts, weight.name()), {x, weight})[0];
}

}  // namespace flowmoe
