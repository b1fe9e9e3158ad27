// Embedding on the GPU, f32 or bf16. weight, d_weight [vocab, hidden]; ids [num_ids] i32;
// out, d_out [num_ids, hidden].
//   forward:  out[i] = weight[ids[i]], a row gather (16-byte copies when rows allow).
//   backward: stable radix sort of (id, position), then per distinct id an fp32 sum of its d_out rows
//             in ascending position order: deterministic, and the same order the CPU reference adds in.
// An id outside [0, vocab) prints "embedding: id .. at position .." and traps (the context is lost).
// CPU reference: kernels/cpu/embedding.cpp. Tests: tests/test_embedding.cpp.
#include <cuda_bf16.h>

#include <cstdio>
#include <cub/device/device_radix_sort.cuh>

#include "kernels/common/cuda_check.h"
#include "kernels/cuda/cuda_utils.cuh"
#include "kernels/embedding.h"

namespace flowmoe {

// ---- kernels ----------------------------------------------------------------------------------

// Thread 0 reports and traps; the others return without touching memory.
__device__ __forceinline__ bool bad_id(int32_t id, int64_t pos, int64_t vocab, const char* what) {
  if (id >= 0 && id < vocab) return false;
  if (threadIdx.x == 0) {
    printf("%s: id %d at position %lld is outside [0, %lld)\n", what, id, (long long)pos, (long long)vocab);
    __trap();
  }
  return true;
}

// Rows are copied in units V (uint4 when rows are 16-byte multiples, else the element itself).
template <class V>
__global__ void embedding_forward_kernel(V* __restrict__ out /*[num_ids, row_units]*/,
                                         const V* __restrict__ weight /*[vocab, row_units]*/,
                                         const int32_t* __restrict__ ids, int64_t num_ids, int64_t vocab,
                                         int64_t row_units) {
  for (int64_t i = blockIdx.x; i < num_ids; i += gridDim.x) {
    int32_t id = ids[i];
    if (bad_id(id, i, vocab, "embedding")) return;
    const V* src = weight + int64_t(id) * row_units;
    V* dst = out + i * row_units;
    for (int64_t j = threadIdx.x; j < row_units; j += blockDim.x) dst[j] = src[j];
  }
}

__global__ void iota_kernel(int32_t* __restrict__ out, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = int32_t(i);
}

// x strides over sorted positions and works only at the first of each run of equal ids; y strides
// over column chunks. The run's end comes from a binary search, so the sum loop has fixed bounds.
template <class T>
__global__ void embedding_backward_kernel(T* __restrict__ d_weight, const T* __restrict__ d_out,
                                          const int32_t* __restrict__ sorted_ids /*[num_ids]*/,
                                          const int32_t* __restrict__ sorted_pos /*[num_ids]*/, int64_t num_ids,
                                          int64_t vocab, int64_t hidden) {
  for (int64_t s = blockIdx.x; s < num_ids; s += gridDim.x) {
    int32_t id = sorted_ids[s];
    if (s > 0 && sorted_ids[s - 1] == id) continue;
    if (bad_id(id, sorted_pos[s], vocab, "embedding_backward")) return;
    int64_t lo = s + 1, hi = num_ids;  // first index in [s + 1, num_ids) whose id differs
    while (lo < hi) {
      int64_t mid = (lo + hi) / 2;
      if (sorted_ids[mid] == id)
        lo = mid + 1;
      else
        hi = mid;
    }
    for (int64_t j = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; j < hidden; j += int64_t(gridDim.y) * blockDim.x) {
      float acc = 0.f;
#pragma unroll 4
      for (int64_t k = s; k < lo; ++k) acc += to_float(d_out[int64_t(sorted_pos[k]) * hidden + j]);
      d_weight[int64_t(id) * hidden + j] = from_float<T>(acc);
    }
  }
}

// ---- launchers --------------------------------------------------------------------------------

static void check_embedding_args(const char* what, DType dtype, int64_t num_ids, int64_t vocab, int64_t hidden) {
  FLOWMOE_CHECK(dtype == DType::f32 || dtype == DType::bf16, DTypeError, what, " supports f32 and bf16, got ",
                dtype_name(dtype));
  FLOWMOE_CHECK(num_ids >= 0 && vocab >= 0 && hidden >= 0, ShapeError, what, ": bad shape num_ids ", num_ids,
                ", vocab ", vocab, ", hidden ", hidden);
  FLOWMOE_CHECK(num_ids <= int64_t(0x7fffffff), ShapeError, what, ": ", num_ids, " ids exceed int32 positions");
}

static int threads_for(int64_t units) {
  int64_t t = (units + 31) / 32 * 32;
  return int(t < 32 ? 32 : (t > 256 ? 256 : t));
}

template <class V>
static void launch_gather(void* out, const void* weight, const int32_t* ids, int64_t num_ids, int64_t vocab,
                          int64_t row_units, cudaStream_t stream) {
  unsigned blocks = unsigned(num_ids < (1 << 20) ? num_ids : (1 << 20));
  embedding_forward_kernel<<<blocks, threads_for(row_units), 0, stream>>>(
      static_cast<V*>(out), static_cast<const V*>(weight), ids, num_ids, vocab, row_units);
}

void embedding_forward_cuda(DType dtype, void* out, const void* weight, const int32_t* ids, int64_t num_ids,
                            int64_t vocab, int64_t hidden, cudaStream_t stream) {
  check_embedding_args("embedding_forward_cuda", dtype, num_ids, vocab, hidden);
  if (num_ids == 0 || hidden == 0) return;
  size_t elem = dtype_size(dtype), row_bytes = size_t(hidden) * elem;
  bool vec16 = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(weight) % 16 == 0;
  if (vec16)
    launch_gather<uint4>(out, weight, ids, num_ids, vocab, int64_t(row_bytes / 16), stream);
  else if (elem == 4)
    launch_gather<uint32_t>(out, weight, ids, num_ids, vocab, hidden, stream);
  else
    launch_gather<uint16_t>(out, weight, ids, num_ids, vocab, hidden, stream);
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

// Workspace: sorted ids, positions, sorted positions (each 256-byte aligned), then CUB's scratch.
static size_t align256(size_t n) { return (n + 255) / 256 * 256; }

static size_t sort_scratch_bytes(int64_t num_ids) {
  size_t bytes = 0;
  FLOWMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), int(num_ids)));
  return bytes;
}

size_t embedding_backward_workspace_bytes(int64_t num_ids) {
  if (num_ids <= 0) return 0;
  return 3 * align256(size_t(num_ids) * sizeof(int32_t)) + sort_scratch_bytes(num_ids);
}

void embedding_backward_cuda(DType dtype, void* d_weight, const void* d_out, const int32_t* ids, int64_t num_ids,
                             int64_t vocab, int64_t hidden, void* workspace, size_t workspace_bytes,
                             cudaStream_t stream) {
  check_embedding_args("embedding_backward_cuda", dtype, num_ids, vocab, hidden);
  size_t need = embedding_backward_workspace_bytes(num_ids);
  FLOWMOE_CHECK(workspace_bytes >= need, ShapeError, "embedding_backward_cuda: workspace of ", workspace_bytes,
                " bytes, need ", need);
  if (vocab == 0 || hidden == 0) return;
  // Rows of ids that never occur stay zero; every other row is written exactly once below.
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(d_weight, 0, size_t(vocab) * size_t(hidden) * dtype_size(dtype), stream));
  if (num_ids == 0) return;

  size_t slot = align256(size_t(num_ids) * sizeof(int32_t));
  char* base = static_cast<char*>(workspace);
  auto* sorted_ids = reinterpret_cast<int32_t*>(base);
  auto* positions = reinterpret_cast<int32_t*>(base + slot);
  auto* sorted_pos = reinterpret_cast<int32_t*>(base + 2 * slot);
  size_t scratch_bytes = need - 3 * slot;
  iota_kernel<<<grid_size(num_ids, 256), 256, 0, stream>>>(positions, num_ids);
  FLOWMOE_CUDA_CHECK_LAUNCH();
  // Stable, so equal ids keep ascending positions. All 32 key bits: negative ids sort first and trap.
  FLOWMOE_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(base + 3 * slot, scratch_bytes, ids, sorted_ids, positions,
                                                     sorted_pos, int(num_ids), 0, 32, stream));

  int threads = threads_for(hidden);
  int64_t col_blocks = (hidden + threads - 1) / threads;
  dim3 grid(unsigned(num_ids < 1024 ? num_ids : 1024), unsigned(col_blocks < 65535 ? col_blocks : 65535));
  dispatch_cuda_float(dtype, "embedding_backward_cuda", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    embedding_backward_kernel<<<grid, threads, 0, stream>>>(static_cast<T*>(d_weight), static_cast<const T*>(d_out),
                                                            sorted_ids, sorted_pos, num_ids, vocab, hidden);
  });
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe
