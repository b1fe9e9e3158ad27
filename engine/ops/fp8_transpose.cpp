// fp8_transpose (engine/ops/fp8_transpose.h): a BackwardPrimitive-style node over the launchers of
// kernels/fp8_transpose.h, run through eval() so the input's device picks the backend; the segments are a
// host table or device counts (the _device_ launchers). Reference: kernels/cpu/fp8_transpose.cpp,
// kernels/cpu/fp8_colwise_device.cpp. Tests: tests/test_fp8_transpose.cpp, tests/test_fp8_colwise_device.cpp.
#include "engine/ops/fp8_transpose.h"

#include "engine/autograd.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "kernels/fp8_transpose.h"

namespace flowmoe {

namespace {

class Fp8Transpose : public BackwardPrimitive {
 public:
  Fp8Transpose(std::vector<int64_t> rows, Tensor counts) : rows_(std::move(rows)), counts_(std::move(counts)) {}
  const char* name() const override { return "fp8_transpose"; }

  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) override {
    Prepared p = prepare(in[0]);
    if (counts_.defined())
      fp8_transpose_device_cpu(p.q.data<uint8_t>(), p.scale_inv.data<float>(), p.m, p.k, counts_.data<int32_t>(),
                               counts_.numel(), p.q_t.data<uint8_t>(), p.scale_inv_t.data<float>());
    else
      fp8_transpose_cpu(p.q.data<uint8_t>(), p.scale_inv.data<float>(), p.m, p.k, rows_.data(), int64_t(rows_.size()),
                        p.q_t.data<uint8_t>(), p.scale_inv_t.data<float>());
    return {p.q_t, p.scale_inv_t};
  }

  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) override {
    Prepared p = prepare(in[0]);
    cudaStream_t stream = current_stream(p.q.device().index);
    if (counts_.defined())
      fp8_transpose_device_cuda(p.q.data<uint8_t>(), p.scale_inv.data<float>(), p.m, p.k, counts_.data<int32_t>(),
                                counts_.numel(), p.q_t.data<uint8_t>(), p.scale_inv_t.data<float>(), stream);
    else
      fp8_transpose_cuda(p.q.data<uint8_t>(), p.scale_inv.data<float>(), p.m, p.k, rows_.data(), int64_t(rows_.size()),
                         p.q_t.data<uint8_t>(), p.scale_inv_t.data<float>(), stream);
    return {p.q_t, p.scale_inv_t};
  }

 private:
  std::vector<int64_t> rows_;  // host segments (never empty: fp8_transpose resolves {} to {M}), or
  Tensor counts_;              // defined: the segments as counts [E] i32 on the input's device

  struct Prepared {
    Tensor q, scale_inv, q_t, scale_inv_t;  // inputs made contiguous, outputs allocated
    int64_t m, k;
  };

  Prepared prepare(const Tensor& x) const {
    const auto& scales = x.fp8_scales();
    FLOWMOE_CHECK(
        x.dtype() == DType::e4m3 && scales && scales->mode == ScalingMode::rowwise_1x128, DTypeError,
        "fp8_transpose: expected e4m3 with rowwise_1x128 scales, got ", x.describe(),
        scales ? std::string(" with ") + scaling_mode_name(scales->mode) + " scales" : std::string(" without scales"));
    FLOWMOE_CHECK(x.dim() == 2, ShapeError, "fp8_transpose: expected [M, K] data, got ", x.describe());
    Prepared p;
    p.m = x.size(0), p.k = x.size(1);
    const Tensor& s = scales->scale_inv;
    FLOWMOE_CHECK(s.dtype() == DType::f32 && s.shape() == Shape({p.m, fp8_num_blocks(p.k)}), ShapeError,
                  "fp8_transpose: scale_inv ", s.describe(), " does not fit data ", x.describe(), " (want [", p.m, ", ",
                  fp8_num_blocks(p.k), "] f32)");
    check_same_device(x, s, "fp8_transpose (data vs scale_inv)");
    int64_t num_blocks = 0;
    if (counts_.defined()) {
      check_device_counts(counts_, x, "fp8_transpose");
      num_blocks = fp8_colwise_max_blocks(p.m, counts_.numel());  // the worst case: the host knows no counts
    } else {
      num_blocks = fp8_transpose_num_blocks(rows_.data(), int64_t(rows_.size()), p.m);
    }
    p.q = x.contiguous(), p.scale_inv = s.contiguous();
    p.q_t = Tensor::empty({p.k, p.m}, DType::e4m3, x.device());
    p.scale_inv_t = Tensor::empty({num_blocks, p.k}, DType::f32, x.device());
    return p;
  }
};

}  // namespace

Tensor fp8_transpose(const Tensor& q_rowwise, const std::vector<int64_t>& rows_per_segment) {
  FLOWMOE_CHECK(q_rowwise.dim() == 2, ShapeError, "fp8_transpose: expected [M, K] data, got ", q_rowwise.describe());
  Fp8Transpose op(rows_per_segment.empty() ? std::vector<int64_t>{q_rowwise.size(0)} : rows_per_segment, Tensor());
  std::vector<Tensor> out = eval(op, {q_rowwise});
  return out[0].with_scales(out[1], ScalingMode::colwise_1x128, rows_per_segment);
}

Tensor fp8_transpose(const Tensor& q_rowwise, const ExpertCounts& counts) {
  if (counts.host_known()) return fp8_transpose(q_rowwise, counts.host);
  Fp8Transpose op({}, counts.device);
  std::vector<Tensor> out = eval(op, {q_rowwise});
  return out[0].with_segment_counts(out[1], counts.device);
}

}  // namespace flowmoe
