// Blockwise FP8 quantize / dequantize primitives (engine/ops/quantize.h): each checks its inputs
// (messages name the tensor), runs the CPU reference or the CUDA kernel of kernels/quantize.h on the
// inputs' device, and attaches the scales to the FP8 result. Casts are counted in the public
// functions, once per call. Tests: tests/test_quantize.cpp.
#include "engine/ops/quantize.h"

#include "engine/cast_stats.h"
#include "engine/ops/ops.h"
#include "kernels/adamw_fp8.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"

namespace flowmoe {

namespace {

// Runs cpu_call on the host, cuda_call (with `stream` bound to t's stream) on a GPU.
#define QUANT_DISPATCH(t, cpu_call, cuda_call)                  \
  do {                                                          \
    if ((t).device().is_cuda()) {                               \
      cudaStream_t stream = current_stream((t).device().index); \
      cuda_call;                                                \
    } else {                                                    \
      cpu_call;                                                 \
    }                                                           \
  } while (0)

void check_high_precision(const Tensor& t, const std::string& what, const char* name) {
  FLOWMOE_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, DTypeError, what, ": ", name,
                " must be f32 or bf16, got ", t.describe());
}

void check_out_dtype(DType dtype, const std::string& what) {
  FLOWMOE_CHECK(dtype == DType::f32 || dtype == DType::bf16, DTypeError, what,
                ": the output dtype must be f32 or bf16, got ", dtype_name(dtype));
}

std::vector<int64_t> effective_segments(const std::vector<int64_t>& rows_per_segment, int64_t M) {
  return rows_per_segment.empty() ? std::vector<int64_t>{M} : rows_per_segment;
}

// The scales of an FP8 tensor, checked against its shape; returns a contiguous scale_inv.
Tensor checked_scales(const Tensor& q, const std::string& what) {
  FLOWMOE_CHECK(q.dtype() == DType::e4m3, DTypeError, what, ": q must be e4m3, got ", q.describe());
  const auto& s = q.fp8_scales();
  FLOWMOE_CHECK(s != nullptr, Error, what, ": q ", q.describe(), " carries no FP8 scales (Tensor::with_scales)");
  FLOWMOE_CHECK(q.is_contiguous(), ShapeError, what, ": q ", q.describe(), " must be contiguous");
  const Tensor& si = s->scale_inv;
  FLOWMOE_CHECK(si.dtype() == DType::f32 && si.device() == q.device(), DTypeError, what, ": scale_inv ", si.describe(),
                " must be f32 on q's device (q ", q.describe(), ")");
  Shape want;
  switch (s->mode) {
    case ScalingMode::rowwise_1x128: {
      FLOWMOE_CHECK(q.dim() >= 1, ShapeError, what, ": rowwise q must be [..., K], got ", q.describe());
      int64_t nbk = fp8_num_blocks(q.size(-1));
      bool ok = si.dim() >= 1 && si.size(-1) == nbk && si.numel() == leading_rows(q) * nbk;
      FLOWMOE_CHECK(ok, ShapeError, what, ": rowwise scale_inv ", si.describe(), " does not fit q ", q.describe(),
                    " (want [", leading_rows(q), ", ", nbk, "])");
      return si.contiguous();
    }
    case ScalingMode::colwise_1x128: {
      FLOWMOE_CHECK(q.dim() == 2, ShapeError, what, ": colwise q must be [K, M], got ", q.describe());
      if (s->segment_counts.defined()) {  // over device counts: sized for the worst case
        want = {fp8_colwise_max_blocks(q.size(1), s->segment_counts.numel()), q.size(0)};
        break;
      }
      std::vector<int64_t> seg = effective_segments(s->rows_per_segment, q.size(1));
      want = {colwise_num_blocks(seg.data(), int64_t(seg.size())), q.size(0)};
      break;
    }
    case ScalingMode::block_128x128: {
      FLOWMOE_CHECK(q.dim() == 2 || q.dim() == 3, ShapeError, what, ": block q must be [N, K] or [B, N, K], got ",
                    q.describe());
      want = {fp8_num_blocks(q.size(-2)), fp8_num_blocks(q.size(-1))};
      if (q.dim() == 3) want.insert(want.begin(), q.size(0));
      break;
    }
  }
  FLOWMOE_CHECK(si.shape() == want, ShapeError, what, ": ", scaling_mode_name(s->mode), " scale_inv ", si.describe(),
                " does not fit q ", q.describe(), " (want ", shape_str(want), ")");
  return si.contiguous();
}

// x [..., K] -> e4m3 [..., K] with rowwise scales. Straight-through gradient.
class QuantizeRowwise : public SharedBodyPrimitive<Primitive> {
 public:
  explicit QuantizeRowwise(std::string site) : what_("quantize_rowwise at '" + site + "'") {}
  const char* name() const override { return "quantize_rowwise"; }
  bool saves_inputs() const override { return false; }

  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    return {straight_through_grad(d_out[0], x_dtype_)};
  }

 private:
  std::string what_;
  DType x_dtype_ = DType::f32;

  std::vector<Tensor> run(const std::vector<Tensor>& in, bool) override {  // QUANT_DISPATCH picks the device
    const Tensor& x_in = in[0];
    check_high_precision(x_in, what_, "x");
    FLOWMOE_CHECK(x_in.dim() >= 1, ShapeError, what_, ": x must be [..., K], got ", x_in.describe());
    x_dtype_ = x_in.dtype();
    Tensor x = x_in.contiguous();
    int64_t rows = leading_rows(x), K = x.size(-1);
    Tensor q = Tensor::empty(x.shape(), DType::e4m3, x.device());
    Tensor s = Tensor::empty({rows, fp8_num_blocks(K)}, DType::f32, x.device());
    QUANT_DISPATCH(x, quantize_rowwise_cpu(x.dtype(), x.raw_data(), rows, K, q.data<uint8_t>(), s.data<float>()),
                   quantize_rowwise_cuda(x.dtype(), x.raw_data(), rows, K, q.data<uint8_t>(), s.data<float>(), stream));
    return {q.with_scales(s, ScalingMode::rowwise_1x128)};
  }
};

// x [M,K] -> e4m3 [K,M] with colwise scales over segments: host segments, or device counts (no gradient).
class QuantizeColwise : public SharedBodyPrimitive<BackwardPrimitive> {
 public:
  QuantizeColwise(std::vector<int64_t> segments, Tensor counts, const std::string& site)
      : segments_(std::move(segments)), counts_(std::move(counts)), what_("quantize_colwise at '" + site + "'") {}
  const char* name() const override { return "quantize_colwise"; }

 private:
  std::vector<int64_t> segments_;
  Tensor counts_;  // defined: the segments as counts [E] i32 on x's device (segments_ unused)
  std::string what_;

  std::vector<Tensor> run(const std::vector<Tensor>& in, bool) override {  // QUANT_DISPATCH picks the device
    const Tensor& x_in = in[0];
    check_high_precision(x_in, what_, "x");
    FLOWMOE_CHECK(x_in.dim() == 2, ShapeError, what_, ": x must be [M, K], got ", x_in.describe());
    Tensor x = x_in.contiguous();
    int64_t M = x.size(0), K = x.size(1);
    if (counts_.defined()) return run_device_counts(x, M, K);
    std::vector<int64_t> seg = effective_segments(segments_, M);
    for (size_t i = 0; i < seg.size(); ++i)
      FLOWMOE_CHECK(seg[i] >= 0, ShapeError, what_, ": rows_per_segment[", i, "] = ", seg[i], " is negative (x ",
                    x.describe(), ")");
    int64_t total = colwise_total_rows(seg.data(), int64_t(seg.size()));
    FLOWMOE_CHECK(total <= M, ShapeError, what_, ": rows_per_segment sum to ", total, " rows but x ", x.describe(),
                  " has ", M);
    int64_t nb = colwise_num_blocks(seg.data(), int64_t(seg.size()));
    Tensor q = Tensor::empty({K, M}, DType::e4m3, x.device());
    Tensor s = Tensor::empty({nb, K}, DType::f32, x.device());
    QUANT_DISPATCH(x,
                   quantize_colwise_cpu(x.dtype(), x.raw_data(), M, K, seg.data(), int64_t(seg.size()),
                                        q.data<uint8_t>(), s.data<float>()),
                   quantize_colwise_cuda(x.dtype(), x.raw_data(), M, K, seg.data(), int64_t(seg.size()),
                                         q.data<uint8_t>(), s.data<float>(), stream));
    return {q.with_scales(s, ScalingMode::colwise_1x128, segments_)};
  }

  // The counts stay where they are; the scales are sized for the worst case (kernels/fp8.h).
  std::vector<Tensor> run_device_counts(const Tensor& x, int64_t M, int64_t K) const {
    check_device_counts(counts_, x, what_);
    const int64_t E = counts_.numel();
    Tensor q = Tensor::empty({K, M}, DType::e4m3, x.device());
    Tensor s = Tensor::empty({fp8_colwise_max_blocks(M, E), K}, DType::f32, x.device());
    const int32_t* c = counts_.data<int32_t>();
    QUANT_DISPATCH(
        x, quantize_colwise_device_cpu(x.dtype(), x.raw_data(), M, K, c, E, q.data<uint8_t>(), s.data<float>()),
        quantize_colwise_device_cuda(x.dtype(), x.raw_data(), M, K, c, E, q.data<uint8_t>(), s.data<float>(), stream));
    return {q.with_segment_counts(s, counts_)};
  }
};

// Any of the three FP8 forms -> dtype. Identity gradient (rowwise and block forms keep the shape).
class Dequantize : public SharedBodyPrimitive<Primitive> {
 public:
  Dequantize(DType dtype, const std::string& site) : dtype_(dtype), what_("dequantize at '" + site + "'") {}
  const char* name() const override { return "dequantize"; }
  bool saves_inputs() const override { return false; }

  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>& d_out,
                          const std::vector<bool>&) override {
    return {d_out[0]};
  }

 private:
  DType dtype_;
  std::string what_;

  std::vector<Tensor> run(const std::vector<Tensor>& in, bool) override {  // QUANT_DISPATCH picks the device
    const Tensor& q = in[0];
    check_out_dtype(dtype_, what_);
    Tensor s = checked_scales(q, what_);
    const Fp8Scales& sc = *q.fp8_scales();
    const auto* qd = static_cast<const uint8_t*>(q.raw_data());
    const float* sd = s.data<float>();
    Tensor y;
    switch (sc.mode) {
      case ScalingMode::rowwise_1x128: {
        y = Tensor::empty(q.shape(), dtype_, q.device());
        int64_t rows = leading_rows(q), K = q.size(-1);
        QUANT_DISPATCH(q, dequantize_rowwise_cpu(dtype_, qd, sd, rows, K, y.raw_data()),
                       dequantize_rowwise_cuda(dtype_, qd, sd, rows, K, y.raw_data(), stream));
        break;
      }
      case ScalingMode::colwise_1x128: {
        int64_t K = q.size(0), M = q.size(1);
        FLOWMOE_CHECK(!sc.segment_counts.defined() || q.device().is_cpu(), Error, what_, ": q ", q.describe(),
                      " is colwise over device counts, which only the CPU dequantizes (it would read them)");
        std::vector<int64_t> seg =
            sc.segment_counts.defined() ? sc.segment_counts.to_ints() : effective_segments(sc.rows_per_segment, M);
        int64_t n = int64_t(seg.size());
        y = Tensor::empty({M, K}, dtype_, q.device());
        QUANT_DISPATCH(q, dequantize_colwise_cpu(dtype_, qd, sd, M, K, seg.data(), n, y.raw_data()),
                       dequantize_colwise_cuda(dtype_, qd, sd, M, K, seg.data(), n, y.raw_data(), stream));
        break;
      }
      case ScalingMode::block_128x128: {
        y = Tensor::empty(q.shape(), dtype_, q.device());
        int64_t B = q.dim() == 3 ? q.size(0) : 1, N = q.size(-2), K = q.size(-1);
        QUANT_DISPATCH(q, dequantize_block_cpu(dtype_, qd, sd, B, N, K, y.raw_data()),
                       dequantize_block_cuda(dtype_, qd, sd, B, N, K, y.raw_data(), stream));
        break;
      }
    }
    return {y};
  }
};

// A weight [N, K] or [B, N, K] in 128x128 blocks: its dims, its block counts, and the [B,] a x b shape of the
// tensors beside it (the scales [nbn, nbk], the transpose [K, N] and its scales [nbk, nbn]).
struct WeightBlocks {
  explicit WeightBlocks(const Tensor& w)
      : batched(w.dim() == 3),
        B(batched ? w.size(0) : 1),
        N(w.size(-2)),
        K(w.size(-1)),
        nbn(fp8_num_blocks(N)),
        nbk(fp8_num_blocks(K)) {}
  Shape shape(int64_t a, int64_t b) const { return batched ? Shape{B, a, b} : Shape{a, b}; }
  bool batched;
  int64_t B, N, K, nbn, nbk;
};

// w [E,N,K] or [N,K] -> {q, q_t} in 128x128 blocks (no gradient).
class QuantizeWeight : public SharedBodyPrimitive<BackwardPrimitive> {
 public:
  QuantizeWeight(const std::string& site, bool with_transpose)
      : what_("quantize_weight at '" + site + "'"), with_transpose_(with_transpose) {}
  const char* name() const override { return "quantize_weight"; }

 private:
  std::string what_;
  bool with_transpose_;

  std::vector<Tensor> run(const std::vector<Tensor>& in, bool) override {  // QUANT_DISPATCH picks the device
    const Tensor& w_in = in[0];
    check_high_precision(w_in, what_, "w");
    FLOWMOE_CHECK(w_in.dim() == 2 || w_in.dim() == 3, ShapeError, what_, ": w must be [N, K] or [E, N, K], got ",
                  w_in.describe());
    Tensor w = w_in.contiguous();
    const WeightBlocks b(w);
    Tensor q = Tensor::empty(w.shape(), DType::e4m3, w.device());
    Tensor s = Tensor::empty(b.shape(b.nbn, b.nbk), DType::f32, w.device());
    Tensor q_t, s_t;
    if (with_transpose_) {
      q_t = Tensor::empty(b.shape(b.K, b.N), DType::e4m3, w.device());
      s_t = Tensor::empty(b.shape(b.nbk, b.nbn), DType::f32, w.device());
    }
    auto* qd = q.data<uint8_t>();
    auto* qtd = with_transpose_ ? q_t.data<uint8_t>() : nullptr;
    float* std_ = with_transpose_ ? s_t.data<float>() : nullptr;
    QUANT_DISPATCH(w, quantize_block_cpu(w.dtype(), w.raw_data(), b.B, b.N, b.K, qd, s.data<float>(), qtd, std_),
                   quantize_block_cuda(w.dtype(), w.raw_data(), b.B, b.N, b.K, qd, s.data<float>(), qtd, std_, stream));
    if (!with_transpose_) return {q.with_scales(s, ScalingMode::block_128x128)};
    return {q.with_scales(s, ScalingMode::block_128x128), q_t.with_scales(s_t, ScalingMode::block_128x128)};
  }
};

}  // namespace

Variable quantize_rowwise(const Variable& x, const std::string& site) {
  Variable q = apply(std::make_shared<QuantizeRowwise>(site), {x})[0];
  note_cast(CastKind::quantize, site);
  return q;
}

Variable dequantize(const Variable& q, DType dtype, const std::string& site) {
  const auto& s = q.data().fp8_scales();
  FLOWMOE_CHECK(!s || s->mode != ScalingMode::colwise_1x128, Error, "dequantize at '", site, "': q ",
                q.data().describe(), " is colwise (a transposed layout); use dequantize_tensor");
  Variable y = apply(std::make_shared<Dequantize>(dtype, site), {q})[0];
  note_cast(CastKind::dequantize, site);
  return y;
}

Tensor straight_through_grad(const Tensor& d_q, DType dtype) {
  if (is_fp8(d_q.dtype())) return dequantize_tensor(d_q, dtype, "");  // not a cast of the forward
  return d_q.to(dtype);
}

Tensor quantize_rowwise_tensor(const Tensor& x, const std::string& site) {
  QuantizeRowwise op(site);
  Tensor q = eval(op, {x})[0];
  note_cast(CastKind::quantize, site);
  return q;
}

Tensor quantize_colwise_tensor(const Tensor& x, const std::vector<int64_t>& rows_per_segment, const std::string& site) {
  QuantizeColwise op(rows_per_segment, Tensor(), site);
  Tensor q = eval(op, {x})[0];
  note_cast(CastKind::quantize, site);
  return q;
}

Tensor quantize_colwise_tensor(const Tensor& x, const ExpertCounts& counts, const std::string& site) {
  if (counts.host_known()) return quantize_colwise_tensor(x, counts.host, site);
  QuantizeColwise op({}, counts.device, site);
  Tensor q = eval(op, {x})[0];
  note_cast(CastKind::quantize, site);
  return q;
}

Tensor dequantize_tensor(const Tensor& q, DType dtype, const std::string& site) {
  Dequantize op(dtype, site);
  Tensor y = eval(op, {q})[0];
  if (!site.empty()) note_cast(CastKind::dequantize, site);
  return y;
}

QuantizedWeight quantize_weight(const Tensor& w, const std::string& site, bool with_transpose) {
  QuantizeWeight op(site, with_transpose);
  std::vector<Tensor> out = eval(op, {w});
  note_cast(CastKind::weight_quantize, site);
  return {out[0], with_transpose ? out[1] : Tensor()};
}

Tensor weight_transpose(const QuantizedWeight& wq) {
  if (wq.q_t.defined()) return wq.q_t;
  const Tensor& q = wq.q;
  FLOWMOE_CHECK(q.dtype() == DType::e4m3 && q.fp8_scales() && q.fp8_scales()->mode == ScalingMode::block_128x128 &&
                    (q.dim() == 2 || q.dim() == 3) && q.is_contiguous(),
                DTypeError, "weight_transpose: expected a contiguous e4m3 [N, K] or [B, N, K] in 128x128 blocks, got ",
                q.describe());
  const WeightBlocks b(q);
  const Tensor s_t = Tensor::empty(b.shape(b.nbk, b.nbn), DType::f32, q.device());
  const Tensor q_t =
      Tensor::empty(b.shape(b.K, b.N), DType::e4m3, q.device()).with_scales(s_t, ScalingMode::block_128x128);
  const Fp8BlockCopy c = block_copy({q, q_t});
  QUANT_DISPATCH(q, fp8_block_transpose_cpu(c), fp8_block_transpose_cuda(c, stream));
  return q_t;
}

Fp8BlockCopy block_copy(const QuantizedWeight& wq) {
  const Tensor &q = wq.q, &q_t = wq.q_t;
  const WeightBlocks b(q);
  return {q.data<uint8_t>(),
          q.fp8_scales()->scale_inv.data<float>(),
          q_t.defined() ? q_t.data<uint8_t>() : nullptr,
          q_t.defined() ? q_t.fp8_scales()->scale_inv.data<float>() : nullptr,
          b.B,
          b.N,
          b.K};
}

}  // namespace flowmoe
