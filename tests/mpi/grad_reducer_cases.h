// The gradient reducer's checks (parallel/grad_reducer.h), shared by test_grad_reducer.cpp (test_comm: the
// world it runs in, on the CPU and through NCCL with a GPU per rank) and test_nccl_one_rank.cpp (a
// one-rank NCCL world on one GPU, eagerly and captured as a CUDA graph). A real model's backward on
// token ids that encode the rank, so every rank's gradients differ.
#pragma once
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "config/config.h"
#include "engine/device.h"
#include "engine/tensor.h"
#include "parallel/process_group.h"

namespace flowmoe::test {

constexpr int64_t kExperts = 4;  // moe_config's routed experts
// 16 KiB buckets: a dozen of them, so that the overlap has something to launch early.
constexpr size_t kTestBucketBytes = 16 << 10;

Config moe_config();
// Rank r's micro-batch a: token ids that depend on both.
Tensor coded_ids(int rank, int a);

// One reduction of moe_config's gradients by a fresh model and reducer.
struct ReduceRun {
  bool overlap = true;  // buckets launched during the backward, else in finish()
  int micro_batches = 2;
  Device device = Device::cpu();
  size_t bucket_bytes = kTestBucketBytes;
  int max_ctas = 0;
  // After an eager step (which makes the cuBLASLt plans), the step is captured as one CUDA graph
  // (engine/cuda_graph.h) and replayed: its gradients are the replay's.
  bool captured = false;
};
struct Reduced {
  std::vector<std::vector<float>> grads;  // per parameter; empty where it has none
  int64_t launched_early = 0;             // buckets launched before finish()
  int64_t buckets = 0;
  int64_t in_place = 0;  // buckets reduced in their one gradient's own buffer
};
Reduced reduced_gradients(const ParallelState& ps, const ReduceRun& run);

// got[j] and want[j] * factor sum the same terms over `ranks` ranks: bit for bit at 2 or fewer, where a + b
// is one sum; at more, MPI may add them in another order, off by ulps of the terms (scale: the largest),
// which may be far larger than the sum. factor 2 (exact) is what test_nccl_one_rank.cpp's hook makes of
// every reduced buffer.
::testing::AssertionResult same_sums(const float* got, const float* want, size_t n, double scale, int ranks,
                                     float factor = 1);
double largest_magnitude(const std::vector<float>& v);

// Overlapped reductions against the plain schedule's on the same reducer settings, every parameter, bit for
// bit at 2 or fewer ranks; the overlap launched every bucket during the backward. `overlapped` may be captured;
// the plain one is run eagerly, and its sums are multiplied by factor.
void check_overlap_gives_plain_sums(const ParallelState& ps, const ReduceRun& overlapped, float factor = 1);

// A bucket of one parameter reduces that gradient where it lies, with no copy into a flat buffer: the same
// sums as the gradients copied side by side into one bucket per group (bit for bit at 2 ranks, where a + b
// is one sum; MPI may order 4 ranks' sums otherwise for messages of other sizes). The one-parameter
// buckets may be captured; the whole ones are reduced eagerly.
void check_lone_gradients(const ParallelState& ps, Device device, bool captured = false);

// The sharded form: rank r's segment of each bucket holds the plain reduction's sums, the segments of a
// group cover each parameter exactly once, and gather_weights() gives every rank of the group the values
// each owner wrote into its segment. bucket_bytes 4: a parameter per bucket, its gradient reduce-scattered
// where it lies wherever the group's size divides it. captured: the reduction and then the gather each
// captured as a CUDA graph after an eager run and replayed.
void check_sharded_reduction(const ParallelState& ps, Device device, size_t bucket_bytes = kTestBucketBytes,
                             bool captured = false, float factor = 1);

// Parameters that only rank 0 has a gradient for and that no rank has: zero in the sum where missing,
// none where no rank had one; sharded, the same sums in this rank's ranges. captured: as above.
void check_missing_gradients(const ParallelState& ps, Device device, bool shard, bool captured = false,
                             float factor = 1);

}  // namespace flowmoe::test
