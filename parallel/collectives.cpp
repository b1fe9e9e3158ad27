// Flat-bucket reductions and host values over the ranks (see collectives.h).
#include "parallel/collectives.h"

#include "engine/ops/ops.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace {

// Reduces tensors[first, last) through one flat buffer (or in place, for a lone contiguous tensor).
void reduce_bucket(Communicator& comm, const std::vector<Tensor>& tensors, size_t first, size_t last, ReduceOp op,
                   double scale) {
  const Tensor& head = tensors[first];
  const bool scaled = op == ReduceOp::sum && scale != 1.0;
  if (last == first + 1 && head.is_contiguous() && !scaled) {
    comm.all_reduce(head, op);
    return;
  }
  int64_t numel = 0;
  for (size_t i = first; i < last; ++i) numel += tensors[i].numel();
  Tensor flat = Tensor::empty({numel}, head.dtype(), head.device());
  int64_t offset = 0;
  for (size_t i = first; i < last; ++i) {
    const Tensor& t = tensors[i];
    flat.slice(0, offset, offset + t.numel()).view(t.shape()).copy_(t);
    offset += t.numel();
  }
  comm.all_reduce(flat, op);
  if (scaled) flat = tensor_scale(flat, scale);
  offset = 0;
  for (size_t i = first; i < last; ++i) {
    Tensor t = tensors[i];
    t.copy_(flat.slice(0, offset, offset + t.numel()).view(t.shape()));
    offset += t.numel();
  }
}

}  // namespace

void all_reduce_flat(Communicator& comm, const std::vector<Tensor>& tensors, ReduceOp op, double scale,
                     size_t bucket_bytes) {
  if (tensors.empty()) return;
  const DType dtype = tensors[0].dtype();
  const Device device = tensors[0].device();
  for (const Tensor& t : tensors)
    FLOWMOE_CHECK(t.dtype() == dtype && t.device() == device, DTypeError, "all_reduce_flat: ", t.describe(), " beside ",
                  tensors[0].describe(), ": one bucket holds one dtype on one device");
  const size_t elem = dtype_size(dtype);
  size_t first = 0;
  while (first < tensors.size()) {
    size_t last = first + 1, bytes = size_t(tensors[first].numel()) * elem;
    while (last < tensors.size() && bytes + size_t(tensors[last].numel()) * elem <= bucket_bytes)
      bytes += size_t(tensors[last++].numel()) * elem;
    reduce_bucket(comm, tensors, first, last, op, scale);
    first = last;
  }
}

std::vector<double> all_reduce_values(Communicator& comm, const std::vector<double>& values, ReduceOp op) {
  if (comm.size() == 1 || values.empty()) return values;
  // Through the host side (nccl's mpi bootstrap): a device copy would wait for the GPU's whole queue.
  Communicator& host = comm.host_communicator();
  Tensor t = Tensor::from_doubles(values, {int64_t(values.size())}, DType::f64, host.native_device());
  host.all_reduce(t, op);
  host.synchronize();
  return t.to_doubles();
}

bool on_every_rank(Communicator& comm, bool value) {
  return all_reduce_values(comm, {value ? 0.0 : 1.0}, ReduceOp::max)[0] == 0;
}

}  // namespace flowmoe
