// Collectives built on a Communicator: tensors reduced through flat buckets (a few large calls instead of
// one per tensor), and a few host values reduced over the ranks. Tests: tests/mpi/test_data_parallel.cpp.
#pragma once
#include <cstddef>
#include <vector>

#include "parallel/communicator.h"

namespace flowmoe {

constexpr size_t kFlatBucketBytes = size_t(25) << 20;  // all_reduce_flat's default bucket

// Reduces tensors of one dtype and device over the ranks, in place, through flat buffers of at most
// bucket_bytes (one tensor larger than that goes alone): one collective per bucket, not per tensor.
// After a sum, every element is multiplied by `scale` (1: left as reduced).
void all_reduce_flat(Communicator& comm, const std::vector<Tensor>& tensors, ReduceOp op, double scale = 1.0,
                     size_t bucket_bytes = kFlatBucketBytes);

// A few host values reduced over the ranks (a step's losses, flags, peak memory), through the
// communicator's host side (Communicator::host_communicator): no device copy; blocks until done.
std::vector<double> all_reduce_values(Communicator& comm, const std::vector<double>& values, ReduceOp op);

// Whether `value` holds on every rank (a logical AND through the host side, as all_reduce_values): every
// rank gets the same answer, for a decision that ranks must take alike.
bool on_every_rank(Communicator& comm, bool value);

}  // namespace flowmoe
