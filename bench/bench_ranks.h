// What benchmarks across ranks share (bench_dispatch): starting the ranks with the communicator to
// measure, timing a collective op as its slowest rank sees it, and the all-to-all ceiling. Host code
// only, built with or without CUDA: a target built with CUDA defines FLOWMOE_BENCH_CUDA for the one
// call that needs the runtime (a GPU's UUID).
#pragma once
#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#ifdef FLOWMOE_BENCH_CUDA
#include <cuda_runtime.h>

#include "kernels/common/cuda_check.h"
#endif
#include "kernels/common/device_api.h"
#include "parallel/backends.h"
#include "parallel/distributed.h"

namespace flowmoe {

struct BenchWorld {
  DistributedRuntime rt;                       // the host communicator (none or mpi) and this rank's device
  std::shared_ptr<Communicator> comm;          // the one measured: rt.world, or nccl bootstrapped over it
  std::shared_ptr<Communicator> nccl_ceiling;  // an mpi run where nccl could run too (a GPU per rank), else null
  std::string note;                            // for rank 0 to say once
  bool skipped = false;                        // nccl asked for on ranks that share a GPU: note says so
  Communicator& host() const { return *rt.world; }
};

// A GPU's UUID: device indices depend on each process's CUDA_VISIBLE_DEVICES, its UUID does not.
inline std::array<int64_t, 2> gpu_uuid(int device) {
#ifdef FLOWMOE_BENCH_CUDA
  cudaDeviceProp prop{};
  FLOWMOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  std::array<int64_t, 2> id{};
  std::memcpy(id.data(), prop.uuid.bytes, sizeof(id));
  return id;
#else
  throw_no_cuda("gpu_uuid");
#endif
}

// Whether two ranks drive the same GPU (nccl refuses that). Collective over the host communicator.
inline bool ranks_share_a_gpu(Communicator& host, int device) {
  const std::array<int64_t, 2> id = gpu_uuid(device);
  const std::vector<int64_t> all = host.all_gather(Tensor::from_ints({id[0], id[1]}, {1, 2}, DType::i64)).to_ints();
  for (size_t a = 0; a < all.size(); a += 2)
    for (size_t b = a + 2; b < all.size(); b += 2)
      if (all[a] == all[b] && all[a + 1] == all[b + 1]) return true;
  return false;
}

// The ranks, on GPUs unless `cpu` or none is visible. nccl is bootstrapped here, over the host
// communicator, once every rank knows whether two ranks share a GPU: init_distributed would refuse
// only on the ranks past the GPU count and leave the others waiting. There nccl by name is skipped
// and auto takes mpi.
inline BenchWorld make_bench_world(CommBackend requested, bool cpu, const std::string& name) {
  BenchWorld w;
  const bool use_cuda = !cpu && cuda_available();
  const LaunchInfo launch = detect_launch();
  const CommBackend want = resolve_backend(requested, launch.world_size, use_cuda, built_with_nccl());
  const CommBackend host = want != CommBackend::nccl ? want
                           : launch.world_size > 1   ? CommBackend::mpi
                                                     : CommBackend::none;
  w.rt = init_distributed({host, use_cuda, ""});
  w.comm = w.rt.world;
  const bool shared = use_cuda && w.host().size() > 1 && ranks_share_a_gpu(w.host(), w.rt.device.index);
  if (want == CommBackend::nccl && shared) {
    const std::string why = "ranks share a GPU (nccl needs one GPU per rank; mpi stages through host memory)";
    w.skipped = requested == CommBackend::nccl;
    w.note = w.skipped ? name + ": backend nccl skipped: " + why : "backend auto takes mpi, not nccl: " + why;
  } else if (want == CommBackend::nccl) {
    w.comm = make_nccl_communicator(w.rt.world, w.rt.device.index);
  } else if (use_cuda && !shared && w.host().size() > 1 && built_with_nccl()) {
    w.nccl_ceiling = make_nccl_communicator(w.rt.world, w.rt.device.index);
  }
  return w;
}

struct RankTiming {
  double ms = 0;            // median over the reps of the slowest rank's time
  uint64_t host_syncs = 0;  // num_host_syncs() over one call
};

// Waits for this rank's device work and its collectives.
inline void drain(Communicator& comm, Device device) {
  if (device.is_cuda()) cuda_synchronize(device.index);
  comm.synchronize();
}

// Host clock: each rep runs `prep` (untimed, may be empty), drains the device, meets the other ranks
// at a barrier, then times `op` up to the device drained again: what a training step waits for. A rep
// counts as its slowest rank's time (a collective is done when its last rank is).
inline RankTiming time_across_ranks(const BenchWorld& w, Communicator& comm, int warmup, int reps,
                                    const std::function<void()>& op, const std::function<void()>& prep = {}) {
  RankTiming t;
  std::vector<double> ms;
  for (int i = 0; i < warmup + reps; ++i) {
    if (prep) prep();
    drain(comm, w.rt.device);
    w.host().barrier();
    const uint64_t syncs = num_host_syncs();
    const auto start = std::chrono::steady_clock::now();
    op();
    drain(comm, w.rt.device);
    const auto stop = std::chrono::steady_clock::now();
    t.host_syncs = num_host_syncs() - syncs;
    if (i >= warmup) ms.push_back(std::chrono::duration<double, std::milli>(stop - start).count());
  }
  Tensor slowest = Tensor::from_doubles(ms, {int64_t(ms.size())});
  w.host().all_reduce(slowest, ReduceOp::max);
  ms = slowest.to_doubles();
  std::sort(ms.begin(), ms.end());
  t.ms = ms[ms.size() / 2];
  return t;
}

// The ceiling of an exchange: comm.all_to_all of u8 rows of row_bytes, rows_per_peer to every rank
// (itself included); GB/s of the bytes to other ranks (one rank: of the bytes it copies).
inline double all_to_all_gbps(const BenchWorld& w, Communicator& comm, int warmup, int reps, int64_t rows_per_peer,
                              int64_t row_bytes) {
  const int n = comm.size();
  const Shape shape{n * rows_per_peer, row_bytes};
  const Tensor send = Tensor::zeros(shape, DType::u8, w.rt.device), recv = Tensor::empty(shape, DType::u8, w.rt.device);
  const std::vector<int64_t> rows(size_t(n), rows_per_peer);
  const RankTiming t = time_across_ranks(w, comm, warmup, reps, [&] { comm.all_to_all(send, rows, recv, rows); });
  return double(std::max(n - 1, 1) * rows_per_peer * row_bytes) / (t.ms * 1e6);
}

}  // namespace flowmoe
