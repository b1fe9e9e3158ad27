// Data parallelism's gradient reduction, overlapped with the backward (PyTorch DDP's and Megatron-LM's
// --overlap-grad-reduce), and the sharded optimizer's weights (Megatron-LM's distributed optimizer with
// DeepSpeed ZeRO-2's gradient release). Buckets of at most 25 MiB in the order the backward finishes the
// gradients: dense parameters reduce over the world, expert shards over their expert-data-parallel group.
// Autograd's leaf hook reports each gradient as it becomes final and a complete bucket is reduced at once
// (with nccl on a stream of its own), in one order on every rank, so the sums equal those of reducing after
// the backward, bit for bit. Sharded, a bucket is reduce-scattered: each rank keeps its segment's gradient,
// f32 master weights and AdamW moments, and the model's weights (bf16 where the forward computes in bf16)
// are all-gathered after the update. A weight the forward reads as an FP8 copy (ParamShard::fp8, 128x128
// blocks) has a bucket of its own whose segments are whole 128-row block rows: AdamW writes the copy's data
// and scales of its segment (kernels/adamw_fp8.h), those are what is gathered (Megatron-LM's
// --fp8-param-gather), and each rank rebuilds the transpose; the f32 weights of the other segments are
// stale then (nothing reads them: the forward reads the copy, a checkpoint the gathered masters).
// docs/DESIGN.md §9 has the streams and the memory; tests: tests/mpi/test_dp_train.cpp, test_grad_reducer.cpp,
// test_data_parallel.cpp, test_fp8_gather.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "engine/autograd.h"
#include "engine/fp8_weight.h"
#include "engine/stream.h"
#include "parallel/collectives.h"
#include "parallel/param_shard.h"
#include "parallel/process_group.h"

namespace flowmoe {

// 25 MiB of f32 per all-reduce, as PyTorch DDP buckets: few calls, each large enough to run at bandwidth.
constexpr size_t kGradientBucketBytes = kFlatBucketBytes;

class GradientReducer {
 public:
  // params and shards as the model lists them (shards[i].expert: over the expert-data-parallel group).
  // overlap: reduce each bucket during the backward as soon as it is complete; otherwise in finish().
  // Collective when the world's backend is nccl (and it overlaps or max_ctas > 0): it splits off the
  // communicators it reduces on, whose kernels take at most max_ctas thread blocks (0: as many as nccl
  // chooses), leaving the other SMs to the backward that runs beside them. The plain schedule reduces
  // under the same bound, since NCCL's algorithm depends on it: both schedules give the same sums.
  // shard: the sharded form above (the parameters' data move into the buckets' weight buffers here), its
  // model weights in weight_dtype (precision.param_dtype: the forward's dtype, or f32) except where
  // shards[i].reads_f32.
  GradientReducer(const ParallelState& ps, std::vector<Variable> params, const std::vector<ParamShard>& shards,
                  bool overlap, size_t bucket_bytes = kGradientBucketBytes, int max_ctas = 0, bool shard = false,
                  DType weight_dtype = DType::f32);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  // Sharded: at most this many whole gradient buckets exist during the backward. Before it fills another,
  // the compute stream waits for the oldest one's reduce-scatter, keeps its segment (1/G) and frees it.
  static constexpr size_t kBucketsInFlight = 4;

  // Wrap the backward of the step's last micro-batch: begin() before it arms the hook (the earlier
  // micro-batches only accumulate), finish() after it reduces what is left, in order, and leaves every
  // parameter with the global batch's gradient (a parameter no rank had a gradient for keeps none).
  // Sharded, the parameters keep no gradient: range_grads() holds this rank's segments of them.
  void begin();
  void finish();

  // Sharded: per parameter, the elements of its flat data in this rank's segments (AdamW's ranges), and
  // after finish() their reduced gradient (1-D f32 of the range's length, a view of the bucket's gradient
  // segment: valid until release_grads(); undefined where no rank of the group had a gradient or the range
  // is empty); then the all-gather of the updated weights, after which the compute stream may read
  // every parameter.
  bool sharded() const { return shard_; }
  const std::vector<std::pair<int64_t, int64_t>>& owned_ranges() const { return ranges_; }
  // Sharded: per parameter, the f32 master weights of its range (1-D views of the buckets' master segments;
  // undefined where the range is empty): AdamW's masters.
  const std::vector<Tensor>& master_ranges() const { return master_ranges_; }
  const std::vector<Tensor>& range_grads() const { return range_grads_; }
  // Sharded: per parameter, the FP8 copy whose data and scales the gather moves in place of the weight (AdamW
  // writes its segment: AdamW::set_fp8_copies); null for the others.
  std::vector<std::shared_ptr<Fp8WeightCopy>> gathered_fp8_copies() const;
  // Marks the gathered FP8 copies current for their weights' versions (after gather_weights; after a CUDA
  // graph's replay, which moved the versions without running the host code).
  void mark_fp8_current() const;
  // Sharded: frees the gradient segments once the optimizer has read them (they exist from a bucket's
  // reduction until then, so the forward's and the early backward's peak does not hold them).
  void release_grads();
  void gather_weights();
  // The forward stage that first reads each parameter (Transformer::parameter_stages): with nccl the
  // gather runs on the reduction stream, bucket by bucket in stage order, and the compute stream waits
  // for a bucket only at wait_stage() of its earliest stage, so the gather overlaps the forward until
  // then. wait_weights() waits for every bucket (before a checkpoint reads them, or a CUDA graph's
  // capture begins; a captured gather waits for itself). Without stages every bucket is waited for at
  // the first stage.
  void set_stages(const std::vector<int64_t>& stages);
  void wait_stage(int64_t stage);
  void wait_weights() { wait_stage(INT64_MAX); }
  // Sharded: every parameter's whole values (its local shape) from the ranks' segments, for a checkpoint;
  // collective over the data-parallel groups, a bucket at a time. keep false: gathered and dropped (a rank that
  // writes nothing); kept ones are on the host. full_ranges gathers per-parameter tensors of its owned_ranges()
  // in dtype (AdamW's moments), full_masters the f32 master weights.
  std::vector<Tensor> full_ranges(const std::vector<Tensor>& ranges, DType dtype, bool keep);
  std::vector<Tensor> full_masters(bool keep);
  // Sharded: every parameter's master range and model weights from its whole f32 values (a checkpoint's, of
  // the parameters' shapes, on any device).
  void load_masters(const std::vector<Tensor>& whole);

  int64_t num_buckets() const { return int64_t(buckets_.size()); }
  // Buckets the last backward launched before finish(): how much of the reduction it could overlap.
  int64_t num_launched_in_backward() const { return launched_in_backward_; }
  bool overlaps() const { return overlap_; }
  // Buckets the last reduction reduced in their one gradient's own buffer, with no copy into a flat one.
  int64_t num_reduced_in_place() const { return reduced_in_place_; }

  // Tests only (null in a run): a hook that enqueues work of its own at these points of a GPU reduction,
  // on the stream named, with the buffer concerned. A test delays one stream there, so that a wait the
  // schedule lacks between the compute stream and the reduction's shows as wrong sums.
  enum class HookPoint : uint8_t {
    bucket_copy,  // the compute stream, before a bucket's gradients are copied into its new flat buffer
    reduction,    // the reduction's stream, before a bucket's all-reduce or reduce-scatter
    gather,       // the reduction's stream, before a bucket's weights are all-gathered
  };
  using StreamHook = void (*)(HookPoint point, cudaStream_t stream, const Tensor& buffer);
  // Process-wide: the reducers a test makes itself and those of a training run it starts.
  static void set_stream_hook(StreamHook hook);

 private:
  struct Bucket {
    int group = 0;               // 0: the world (dense), 1: the expert-data-parallel group
    std::vector<size_t> params;  // indices into params_
    int64_t numel = 0;
    int pending = 0;                  // gradients not yet final in this backward
    Tensor flat;                      // the bucket's gradients side by side, reduced in place
    int64_t padded = 0;               // sharded: numel rounded up to a multiple of the group's size
    DType dtype = DType::f32;         // sharded: the dtype of weights
    Tensor weights;                   // sharded: [padded], the parameters' data (they are views of it)
    Tensor master;                    // sharded: [padded / G] f32, the master weights of this rank's segment
    Tensor grad_segment;              // sharded: [padded / G], this rank's segment of flat once reduced, until
                                      // release_grads()
    std::unique_ptr<Event> reduced;   // sharded, nccl: recorded on the reduction stream after its reduction
    int64_t stage = 0;                // the first forward stage that reads one of its parameters
    std::unique_ptr<Event> gathered;  // nccl: recorded on the reduction stream after its all-gather
    bool awaited = true;              // the compute stream waits for its last gather already
    // Sharded, a weight read as an FP8 copy: the copy, whose q and scale_inv are views of these [padded] e4m3
    // and [padded / (128 K) * ceil(K / 128)] f32 buffers, gathered in place of weights.
    std::shared_ptr<Fp8WeightCopy> fp8;
    Tensor fp8_q, fp8_scales;
  };
  // Sharded: this rank's segment [begin, end) of bucket b's flat layout.
  std::pair<int64_t, int64_t> segment(const Bucket& b) const;
  void shard_buckets();
  // Sharded: whether p's FP8 copy is gathered in its place (a bucket of its own), b's copy's buffers laid out as
  // its segments (shard_buckets), and their gather with the transpose rebuilt (grad_reducer_fp8.cpp).
  static bool gathers_fp8(const Variable& p, const ParamShard& s);
  void shard_fp8_copy(Bucket& b);
  void gather_fp8(Bucket& b);
  // Sharded: per parameter, its whole values (its local shape; on the host) from every rank's segment of
  // each bucket, which fill(b, segment) writes ([padded / G] of dtype on the bucket's device). Collective.
  template <class Fill>
  std::vector<Tensor> gather_segments(Fill&& fill, DType dtype, bool keep);
  // The group's own communicator (the world, or the expert-data-parallel group with expert parallelism).
  const std::shared_ptr<Communicator>& group_communicator(int group) const;
  // The bucket's parameters' gradients become views of b.flat.
  void view_grads(const Bucket& b);
  // Sharded: out[i] becomes the view of parameter i's range in mine, a tensor laid out as this rank's segment
  // of b (its master, its reduced gradient); a parameter with an empty range is left alone.
  void view_ranges(const Bucket& b, const Tensor& mine, std::vector<Tensor>& out) const;
  // Sharded: b's parameters' f32 values side by side in its layout, zero padded (value(i): parameter i's,
  // of its shape, on any device); set_values writes b's master segment and model weights from them in place.
  template <class Value>
  Tensor packed_values(const Bucket& b, Value&& value) const;
  void set_values(Bucket& b, const Tensor& values);
  void on_leaf(VariableImpl& leaf);
  void launch(Bucket& b);
  // Sharded: the compute stream waits for b's reduction, copies b's segment out into b.grad_segment and frees
  // b.flat (safe to reuse then: both streams are past it).
  void retire(Bucket& b);
  void exchange_presence(int group);
  // Calls the stream hook, if any, on the stream `point` names.
  void call_hook(HookPoint point, const Tensor& buffer) const;

  const ParallelState ps_;  // a copy: a few shared pointers, and no tie to the caller's lifetime
  std::vector<Variable> params_;
  std::unordered_map<const VariableImpl*, size_t> index_of_;
  std::vector<size_t> bucket_of_;
  std::vector<Bucket> buckets_;
  std::vector<bool> final_;    // per parameter, in this backward
  std::vector<bool> missing_;  // per parameter: no gradient here when its bucket was launched
  size_t next_ = 0;            // the next bucket to launch
  int64_t launched_in_backward_ = 0, reduced_in_place_ = 0;
  bool overlap_ = false, armed_ = false, shard_ = false;
  std::vector<std::pair<int64_t, int64_t>> ranges_;  // sharded: per parameter, its elements in our segments
  std::vector<size_t> gather_order_;                 // sharded: the buckets in the order the forward first reads them
  std::vector<size_t> in_flight_;                    // sharded: buckets launched and not yet retired, oldest first
  std::vector<Tensor> range_grads_;                  // sharded: per parameter, after finish()
  std::vector<Tensor> master_ranges_;                // sharded: per parameter, views of the buckets' masters
  double scale_ = 1.0;  // 1 / W: expert shards' sums over their W / E replicas become the global mean
  // nccl: the groups' communicators on the reduction stream, and the events that order it.
  std::shared_ptr<Communicator> comms_[2];
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> grads_ready_, reduced_;
  std::unique_ptr<LeafGradHookGuard> hook_;
};

}  // namespace flowmoe
