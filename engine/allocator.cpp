#include "engine/allocator.h"

#include <cstdlib>
#include <iterator>
#include <memory>
#include <vector>

#include "kernels/common/device_api.h"
#include "kernels/common/error.h"

namespace flowmoe {

CachingAllocator::CachingAllocator(RawAlloc raw_alloc, RawFree raw_free)
    : raw_alloc_(std::move(raw_alloc)), raw_free_(std::move(raw_free)) {}

CachingAllocator::~CachingAllocator() {
  // Live blocks at exit belong to static tensors; leave them to the driver's teardown.
  std::lock_guard<std::mutex> lock(mu_);
  try {
    empty_cache_locked();
  } catch (...) {  // the CUDA context may already be gone at process exit
  }
}

// Small requests round to 512 B, large ones to 1 MiB, so blocks of near sizes are interchangeable.
// The best-fit rule: a cached block serves a request if it wastes at most 1/8 of it.
static bool fits(size_t block, size_t size) { return block >= size && block <= size + size / 8; }

size_t CachingAllocator::round_size(size_t nbytes) {
  const size_t small = 512, large = size_t(1) << 20;
  size_t q = nbytes < large ? small : large;
  return (nbytes + q - 1) / q * q;
}

void* CachingAllocator::allocate(size_t nbytes, bool on_side) {
  if (nbytes == 0) return nullptr;
  size_t size = round_size(nbytes);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.num_allocs++;
  void* ptr = holding_ && !on_side ? take_compute_free(size) : nullptr;
  if (ptr) {
    size = live_blocks_[ptr];
  } else {
    // Best fit among cached blocks (the open pool's alone, if one is), wasting at most 1/8 of the request.
    auto& blocks = open_pool_ ? pool_free_[open_pool_] : free_blocks_;
    auto it = blocks.lower_bound(size);
    if (it != blocks.end() && fits(it->first, size)) {
      size = it->first;
      ptr = it->second;
      blocks.erase(it);
    } else {
      try {
        ptr = raw_alloc_(size);
      } catch (const Error&) {
        empty_cache_locked();  // out of memory: give the cache back and try once more
        ptr = raw_alloc_(size);
      }
      FLOWMOE_CHECK(ptr != nullptr, Error, "allocation of ", size, " bytes failed");
      stats_.num_raw_allocs++;
      stats_.reserved_bytes += size;
    }
    live_blocks_[ptr] = size;
    if (open_pool_) pool_of_[ptr] = open_pool_;
  }
  stats_.live_bytes += size;
  if (stats_.live_bytes > stats_.peak_bytes) stats_.peak_bytes = stats_.live_bytes;
  return ptr;
}

// A block the compute stream freed during this branch, of the open pool (or none), by the same best fit.
// It stays in live_blocks_ while in compute_free_ (it has not returned to a pool).
void* CachingAllocator::take_compute_free(size_t size) {
  for (auto it = compute_free_.lower_bound(size); it != compute_free_.end() && fits(it->first, size); ++it) {
    auto pool = pool_of_.find(it->second);
    if ((pool == pool_of_.end() ? 0 : pool->second) != open_pool_) continue;
    void* ptr = it->second;
    compute_free_.erase(it);
    return ptr;
  }
  return nullptr;
}

void CachingAllocator::release(void* ptr, bool on_side) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_blocks_.find(ptr);
  FLOWMOE_CHECK(it != live_blocks_.end(), Error, "release of a pointer this allocator did not hand out");
  if (holding_ && on_side) {
    held_.push_back(ptr);  // still counted live
    return;
  }
  stats_.live_bytes -= it->second;
  if (holding_) {
    compute_free_.emplace(it->second, ptr);
    return;
  }
  const size_t size = it->second;
  live_blocks_.erase(it);
  return_to_pool(ptr, size);
}

void CachingAllocator::return_to_pool(void* ptr, size_t size) {
  auto pool = pool_of_.find(ptr);
  (pool != pool_of_.end() ? pool_free_[pool->second] : free_blocks_).emplace(size, ptr);
}

void CachingAllocator::hold_releases() {
  std::lock_guard<std::mutex> lock(mu_);
  holding_ = true;
}

void CachingAllocator::release_held() {
  std::lock_guard<std::mutex> lock(mu_);
  holding_ = false;
  for (void* ptr : held_) {
    const size_t size = live_blocks_.at(ptr);
    stats_.live_bytes -= size;
    live_blocks_.erase(ptr);
    return_to_pool(ptr, size);
  }
  held_.clear();
  for (auto& [size, ptr] : compute_free_) {
    live_blocks_.erase(ptr);
    return_to_pool(ptr, size);
  }
  compute_free_.clear();
}

int CachingAllocator::open_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  FLOWMOE_CHECK(open_pool_ == 0, Error, "a private memory pool is already open");
  open_pool_ = ++num_pools_;
  return open_pool_;
}

void CachingAllocator::close_pool() {
  std::lock_guard<std::mutex> lock(mu_);
  open_pool_ = 0;
}

void CachingAllocator::release_pool(int pool) {
  std::lock_guard<std::mutex> lock(mu_);
  FLOWMOE_CHECK(pool != open_pool_, Error, "release of the open memory pool ", pool);
  auto free = pool_free_.find(pool);
  if (free != pool_free_.end()) {
    for (auto& [size, ptr] : free->second) {
      free_blocks_.emplace(size, ptr);
      pool_of_.erase(ptr);
    }
    pool_free_.erase(free);
  }
  for (auto it = pool_of_.begin(); it != pool_of_.end();) it = it->second == pool ? pool_of_.erase(it) : std::next(it);
}

void CachingAllocator::empty_cache_locked() {
  for (auto& [size, ptr] : free_blocks_) {
    raw_free_(ptr);
    stats_.reserved_bytes -= size;
  }
  free_blocks_.clear();
}

void CachingAllocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  empty_cache_locked();
}

MemoryStats CachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void CachingAllocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.peak_bytes = stats_.live_bytes;
}

// ---- per-device entry points ------------------------------------------------------------------

namespace {

// Host memory: aligned, uncached, but counted the same way as device memory.
struct HostAccounting {
  std::mutex mu;
  std::map<void*, size_t> live;
  MemoryStats stats;
};
// Leaked on purpose: tensors held in statics may be freed after static destructors ran.
HostAccounting& host() {
  static auto* h = new HostAccounting;
  return *h;
}

CachingAllocator& cuda_allocator(int device) {
  static std::mutex mu;
  static auto& allocs = *new std::vector<std::unique_ptr<CachingAllocator>>;  // leaked, as host()
  std::lock_guard<std::mutex> lock(mu);
  FLOWMOE_CHECK(device >= 0 && device < cuda_device_count(), DeviceError, "cuda:", device, " does not exist (",
                cuda_device_count(), " CUDA devices visible)");
  if (allocs.empty()) allocs.resize(size_t(cuda_device_count()));
  auto& a = allocs[size_t(device)];
  if (!a)
    a = std::make_unique<CachingAllocator>([device](size_t n) { return cuda_malloc_raw(n, device); },
                                           [device](void* p) { cuda_free_raw(p, device); });
  return *a;
}

}  // namespace

void* device_allocate(size_t nbytes, Device device) {
  if (device.is_cuda()) return cuda_allocator(device.index).allocate(nbytes, cuda_using_side_stream());
  if (nbytes == 0) return nullptr;
  size_t size = (nbytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, size);
  FLOWMOE_CHECK(p != nullptr, Error, "host allocation of ", size, " bytes failed");
  auto& h = host();
  std::lock_guard<std::mutex> lock(h.mu);
  h.live[p] = size;
  h.stats.num_allocs++;
  h.stats.num_raw_allocs++;
  h.stats.live_bytes += size;
  h.stats.reserved_bytes += size;
  if (h.stats.live_bytes > h.stats.peak_bytes) h.stats.peak_bytes = h.stats.live_bytes;
  return p;
}

void device_release(void* ptr, Device device) {
  if (!ptr) return;
  if (device.is_cuda()) return cuda_allocator(device.index).release(ptr, cuda_using_side_stream());
  auto& h = host();
  {
    std::lock_guard<std::mutex> lock(h.mu);
    auto it = h.live.find(ptr);
    if (it != h.live.end()) {
      h.stats.live_bytes -= it->second;
      h.stats.reserved_bytes -= it->second;
      h.live.erase(it);
    }
  }
  std::free(ptr);
}

MemoryStats memory_stats(Device device) {
  if (device.is_cuda()) return cuda_allocator(device.index).stats();
  std::lock_guard<std::mutex> lock(host().mu);
  return host().stats;
}

void reset_peak_memory(Device device) {
  if (device.is_cuda()) return cuda_allocator(device.index).reset_peak();
  std::lock_guard<std::mutex> lock(host().mu);
  host().stats.peak_bytes = host().stats.live_bytes;
}

void empty_cache(Device device) {
  if (device.is_cuda()) cuda_allocator(device.index).empty_cache();
}

int open_memory_pool(Device device) {
  FLOWMOE_CHECK(device.is_cuda(), DeviceError, "memory pools are for CUDA devices, not ", device.str());
  return cuda_allocator(device.index).open_pool();
}

void close_memory_pool(Device device) {
  if (device.is_cuda()) cuda_allocator(device.index).close_pool();
}

void release_memory_pool(Device device, int pool) {
  if (device.is_cuda()) cuda_allocator(device.index).release_pool(pool);
}

void hold_memory_releases(Device device) {
  if (device.is_cuda()) cuda_allocator(device.index).hold_releases();
}

void release_held_memory(Device device) {
  if (device.is_cuda()) cuda_allocator(device.index).release_held();
}

}  // namespace flowmoe
