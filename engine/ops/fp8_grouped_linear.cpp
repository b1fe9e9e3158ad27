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

// The counts as host values for the CPU references: the host counts, or the CPU tensor that stands in for
// device counts on the CPU backend (read without a synchronisation).
std::vector<int64_t> cpu_rows(const ExpertCounts& c) { return c.on_device() ? c.device.to_ints() : c.host; }

// y [M_total, N] = per expert a[rows of e] · w[e]ᵀ, a rowwise FP8 [M_total, K], w block FP8 [E, N, K].
// fprop (a = x, w = Wq) and dgrad (a = dy, w = Wqᵀ) are the same GEMM. With device counts (one rank)
// the GPU runs it in one launch; with host counts one cuBLASLt call per expert.
class Fp8GroupedGemm : public BackwardPrimitive {
 public:
  Fp8GroupedGemm(ExpertCounts counts, const char* what) : counts_(std::move(counts)), what_(what) {}
  const char* name() const override { return what_; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Dims d = check(in);
    Tensor y = Tensor::empty({d.m, d.n}, DType::f32);
    const Fp8Scales &sa = *in[0].fp8_scales(), &sw = *in[1].fp8_scales();
    const std::vector<int64_t> rows = cpu_rows(counts_);
    check_grouped_rows(rows.data(), int64_t(rows.size()), d.m, what_);
    fp8_grouped_gemm_cpu(DType::f32, in[0].data<uint8_t>(), sa.scale_inv.data<float>(), in[1].data<uint8_t>(),
                         sw.scale_inv.data<float>(), y.raw_data(), rows.data(), int64_t(rows.size()), d.m, d.n, d.k);
    // The GPU leaves an unread tail unwritten; here it is NaN, so that a reader of it fails the CPU tests.
    if (counts_.tail_unread) {
      int64_t counted = 0;
      for (int64_t r : rows) counted += r;
      y.slice(0, counted, d.m).fill_bytes_(0xFF);
    }
    return {y};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Dims d = check(in);
    const Device dev = in[0].device();
    const int64_t E = counts_.num_experts();
    Tensor y = Tensor::empty({d.m, d.n}, DType::bf16, dev);
    const Fp8Scales &sa = *in[0].fp8_scales(), &sw = *in[1].fp8_scales();
    if (counts_.on_device()) {
      Tensor ws = grouped_gemm_device_workspace(in[0], E);
      fp8_grouped_gemm_device_cuda(DType::bf16, in[0].data<uint8_t>(), sa.scale_inv.data<float>(),
                                   in[1].data<uint8_t>(), sw.scale_inv.data<float>(), y.raw_data(),
                                   counts_.device.data<int32_t>(), E, d.m, d.n, d.k, ws.raw_data(), size_t(ws.numel()),
                                   current_stream(dev.index), !counts_.tail_unread);
      return {y};
    }
    check_grouped_rows(counts_.host.data(), E, d.m, what_);
    const size_t ws_bytes = fp8_grouped_gemm_workspace_bytes(d.m, d.k, E, d.n);
    Tensor ws = Tensor::empty({int64_t(ws_bytes)}, DType::u8, dev);
    fp8_grouped_gemm_cuda(DType::bf16, in[0].data<uint8_t>(), sa.scale_inv.data<float>(), in[1].data<uint8_t>(),
                          sw.scale_inv.data<float>(), y.raw_data(), counts_.host.data(), E, d.m, d.n, d.k,
                          ws.raw_data(), current_stream(dev.index));
    return {y};
  }

 private:
  ExpertCounts counts_;  // device counts: one launch (GPU); host counts: per-expert calls
  const char* what_;

  Dims check(const std::vector<Tensor>& in) const {
    const Tensor &a = in[0], &w = in[1];
    scales_of(a, ScalingMode::rowwise_1x128, what_);
    scales_of(w, ScalingMode::block_128x128, what_);
    FLOWMOE_CHECK(a.dim() == 2 && a.is_contiguous(), ShapeError, what_,
                  ": the activation must be a contiguous [M, K], got ", a.describe());
    FLOWMOE_CHECK(w.dim() == 3 && w.size(0) == counts_.num_experts() && w.size(2) == a.size(1) && w.is_contiguous(),
                  ShapeError, what_, ": weight ", w.describe(), " does not fit ", counts_.num_experts(),
                  " experts and ", a.describe());
    return {a.size(0), w.size(1), w.size(2)};
  }
};

// dW [E, N, K] f32 = per expert dyᶜᵒˡ · xᶜᵒˡᵀ over the expert's rows; both operands colwise over the
// experts' segments (dyᶜᵒˡ [N, M_total], xᶜᵒˡ [K, M_total]): host segments, or the same device counts
// (their scales then [fp8_colwise_max_blocks, ..], expert e's from block row Σ_{i<e} ceil(r_i/128)).
class Fp8GroupedWgrad : public BackwardPrimitive {
 public:
  explicit Fp8GroupedWgrad(ExpertCounts counts) : counts_(std::move(counts)) {}
  const char* name() const override { return "fp8_grouped_linear_wgrad"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Dims d = check(in);
    const std::vector<int64_t> rows = cpu_rows(counts_);
    Tensor dw = Tensor::empty({int64_t(rows.size()), d.n, d.k}, DType::f32);
    fp8_grouped_wgrad_cpu(in[0].data<uint8_t>(), in[0].fp8_scales()->scale_inv.data<float>(), in[1].data<uint8_t>(),
                          in[1].fp8_scales()->scale_inv.data<float>(), dw.data<float>(), rows.data(),
                          int64_t(rows.size()), d.m, d.n, d.k, false);
    return {dw};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Dims d = check(in);
    const Device dev = in[0].device();
    const int64_t E = counts_.num_experts();
    Tensor dw = Tensor::empty({E, d.n, d.k}, DType::f32, dev);
    if (counts_.on_device()) {
      Tensor ws = grouped_gemm_device_workspace(in[0], E);
      fp8_grouped_wgrad_device_cuda(in[0].data<uint8_t>(), in[0].fp8_scales()->scale_inv.data<float>(),
                                    in[1].data<uint8_t>(), in[1].fp8_scales()->scale_inv.data<float>(),
                                    dw.data<float>(), counts_.device.data<int32_t>(), E, d.m, d.n, d.k, false,
                                    ws.raw_data(), size_t(ws.numel()), current_stream(dev.index));
      return {dw};
    }
    fp8_grouped_wgrad_cuda(in[0].data<uint8_t>(), in[0].fp8_scales()->scale_inv.data<float>(), in[1].data<uint8_t>(),
                           in[1].fp8_scales()->scale_inv.data<float>(), dw.data<float>(), counts_.host.data(), E, d.m,
                           d.n, d.k, false, current_stream(dev.index));
    return {dw};
  }

 private:
  ExpertCounts counts_;  // as Fp8GroupedGemm's

  // Whether a colwise operand's segments are these counts: the same host values, or the same device
  // tensor (its values are never read on the host) with the worst-case scale rows.
  bool segments_match(const Tensor& t) const {
    const Fp8Scales& s = *t.fp8_scales();
    if (counts_.host_known()) return !s.segment_counts.defined() && s.rows_per_segment == counts_.host;
    const Tensor& c = s.segment_counts;
    return c.defined() && c.raw_data() == counts_.device.raw_data() && c.numel() == counts_.device.numel() &&
           s.scale_inv.size(0) == fp8_colwise_max_blocks(t.size(1), c.numel());
  }

  Dims check(const std::vector<Tensor>& in) const {
    const Tensor &dy_t = in[0], &x_t = in[1];
    scales_of(dy_t, ScalingMode::colwise_1x128, name());
    scales_of(x_t, ScalingMode::colwise_1x128, name());
    FLOWMOE_CHECK(dy_t.dim() == 2 && x_t.dim() == 2 && dy_t.size(1) == x_t.size(1), ShapeError, name(),
                  ": colwise operands ", dy_t.describe(), " and ", x_t.describe(), " must be [N, M] and [K, M]");
    FLOWMOE_CHECK(segments_match(dy_t) && segments_match(x_t), Error, name(),
                  ": the colwise operands' segments are not the experts' ",
                  !counts_.host_known() ? "device counts" : "row counts");
    return {dy_t.size(1), dy_t.size(0), x_t.size(0)};
  }
};

// Inputs: x (FP8 rowwise [M, K]), weight (the f32 master [E, N, K]). Output: y [M, N].
class Fp8GroupedLinear : public Primitive {
 public:
  Fp8GroupedLinear(const QuantizedWeight& wq, ExpertCounts counts, Fp8Wgrad wgrad, std::string site)
      : wq_(wq), counts_(std::move(counts)), wgrad_(wgrad), site_(std::move(site)) {}
  const char* name() const override { return "fp8_grouped_linear"; }
  double flops(const std::vector<Tensor>& in) const override {
    return in.size() < 2 ? 0 : grouped_gemm_flops(counts_, in[0], in[1]);
  }

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
        dy_col = fp8_transpose(dy_row, counts_);
        x_col = fp8_transpose(x, counts_);
      } else {
        // fp8_blockwise: the classic recipe re-quantizes the transposed operands from high precision.
        Tensor dy_hp = dy_fp8 ? dequantize_tensor(dy, DType::f32, site_ + ".wgrad: dy") : dy;
        dy_col = quantize_colwise_tensor(dy_hp, counts_, site_ + ".wgrad: dy colwise");
        x_col = quantize_colwise_tensor(
            dequantize_tensor(x, x.device().is_cpu() ? DType::f32 : DType::bf16, site_ + ".wgrad: x"), counts_,
            site_ + ".wgrad: x colwise");
      }
      Fp8GroupedWgrad wgrad(counts_);
      dw = eval(wgrad, {dy_col, x_col})[0];
    }
    if (needs[0]) {
      Fp8GroupedGemm dgrad(counts_, "fp8_grouped_linear_dgrad");
      // A weight that keeps no transpose has it rebuilt here and freed after (precision.fp8_weight_transpose).
      dx = eval(dgrad, {dy_row, weight_transpose(wq_)})[0];
    }
    return {dx, dw};
  }

 private:
  QuantizedWeight wq_;
  ExpertCounts counts_;  // device counts: one-launch GEMMs and device-count colwise layouts, no host sync
  Fp8Wgrad wgrad_;
  std::string site_;
  Fp8GroupedGemm fprop() const { return Fp8GroupedGemm(counts_, "fp8_grouped_linear"); }
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
  const int64_t E = weight.data().size(0);
  if (counts.on_device()) check_device_counts(counts.device, x.data(), "fp8_grouped_linear", E);
  if (counts.host_known())
    FLOWMOE_CHECK(int64_t(counts.host.size()) == E, ShapeError, "fp8_grouped_linear: ", counts.host.size(),
                  " host counts for weight ", weight.data().describe(), " of ", E, " experts");
  return apply(std::make_shared<Fp8GroupedLinear>(wq, counts, wgrad, site), {x, weight})[0];
}

}  // namespace flowmoe
