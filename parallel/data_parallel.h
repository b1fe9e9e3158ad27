// Data parallelism over the world communicator: every rank reads its own slice of each global batch
// (DataLoader's parts) and holds the same dense weights; with expert parallelism the ranks of an
// expert-data-parallel group hold the same expert shards. What the ranks must agree on after a
// backward is reduced here, so that every rank takes the update the single-process run takes on the
// whole batch, up to the order of the float sums.
#pragma once
#include <cstddef>
#include <utility>
#include <vector>

#include "engine/autograd.h"
#include "parallel/collectives.h"
#include "parallel/communicator.h"
#include "parallel/grad_reducer.h"  // kGradientBucketBytes
#include "parallel/param_shard.h"
#include "parallel/process_group.h"

namespace flowmoe {

// The gradient of the global batch from each rank's gradient of its slice: every slice holds B/N
// sequences of the same length and each rank's loss is the mean over its slice's tokens, so the
// global mean loss is the mean of the ranks' losses and its gradient the mean of their gradients.
// Averages every parameter's gradient over the ranks of comm, through a GradientReducer without overlap
// (grad_reducer.h: the buckets the trainer reduces). A gradient missing on a rank counts as zero there;
// a parameter gets a gradient on every rank when any rank had one, and keeps none when no rank had one
// (AdamW then leaves it alone, as in a single process).
void all_reduce_gradients(Communicator& comm, const std::vector<Variable>& params,
                          size_t bucket_bytes = kGradientBucketBytes);

// The same with expert parallelism: dense parameters over the world, expert weights (shards[i].expert)
// over the expert-data-parallel group, each in buckets of its own, both divided by the world size W.
// An expert's gradient already holds its expert-parallel peers' tokens (dispatch's backward brought
// them), and every rank's loss is the mean over its own slice: the sum over the W / E replicas of the
// expert, divided by W, is the global batch's gradient. At expert-parallel size 1 this is
// all_reduce_gradients(*ps.world, params).
void all_reduce_gradients(const ParallelState& ps, const std::vector<Variable>& params,
                          const std::vector<ParamShard>& shards, size_t bucket_bytes = kGradientBucketBytes);

// The global norm of the synced gradients from this rank's sums of their squares, split as {dense, expert
// shards} (AdamW::grad_square_sums), the same on every rank. With expert parallelism a rank's expert gradients
// are its share of the experts: their squares are summed over the expert-parallel group, the dense ones (whole
// everywhere) counted once. A sharded optimizer's squares are summed over each parameter's data-parallel
// group first. train/optimizer.h's global_grad_norm reads the sums from AdamW.
double global_norm(const ParallelState& ps, std::pair<double, double> square_sums, bool sharded);
// The same on the device: sums [2] f32 (AdamW::grad_square_sums_device: {dense, expert shards}) becomes
// the global batch's, in place, on the collectives' streams (sharded: each rank's segments summed first).
void reduce_square_sums(const ParallelState& ps, const Tensor& sums, bool sharded);
// The flags AdamW's squared-norm sums split the gradients by: each parameter's shards[i].expert with
// expert parallelism, none (one class) at expert-parallel size 1.
std::vector<bool> expert_shard_flags(const ParallelState& ps, const std::vector<ParamShard>& shards);

}  // namespace flowmoe
