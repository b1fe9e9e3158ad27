// Evaluation: the validation loss of a model, on one process or split over the ranks, and how many
// validation batches a request can have (see evaluation.h).
#include "train/evaluation.h"

#include <algorithm>

#include "kernels/common/error.h"
#include "parallel/collectives.h"
#include "parallel/expert_parallel.h"

namespace flowmoe {

double evaluate(const Transformer& model, const DataLoader& data, int64_t num_batches, int64_t batch_size,
                Communicator* comm) {
  NoGradGuard no_grad;
  const int parts = comm ? comm->size() : 1, part = comm ? comm->rank() : 0;
  if (parts == 1) {
    double total = 0;
    for (int64_t i = 0; i < num_batches; ++i) {
      Batch b = data.val_batch(i, batch_size);
      total += double(model.losses(b.inputs, b.targets).lm.data().to_floats()[0]);  // the LM loss alone
    }
    return total / double(num_batches);
  }
  // Each slice's mean times its sequences: slices differ in size where the ranks do not divide the batch.
  // An expert-parallel forward is collective over its group (tokens travel to their experts' ranks), so
  // there a rank with an empty slice still runs it, with no sequences, and counts nothing.
  const bool collective_forward = holds_expert_shards(model.parameters(), model.parameter_shards());
  double weighted = 0;
  for (int64_t i = 0; i < num_batches; ++i) {
    Batch b = data.val_batch(i, batch_size, part, parts);
    const int64_t sequences = b.inputs.size(0);
    if (sequences == 0 && !collective_forward) continue;
    const Variable lm = model.losses(b.inputs, b.targets).lm;
    if (sequences > 0) weighted += double(lm.data().to_floats()[0]) * double(sequences);
  }
  const double total = all_reduce_values(*comm, {weighted}, ReduceOp::sum)[0];
  return total / double(num_batches * batch_size);
}

ValBatches whole_val_batches(const DataLoader& data, int64_t num_batches, int64_t batch_size) {
  const int64_t num_windows = data.num_val_windows();
  FLOWMOE_CHECK(num_windows > 0, Error, "the data holds out no validation sequences (data.val_fraction is 0)");
  ValBatches v;
  v.batch_size = std::min(batch_size, num_windows);
  v.num_windows = num_windows;
  const int64_t whole = num_windows / v.batch_size;
  v.num_requested = num_batches;
  v.capped = num_batches > whole;
  v.num_batches = std::min(num_batches, whole);
  return v;
}

std::string ValBatches::cap_note(const std::string& key) const {
  return key + std::to_string(num_requested) + " is more than the validation split holds (" +
         std::to_string(num_windows / batch_size) + " batches of " + std::to_string(batch_size) + "); using " +
         std::to_string(num_batches);
}

}  // namespace flowmoe
