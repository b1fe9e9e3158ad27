// The caching allocator's reuse and live/peak accounting (driven by malloc on the CPU, and by
// cudaMalloc on a GPU), and the host allocator's accounting.
#include <cstdlib>

#include "engine/allocator.h"
#include "tests/support/checks.h"

using namespace flowmoe;

TEST(CachingAllocator, AccountsLivePeakAndReuses) {
  int raw_allocs = 0, raw_frees = 0;
  CachingAllocator a(
      [&](size_t n) {
        raw_allocs++;
        return std::malloc(n);
      },
      [&](void* p) {
        raw_frees++;
        std::free(p);
      });
  void* p1 = a.allocate(1000);  // rounds to 1024
  void* p2 = a.allocate(3 << 20);
  EXPECT_EQ(a.stats().live_bytes, 1024u + (3u << 20));
  EXPECT_EQ(a.stats().peak_bytes, a.stats().live_bytes);
  a.release(p1);
  EXPECT_EQ(a.stats().live_bytes, 3u << 20);
  EXPECT_EQ(a.stats().peak_bytes, 1024u + (3u << 20));
  void* p3 = a.allocate(900);  // same rounded size: served from the cache
  EXPECT_EQ(p3, p1);
  EXPECT_EQ(raw_allocs, 2);
  a.release(p2);
  a.release(p3);
  EXPECT_EQ(a.stats().live_bytes, 0u);
  EXPECT_EQ(a.stats().reserved_bytes, 1024u + (3u << 20));
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_bytes, 0u);
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved_bytes, 0u);
  EXPECT_EQ(raw_frees, 2);
  EXPECT_EQ(a.allocate(0), nullptr);
  int x;
  EXPECT_THROW(a.release(&x), Error);
}

// A private pool (CUDA graphs): its blocks return to it whenever they are freed, only its own
// allocations reuse them, and releasing it gives its free blocks to the cache.
TEST(CachingAllocator, PrivatePoolKeepsItsBlocks) {
  CachingAllocator a([](size_t n) { return std::malloc(n); }, [](void* p) { std::free(p); });
  void* outside = a.allocate(1000);
  a.release(outside);  // cached, but not the pool's
  const int pool = a.open_pool();
  void* in_pool = a.allocate(1000);
  EXPECT_NE(in_pool, outside) << "a pool does not take the cache's blocks";
  void* kept = a.allocate(4096);
  a.release(in_pool);
  EXPECT_EQ(a.allocate(1000), in_pool) << "the pool reuses its own block";
  a.close_pool();
  a.release(in_pool);
  a.release(kept);  // freed after the capture: still the pool's
  void* later = a.allocate(1000);
  EXPECT_EQ(later, outside) << "outside the pool only the cache's block is handed out";
  void* later2 = a.allocate(1000);
  EXPECT_NE(later2, in_pool);
  const int second = a.open_pool();
  EXPECT_THROW(a.open_pool(), Error) << "one pool open at a time";
  a.close_pool();
  a.release_pool(second);
  a.release_pool(pool);
  a.release(later2);
  void* after = a.allocate(4096);
  EXPECT_EQ(after, kept) << "a released pool's blocks join the cache";
  for (void* p : {later, after}) a.release(p);
}

TEST(CachingAllocator, DoesNotHandOutFarLargerBlocks) {
  CachingAllocator a([](size_t n) { return std::malloc(n); }, [](void* p) { std::free(p); });
  void* big = a.allocate(64 << 20);
  a.release(big);
  void* small = a.allocate(1 << 20);  // 64x smaller: must not take the cached 64 MiB block
  EXPECT_NE(small, big);
  a.release(small);
}

TEST(HostAllocator, TensorsAreCounted) {
  MemoryStats before = memory_stats(Device::cpu());
  {
    Tensor t = Tensor::empty({1024, 1024}, DType::f32);
    EXPECT_EQ(memory_stats(Device::cpu()).live_bytes, before.live_bytes + (4u << 20));
  }
  EXPECT_EQ(memory_stats(Device::cpu()).live_bytes, before.live_bytes);
}

TEST(CudaAllocator, TensorsAreCountedAndReused) {
  FLOWMOE_REQUIRE_CUDA();
  Device d = Device::cuda();
  reset_peak_memory(d);
  MemoryStats s0 = memory_stats(d);
  void* first = nullptr;
  {
    Tensor t = Tensor::empty({256, 1024}, DType::f32, d);
    first = t.raw_data();
    EXPECT_EQ(memory_stats(d).live_bytes, s0.live_bytes + (1u << 20));
  }
  MemoryStats s1 = memory_stats(d);
  EXPECT_EQ(s1.live_bytes, s0.live_bytes);
  EXPECT_GE(s1.peak_bytes, s0.live_bytes + (1u << 20));
  Tensor again = Tensor::empty({1024, 256}, DType::f32, d);
  EXPECT_EQ(again.raw_data(), first);  // from the cache, no cudaMalloc
  EXPECT_EQ(memory_stats(d).num_raw_allocs, s1.num_raw_allocs);
}
