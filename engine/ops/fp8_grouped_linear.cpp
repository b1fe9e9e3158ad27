// fp8_grouped_linear (engine/ops/fp8_grouped_linear.h): the autograd node over the FP8 grouped GEMM
// launchers of kernels/fp8_grouped_linear.h. Reference: kernels/cpu/fp8_grouped_linear.cpp.
#include "engine/ops/fp8_grouped_linear.h"

#include <memory>

#include "engine/ops/fp8_transpose.h"
#include "engine/ops/grouped_linear.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "kernels/fp8_grouped_linear.h"
#include "kernels/grouped_gemm_device.h"
#include "kernels/grouped_linear.h"

namespace flowmoe {

namespace {

const Fp8Scales& scales_of(const Tensor& t, ScalingMode mode, const char* what) {
  FLOWMOE_CHECK(t.dtype() == DType::e4m3 && t.fp8_scales() && t.fp8_scales()->mode == mode, DTypeError, what,
                ": expected e4m3 with ", scaling_mode_name(mode), " scales, got ", t.describe(),
                t.fp8_scales() ? std::string(" with ") + scaling_mode_name(t.fp8_scales()->mode) + " scales"
                               : std::string(" without scales"));
  return *t.fp8_scales();
}

// The problem of one grouped GEMM: M_total rows, N outputs, K inner.
struct Dims {
  int64_t m, n, k;
};

// y [M_total, N] = per expert a[rows of e] · w[e]ᵀ, a rowwise FP8 [M_total, K], w block FP8 [E, N, K].
// fprop (a = x, w = Wq) and dgrad (a = dy, w = Wqᵀ) are the same GEMM. With the counts also on the
// device (one rank) the GPU runs it in one launch; otherwise one cuBLASLt call per expert.
class Fp8GroupedGemm : public BackwardPrimitive {
 public:
  Fp8GroupedGemm(std::vector<int64_t> rows, Tensor device_counts, const char* what)
      : rows_(std::move(rows)), device_counts_(std::move(device_counts)), what_(what) {}
  const char* name() const override { return what_; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Dims d = check(in);
    Tensor y = Tensor::empty({d.m, d.n}, DType::f32);
    const Fp8Scales &sa = *in[0].fp8_scales(), &sw = *in[1].fp8_scales();
    fp8_grouped_gemm_cpu(DType::f32, in[0].data<uint8_t>(), sa.scale_inv.data<float>(), in[1].data<uint8_t>(),
                         sw.scale_inv.data<float>(), y.raw_data(), rows_.data(), int64_t(rows_.size()), d.m, d.n, d.k);
    return {y};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Dims d = check(in);
    const Device dev = in[0].device();
    Tensor y = Tensor::empty({d.m, d.n}, DType::bf16, dev);
    const Fp8Scales &sa = *in[0].fp8_scales(), &sw = *in[1].fp8_scales();
    if (device_counts_.defined()) {
      Tensor ws = grouped_gemm_device_workspace(in[0], int64_t(rows_.size()));
      fp8_grouped_gemm_device_cuda(DType::bf16, in[0].data<uint8_t>(), sa.scale_inv.data<float>(),
                                   in[1].data<uint8_t>(), sw.scale_inv.data<float>(), y.raw_data(),
                                   device_counts_.data<int32_t>(), int64_t(rows_.size()), d.m, d.n, d.k,
                                   ws.raw_data(), size_t(ws.numel()), current_stream(dev.index));
      return {y};
    }
    const size_t ws_bytes = fp8_grouped_gemm_workspace_bytes(d.m, d.k, int64_t(rows_.size()), d.n);
    Tensor ws = Tensor::empty({int64_t(ws_bytes)}, DType::u8, dev);
    fp8_grouped_gemm_cuda(DType::bf16, in[0].data<uint8_t>(), sa.scale_inv.data<float>(), in[1].data<uint8_t>(),
                          sw.scale_inv.data<float>(), y.raw_data(), rows_.data(), int64_t(rows_.size()), d.m, d.n, d.k,
                          ws.raw_data(), current_stream(dev.index));
    return {y};
  }

 private:
  std::vector<int64_t> rows_;
  Tensor device_counts_;  // [E] i32 on the GPU, the same values as rows_; undefined: per-expert calls
  const char* what_;

  Dims check(const std::vector<Tensor>& in) const {
    const Tensor &a = in[0], &w = in[1];
    scales_of(a, ScalingMode::rowwise_1x128, what_);
    scales_of(w, ScalingMode::block_128x128, what_);
    FLOWMOE_CHECK(a.dim() == 2 && a.is_contiguous(), ShapeError, what_, ": the activation must be a contiguous [M, K], got ",
                  a.describe());
    FLOWMOE_CHECK(w.dim() == 3 && w.size(0) == int64_t(rows_.size()) && w.size(2) == a.size(1) && w.is_contiguous(),
                  ShapeError, what_, ": weight ", w.describe(), " does not fit ", rows_.size(), " experts and ",
                  a.describe());
    check_grouped_rows(rows_.data(), int64_t(rows_.size()), a.size(0), what_);
    return {a.size(0), w.size(1), w.size(2)};
  }
};

// dW [E, N, K] f32 = per expert dyᶜᵒˡ · xᶜᵒˡᵀ over the expert's rows; both operands colwise over the
// experts' segments (dyᶜᵒˡ [N, M_total], xᶜᵒˡ [K, M_total]).
class Fp8GroupedWgrad : public BackwardPrimitive {
 public:
  Fp8GroupedWgrad(std::vector<int64_t> rows, Tensor device_counts)
      : rows_(std::move(rows)), device_counts_(std::move(device_counts)) {}
  const char* name() const override { return "fp8_grouped_linear_wgrad"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Dims d = check(in);
    Tensor dw = Tensor::empty({int64_t(rows_.size()), d.n, d.k}, DType::f32);
    fp8_grouped_wgrad_cpu(in[0].data<uint8_t>(), in[0].fp8_scales()->scale_inv.data<float>(), in[1].data<uint8_t>(),
                          in[1].fp8_scales()->scale_inv.data<float>(), dw.data<float>(), rows_.data(),
                          int64_t(rows_.size()), d.m, d.n, d.k, false);
    return {dw};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Dims d = check(in);
    const Device dev = in[0].device();
    Tensor dw = Tensor::empty({int64_t(rows_.size()), d.n, d.k}, DType::f32, dev);
    if (device_counts_.defined()) {
      Tensor ws = grouped_gemm_device_workspace(in[0], int64_t(rows_.size()));
      fp8_grouped_wgrad_device_cuda(in[0].data<uint8_t>(), in[0].fp8_scales()->scale_inv.data<float>(),
                                    in[1].data<uint8_t>(), in[1].fp8_scales()->scale_inv.data<float>(),
                                    dw.data<float>(), device_counts_.data<int32_t>(), int64_t(rows_.size()), d.m,
                                    d.n, d.k, false, ws.raw_data(), size_t(ws.numel()), current_stream(dev.index));
      return {dw};
    }
    fp8_grouped_wgrad_cuda(in[0].data<uint8_t>(), in[0].fp8_scales()->scale_inv.data<float>(), in[1].data<uint8_t>(),
                           in[1].fp8_scales()->scale_inv.data<float>(), dw.data<float>(), rows_.data(),
                           int64_t(rows_.size()), d.m, d.n, d.k, false, current_stream(dev.index));
    return {dw};
  }

 private:
  std::vector<int64_t> rows_;
  Tensor device_counts_;  // as Fp8GroupedGemm's

  Dims check(const std::vector<Tensor>& in) const {
    const Tensor &dy_t = in[0], &x_t = in[1];
    scales_of(dy_t, ScalingMode::colwise_1x128, name());
    scales_of(x_t, ScalingMode::colwise_1x128, name());
    FLOWMOE_CHECK(dy_t.dim() == 2 && x_t.dim() == 2 && dy_t.size(1) == x_t.size(1), ShapeError, name(),
                  ": colwise operands ", dy_t.describe(), " and ", x_t.describe(), " must be [N, M] and [K, M]");
    FLOWMOE_CHECK(dy_t.fp8_scales()->rows_per_segment == rows_ && x_t.fp8_scales()->rows_per_segment == rows_, Error,
                  name(), ": the colwise operands' segments are not the experts' row counts");
    return {dy_t.size(1), dy_t.size(0), x_t.size(0)};
  }
};

// Inputs: x (FP8 rowwise [M, K]), weight (the f32 master [E, N, K]). Output: y [M, N].
class Fp8GroupedLinear : public Primitive {
 public:
  Fp8GroupedLinear(const QuantizedWeight& wq, ExpertCounts counts, Fp8Wgrad wgrad, std::string site)
      : wq_(wq), rows_(std::move(counts.host)), device_counts_(std::move(counts.device)), wgrad_(wgrad),
        site_(std::move(site)) {}
  const char* name() const override { return "fp8_grouped_linear"; }
  double flops(const std::vector<Tensor>& in) const override { return in.size() < 2 ? 0 : grouped_gemm_flops(rows_, in[1]); }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override { return fprop().eval_cpu({in[0], wq_.q}); }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override { return fprop().eval_gpu({in[0], wq_.q}); }

  std::vector<Tensor> vjp(const std::vector<Tensor>& in, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>& needs) override {
    const Tensor& x = in[0];
    const Tensor& dy = d_out[0];
    // The rowwise FP8 gradient feeds dgrad; fp8_flow hands it over already quantized.
    const bool dy_fp8 = is_fp8(dy.dtype());
    Tensor dy_row = dy_fp8 ? dy : quantize_rowwise_tensor(dy, site_ + ".dgrad: dy rowwise");
    Tensor dx, dw;
    // wgrad first: its column-wise operands are freed before dgrad allocates dx, which keeps the
    // backward's peak memory at max(wgrad operands, dx) rather than their sum.
    if (needs[1]) {
      Tensor dy_col, x_col;
      if (wgrad_ == Fp8Wgrad::transpose) {
        // fp8_flow: the scaling-aware transpose of what is already FP8 — no cast.
        dy_col = fp8_transpose(dy_row, rows_);
        x_col = fp8_transpose(x, rows_);
      } else {
        // fp8_blockwise: the classic recipe re-quantizes the transposed operands from high precision.
        Tensor dy_hp = dy_fp8 ? dequantize_tensor(dy, DType::f32, site_ + ".wgrad: dy") : dy;
        dy_col = quantize_colwise_tensor(dy_hp, rows_, site_ + ".wgrad: dy colwise");
        x_col = quantize_colwise_tensor(dequantize_tensor(x, x.device().is_cpu() ? DType::f32 : DType::bf16,
                                                          site_ + ".wgrad: x"),
                                        rows_, site_ + ".wgrad: x colwise");
      }
      Fp8GroupedWgrad wgrad(rows_, device_counts_);
      dw = eval(wgrad, {dy_col, x_col})[0];
    }
    if (needs[0]) {
      Fp8GroupedGemm dgrad(rows_, device_counts_, "fp8_grouped_linear_dgrad");
      dx = eval(dgrad, {dy_row, wq_.q_t})[0];
    }
    return {dx, dw};
  }

 private:
  QuantizedWeight wq_;
  std::vector<int64_t> rows_;
  Tensor device_counts_;  // optional: the GEMMs then run in one launch (Fp8GroupedGemm)
  Fp8Wgrad wgrad_;
  std::string site_;
  Fp8GroupedGemm fprop() const { return Fp8GroupedGemm(rows_, device_counts_, "fp8_grouped_linear"); }
};

}  // namespace

Variable fp8_grouped_linear(const Variable& x, const Variable& weight, const QuantizedWeight& wq,
                            const std::vector<int64_t>& padded_tokens_per_expert, Fp8Wgrad wgrad,
                            const std::string& site) {
  return fp8_grouped_linear(x, weight, wq, ExpertCounts{padded_tokens_per_expert, Tensor()}, wgrad, site);
}

Variable fp8_grouped_linear(const Variable& x, const Variable& weight, const QuantizedWeight& wq,
                            const ExpertCounts& counts, Fp8Wgrad wgrad, const std::string& site) {
  scales_of(x.data(), ScalingMode::rowwise_1x128, "fp8_grouped_linear x");
  FLOWMOE_CHECK(weight.dtype() == DType::f32 && weight.data().dim() == 3, DTypeError,
                "fp8_grouped_linear: weight must be the f32 master [E, N, K], got ", weight.data().describe());
  FLOWMOE_CHECK(wq.q.shape() == weight.shape(), ShapeError, "fp8_grouped_linear: quantized weight ", wq.q.describe(),
                " does not match the master ", weight.data().describe());
  check_same_device(x.data(), weight.data(), "fp8_grouped_linear");
  if (counts.device.defined())  // the host counts stay the reference: the transposes' segment tables
    FLOWMOE_CHECK(counts.device.dtype() == DType::i32 && counts.device.numel() == int64_t(counts.host.size()) &&
                      counts.device.device() == x.data().device() && x.data().device().is_cuda(),
                  ShapeError, "fp8_grouped_linear: device counts ", counts.device.describe(), " must be [",
                  counts.host.size(), "] i32 on ", x.data().device().str(), " beside the host counts");
  return apply(std::make_shared<Fp8GroupedLinear>(wq, counts, wgrad, site), {x, weight})[0];
}

}  // namespace flowmoe
