// Memory for tensors, with live/peak accounting on every device.
//
// CUDA memory goes through a caching allocator: freed blocks are kept in a size-ordered pool and
// handed out again, so a training step does not call cudaMalloc/cudaFree. Engine work runs on one
// stream per device (kernels/common/device_api.h), so a freed block may be reused at once: any later use is
// ordered after the last kernel that touched it. The exception is a side branch (engine/stream_lane.h):
// while one is open, a block freed by the side stream's work is held back, and one freed by the compute
// stream's goes back to the compute stream alone, since the other stream may not have passed it yet.
#pragma once
#include <cstddef>
#include <functional>
#include <map>
#include <mutex>
#include <vector>

#include "engine/device.h"

namespace flowmoe {

struct MemoryStats {
  size_t live_bytes = 0;      // bytes handed out and not yet freed (after rounding)
  size_t peak_bytes = 0;      // max of live_bytes since the last reset_peak
  size_t reserved_bytes = 0;  // live + cached (what the device has given us)
  size_t num_allocs = 0;      // allocate() calls
  size_t num_raw_allocs = 0;  // calls that reached the device allocator (cache misses)
};

// A caching allocator over raw alloc/free functions. Used for CUDA (cudaMalloc/cudaFree); the
// tests drive it with malloc/free to check its accounting without a GPU.
class CachingAllocator {
 public:
  using RawAlloc = std::function<void*(size_t)>;
  using RawFree = std::function<void(void*)>;
  CachingAllocator(RawAlloc raw_alloc, RawFree raw_free);
  ~CachingAllocator();
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // nbytes may be 0: returns nullptr. on_side: for (or freed by) the side stream's work, which matters
  // only while releases are held.
  void* allocate(size_t nbytes, bool on_side = false);
  void release(void* ptr, bool on_side = false);
  void empty_cache();  // returns every cached block to the device
  MemoryStats stats() const;
  void reset_peak();
  static size_t round_size(size_t nbytes);

  // A private pool (CUDA graphs, engine/cuda_graph.h): while one is open, allocations come from it
  // alone, and its blocks return to it whenever they are freed, so a captured graph keeps its
  // addresses for every replay and no other tensor is ever handed one of them. release_pool gives
  // the pool's free blocks to the cache once the graph is gone (blocks still live join it when freed).
  int open_pool();
  void close_pool();
  void release_pool(int pool);

  // Between a side branch's fork and its join (engine/stream_lane.h). A block the side stream's work
  // frees stays out of every pool and counts as live (the peak includes it): the compute stream may
  // not reuse it while the side stream may still read it. A block the compute stream's work frees may
  // serve the compute stream's next allocations at once (its stream order covers them), but not the
  // side stream's, which would not wait for its last use. The side stream allocates only blocks free
  // before the fork. release_held returns both kinds to the pools once both streams are past them.
  void hold_releases();
  void release_held();

 private:
  RawAlloc raw_alloc_;
  RawFree raw_free_;
  mutable std::mutex mu_;
  std::multimap<size_t, void*> free_blocks_;  // size -> block
  std::map<void*, size_t> live_blocks_;       // block -> size
  int open_pool_ = 0;                         // 0: none open
  int num_pools_ = 0;
  std::map<void*, int> pool_of_;                           // block -> its private pool
  std::map<int, std::multimap<size_t, void*>> pool_free_;  // pool -> its free blocks
  bool holding_ = false;
  std::vector<void*> held_;                    // freed by the side stream while holding
  std::multimap<size_t, void*> compute_free_;  // freed by the compute stream while holding: its own
  MemoryStats stats_;
  void empty_cache_locked();
  void* take_compute_free(size_t size);
  void return_to_pool(void* ptr, size_t size);
};

// Allocation entry points used by Storage. CPU memory is 64-byte aligned and not cached.
void* device_allocate(size_t nbytes, Device device);
void device_release(void* ptr, Device device);
MemoryStats memory_stats(Device device);
void reset_peak_memory(Device device);
void empty_cache(Device device);
// CachingAllocator::open_pool and its kin on a CUDA device.
int open_memory_pool(Device device);
void close_memory_pool(Device device);
void release_memory_pool(Device device, int pool);
// CachingAllocator::hold_releases and release_held on a CUDA device (nothing on the CPU).
void hold_memory_releases(Device device);
void release_held_memory(Device device);

}  // namespace flowmoe
