// The sharded optimizer's FP8 weights (see grad_reducer.h): buckets of block rows whose FP8 data and scales are
// gathered in place of the weights, and the transpose each rank rebuilds from them.
#include "kernels/adamw_fp8.h"
#include "kernels/fp8.h"
#include "parallel/grad_reducer.h"

namespace flowmoe {

// Segments of whole 128-row block rows need N (the rows of each matrix) a multiple of 128, as every FP8 weight of
// the models has; the weight is read in f32 alone (its bucket's weights are f32).
bool GradientReducer::gathers_fp8(const Variable& p, const ParamShard& s) {
  return s.fp8 && s.reads_f32 && p.dtype() == DType::f32 && (p.data().dim() == 2 || p.data().dim() == 3) &&
         p.size(-2) % kFp8BlockSize == 0;
}

// The copy's q and scale_inv become views of buffers padded as b's segments, so that AdamW writes its segment in
// place and the all-gather moves them in place; q_t and its scales, where the copy keeps them, buffers of their own.
// The shapes are those quantize_weight gives (a dense [N, K] as [1, N, K]), so a forward that quantizes (init, a load)
// stores into these buffers (store_fp8_weight).
void GradientReducer::shard_fp8_copy(Bucket& b) {
  const Variable& p = params_[b.params.front()];
  const Device device = p.device();
  const int64_t B = p.data().dim() == 3 ? p.size(0) : 1, N = p.size(-2), K = p.size(-1);
  const int64_t nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K), block_rows = b.padded / (kFp8BlockSize * K);
  b.fp8_q = Tensor::zeros({b.padded}, DType::e4m3, device);
  b.fp8_scales = Tensor::zeros({block_rows * nbk}, DType::f32, device);
  const Tensor q = b.fp8_q.slice(0, 0, b.numel).view({B, N, K});
  const Tensor scales = b.fp8_scales.slice(0, 0, B * nbn * nbk).view({B, nbn, nbk});
  QuantizedWeight& wq = b.fp8->wq;
  wq.q = q.with_scales(scales, ScalingMode::block_128x128);
  if (b.fp8->keeps_transpose)
    wq.q_t = Tensor::zeros({B, K, N}, DType::e4m3, device)
                 .with_scales(Tensor::zeros({B, nbk, nbn}, DType::f32, device), ScalingMode::block_128x128);
  b.fp8->held = true;  // the all-gather moves q and its scales in place
  b.fp8->version = 0;
  b.fp8->of = nullptr;  // not current: the first forward quantizes into these buffers
}

std::vector<std::shared_ptr<Fp8WeightCopy>> GradientReducer::gathered_fp8_copies() const {
  std::vector<std::shared_ptr<Fp8WeightCopy>> copies(params_.size());
  for (const Bucket& b : buckets_)
    if (b.fp8) copies[b.params.front()] = b.fp8;
  return copies;
}

void GradientReducer::mark_fp8_current() const {
  for (const Bucket& b : buckets_)
    if (b.fp8) b.fp8->mark_current(params_[b.params.front()]);
}

// The copy's data and scales, then its transpose from them (where it keeps one), on the stream the forward waits
// for.
void GradientReducer::gather_fp8(Bucket& b) {
  comms_[b.group]->all_gather_in_place(b.fp8_q);
  comms_[b.group]->all_gather_in_place(b.fp8_scales);
  const Fp8BlockCopy c = block_copy(b.fp8->wq);
  if (!c.q_t) return;
  if (b.fp8_q.device().is_cpu())
    fp8_block_transpose_cpu(c);
  else
    fp8_block_transpose_cuda(c, stream_ ? stream_->get() : current_stream(b.fp8_q.device().index));
}

}  // namespace flowmoe
