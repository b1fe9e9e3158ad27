// Data parallelism over the world communicator (expert-parallel size 1): every rank holds the same
// weights and optimizer state and reads its own slice of each global batch (DataLoader's parts);
// what the ranks must agree on after a backward is reduced here, so that every rank takes the same
// update the single-process run takes on the whole batch, up to the order of the float sums.
#pragma once
#include <cstddef>
#include <vector>

#include "engine/autograd.h"
#include "parallel/communicator.h"

namespace flowmoe {

// 25 MiB of f32 per all-reduce, as PyTorch DDP buckets: few calls, each large enough to run at bandwidth.
constexpr size_t kGradientBucketBytes = size_t(25) << 20;

// Reduces tensors of one dtype and device over the ranks, in place, through flat buffers of at most
// bucket_bytes (one tensor larger than that goes alone): one collective per bucket, not per tensor.
// After a sum, every element is multiplied by `scale` (1: left as reduced).
void all_reduce_flat(Communicator& comm, const std::vector<Tensor>& tensors, ReduceOp op, double scale = 1.0,
                     size_t bucket_bytes = kGradientBucketBytes);

// The gradient of the global batch from each rank's gradient of its slice: every slice holds B/N
// sequences of the same length and each rank's loss is the mean over its slice's tokens, so the
// global mean loss is the mean of the ranks' losses and its gradient the mean of their gradients.
// Sums every parameter's gradient over the ranks and divides by the world size. A gradient missing
// on a rank counts as zero there; a parameter gets a gradient on every rank when any rank had one,
// and keeps none when no rank had one (AdamW then leaves it alone, as in a single process).
void all_reduce_gradients(Communicator& comm, const std::vector<Variable>& params,
                          size_t bucket_bytes = kGradientBucketBytes);

// A few host values reduced over the ranks (a step's losses, flags, peak memory); blocks until done.
std::vector<double> all_reduce_values(Communicator& comm, const std::vector<double>& values, ReduceOp op);

}  // namespace flowmoe
