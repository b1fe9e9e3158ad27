// Evaluation: the validation loss of a model, on one process or split over the ranks, and how many
// validation batches a request can have. Defined in evaluation.cpp; tests: tests/test_trainer.cpp.
#pragma once
#include <cstdint>
#include <string>

#include "dataset/data.h"
#include "layers/transformer.h"
#include "parallel/communicator.h"

namespace flowmoe {

// How many validation micro-batches an evaluation reads: at most the whole batches the split holds,
// since more would wrap around and count sequences twice. A split smaller than one batch is read as
// one batch of all its sequences.
struct ValBatches {
  int64_t num_batches = 0, batch_size = 0, num_windows = 0;
  int64_t num_requested = 0;
  bool capped = false;  // the request was more than the split holds
  // For a capped request given as `key` ("--batches " or "train.eval_batches = "): "--batches 100 is
  // more than the validation split holds (51 batches of 8); using 51".
  std::string cap_note(const std::string& key) const;
};
ValBatches whole_val_batches(const DataLoader& data, int64_t num_batches, int64_t batch_size);

// Mean loss over `num_batches` validation micro-batches (no graph is recorded). With a communicator of
// several ranks, each evaluates its slice of every batch and the token-weighted sums are all-reduced:
// every rank returns the loss of the whole batches, equal to one process's up to the order of the sums.
double evaluate(const Transformer& model, const DataLoader& data, int64_t num_batches, int64_t batch_size,
                Communicator* comm = nullptr);

}  // namespace flowmoe
