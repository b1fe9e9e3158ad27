// CUTLASS side of the one-launch grouped GEMMs (kernels/grouped_gemm_device.h), shared by the files that
// instantiate one kernel each (kernels/cuda/grouped_gemm_*.cu):
//   Arrays        per-group shapes, A/B/D pointers and strides, FP8 scale pointers and layouts, carved from
//                 the caller's workspace, then CUTLASS's own workspace (a TMA descriptor set per SM);
//   setup_kernel  one block of 256 threads scans the device counts and fills group e through the kernel's
//                 Fill; every block then zeroes what the GEMM does not write (tail rows, empty experts' dw);
//   run_grouped   that kernel, then the GEMM with device-only problem shapes (host shapes null: the
//                 persistent scheduler launches one CTA per SM and walks the groups on the device).
// A group with no rows gets the shape (0, 0, 0), no tiles: for K = 0 (wgrad) its tiles would load through
// TMA descriptors of zero extent; the setup kernel writes those zeros instead (or dw is kept).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "kernels/common/cuda_check.h"
#include "kernels/cuda/count_scan.cuh"
#include "kernels/cuda/grouped_gemm_kernels.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/grouped_gemm_device.h"

namespace flowmoe::grouped_gemm {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;  // (M, N, K) per group
using GroupShape = ProblemShape::UnderlyingProblemShape;

constexpr int kSetupThreads = kCountScanThreads;  // scan_counts: one thread per expert
constexpr size_t kWorkspaceAlign = 256;           // CUTLASS keeps TMA descriptors in its workspace (64-byte aligned)

// ---- the types of one CUTLASS grouped GEMM ----------------------------------------------------------

// A Hopper grouped GEMM from CUTLASS's collective builders: TMA loads, wgmma with fp32 accumulation, the
// cooperative warp-specialized persistent kernel (two consumer warp groups split each tile along M), a
// TMA-store epilogue D = alpha·acc (+ beta·C) with row-major C and D. LayoutA / LayoutB are CUTLASS layout
// tags as pointers (one stride per group), or for block-scaled FP8 tuple<tag*, scale layout*>. ElementC
// void: no source. Stage count: as many as fit beside the epilogue's shared memory.
template <class ElementA, class LayoutA, class ElementB, class LayoutB, class ElementC, class ElementD, class TileShape,
          class ClusterShape, class MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>
struct GroupedGemm {
  static constexpr int kAlignA = 128 / cutlass::sizeof_bits<ElementA>::value;  // 16 bytes, TMA's unit
  static constexpr int kAlignB = 128 / cutlass::sizeof_bits<ElementB>::value;
  static constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, cutlass::layout::RowMajor*, kAlignD,
      ElementD, cutlass::layout::RowMajor*, kAlignD, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA, kAlignA, ElementB, LayoutB, kAlignB,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      MainloopSchedule>::CollectiveOp;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>>;
};

template <class Mainloop, class = void>
struct ScaleLayouts {  // not block-scaled: no scale arrays
  using A = int;
  using B = int;
  static constexpr bool kBlockwise = false;
};
template <class Mainloop>
struct ScaleLayouts<Mainloop, std::void_t<typename Mainloop::InternalLayoutSFA>> {
  using A = typename Mainloop::InternalLayoutSFA;
  using B = typename Mainloop::InternalLayoutSFB;
  static constexpr bool kBlockwise = true;
};

template <class Gemm>
struct GemmTypes {
  using Kernel = typename Gemm::GemmKernel;
  using ElementA = typename Kernel::ElementA;
  using ElementB = typename Kernel::ElementB;
  using ElementC = typename Kernel::ElementC;  // void: no source (beta is 0)
  using ElementD = typename Kernel::ElementD;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  using Scales = ScaleLayouts<typename Kernel::CollectiveMainloop>;
  static constexpr bool kBlockwise = Scales::kBlockwise;
  static constexpr bool kHasSource = !std::is_void_v<ElementC>;
};

// A grouped GEMM's stride types have one dynamic mode, the leading dimension (the other is _1, the
// contiguous one); ld_stride sets it.
template <class Stride>
__host__ __device__ Stride ld_stride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static_v<cute::remove_cvref_t<decltype(cute::get<0>(s))>>)
    cute::get<1>(s) = ld;
  else
    cute::get<0>(s) = ld;
  return s;
}

// ---- the per-group arrays in the workspace ------------------------------------------------------------

template <class Gemm>
struct Arrays {
  using T = GemmTypes<Gemm>;
  GroupShape* shapes = nullptr;
  const typename T::ElementA** a = nullptr;
  const typename T::ElementB** b = nullptr;
  typename T::ElementD** d = nullptr;  // also C when the kernel has a source (C = D)
  typename T::StrideA* stride_a = nullptr;
  typename T::StrideB* stride_b = nullptr;
  typename T::StrideD* stride_d = nullptr;
  const float** a_scale = nullptr;  // block-scaled kernels only
  const float** b_scale = nullptr;
  typename T::Scales::A* a_scale_layout = nullptr;
  typename T::Scales::B* b_scale_layout = nullptr;
  void* cutlass_workspace = nullptr;
};

// Lays the arrays for num_experts groups out from base (128-byte aligned segments) and returns the offset
// of CUTLASS's workspace; with base null it only measures.
template <class Gemm>
size_t carve(char* base, int64_t num_experts, Arrays<Gemm>& out) {
  size_t at = 0;
  auto take = [&](auto*& p) {
    using Elem = std::remove_reference_t<decltype(*p)>;
    at = (at + 127) / 128 * 128;
    p = base ? reinterpret_cast<Elem*>(base + at) : nullptr;
    at += sizeof(Elem) * size_t(num_experts);
  };
  take(out.shapes), take(out.a), take(out.b), take(out.d), take(out.stride_a), take(out.stride_b), take(out.stride_d);
  if constexpr (GemmTypes<Gemm>::kBlockwise)
    take(out.a_scale), take(out.b_scale), take(out.a_scale_layout), take(out.b_scale_layout);
  at = (at + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
  out.cutlass_workspace = base ? base + at : nullptr;
  return at;
}

template <class Gemm>
typename Gemm::Arguments make_arguments(const Arrays<Gemm>& a, int64_t num_groups, int device, int sm_count,
                                        float beta) {
  using T = GemmTypes<Gemm>;
  typename Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{int32_t(num_groups), a.shapes, nullptr};  // shapes on the device only
  if constexpr (T::kBlockwise)
    args.mainloop = {a.a, a.stride_a, a.b, a.stride_b, a.a_scale, a.a_scale_layout, a.b_scale, a.b_scale_layout};
  else
    args.mainloop = {a.a, a.stride_a, a.b, a.stride_b};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = beta;
  if constexpr (T::kHasSource) {
    args.epilogue.ptr_C = const_cast<const typename T::ElementC**>(a.d);
    args.epilogue.dC = a.stride_d;
  } else {
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
  }
  args.epilogue.ptr_D = a.d;
  args.epilogue.dD = a.stride_d;
  args.hw_info.device_id = device;
  args.hw_info.sm_count = sm_count;
  return args;
}

// Bytes a call with num_experts groups needs: alignment slack, the arrays, CUTLASS's workspace (which
// depends only on the SM count for these kernels).
template <class Gemm>
size_t workspace_bytes(int64_t num_experts, int sm_count) {
  Arrays<Gemm> a{};
  const size_t arrays = carve(nullptr, num_experts, a);
  return kWorkspaceAlign + arrays + Gemm::get_workspace_size(make_arguments<Gemm>(a, num_experts, 0, sm_count, 0.f));
}

// ---- the setup kernel ---------------------------------------------------------------------------------

// Zeroes `bytes` bytes at p with the whole grid (p 16-byte aligned, bytes a multiple of 16: the launchers
// check the output's alignment and row size).
__device__ inline void zero_range(char* p, long long bytes) {
  uint4* q = reinterpret_cast<uint4*>(p);
  const long long n = bytes / 16, stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride)
    q[i] = make_uint4(0, 0, 0, 0);
}

enum class ZeroMode : int {
  none,          // wgrad accumulating: every byte of dw is either the GEMM's or kept
  tail_rows,     // fprop / dgrad: output rows [sum(counts), m_total)
  empty_groups,  // wgrad overwriting: dw[e] of every expert with no rows
};

template <class Gemm, class Fill>
struct SetupParams {
  Arrays<Gemm> arrays;
  Fill fill;
  const int32_t* counts;
  int num_experts, row_multiple;
  long long m_total;
  ZeroMode zero_mode;
  char* zero_base;            // the output
  long long zero_unit_bytes;  // one output row (tail_rows) or one expert's dw (empty_groups)
};

// Fill: fill(arrays, e, rows, off, blk) writes group e's entries; Fill::name() names the launcher.
template <class Gemm, class Fill>
__global__ void __launch_bounds__(kSetupThreads) setup_kernel(const SetupParams<Gemm, Fill> p) {
  __shared__ long long off[kSetupThreads + 1], blk[kSetupThreads + 1];
  scan_counts(p.counts, p.num_experts, p.row_multiple, p.m_total, off, blk, Fill::name());
  const int e = int(threadIdx.x);
  if (blockIdx.x == 0 && e < p.num_experts) p.fill(p.arrays, e, off[e + 1] - off[e], off[e], blk[e]);
  if (p.zero_mode == ZeroMode::tail_rows) {
    const long long total = off[p.num_experts];
    zero_range(p.zero_base + total * p.zero_unit_bytes, (p.m_total - total) * p.zero_unit_bytes);
  } else if (p.zero_mode == ZeroMode::empty_groups) {
    for (int g = 0; g < p.num_experts; ++g)
      if (off[g + 1] == off[g]) zero_range(p.zero_base + g * p.zero_unit_bytes, p.zero_unit_bytes);
  }
}

// ---- one call -----------------------------------------------------------------------------------------

inline void check_cutlass(cutlass::Status s, const char* what, const char* step) {
  FLOWMOE_CHECK(s == cutlass::Status::kSuccess, CudaError, what, ": CUTLASS grouped GEMM ", step,
                " failed: ", cutlass::cutlassGetStatusString(s));
}

// The setup kernel, then the grouped GEMM, on call.stream (the front end has checked the arguments and the
// workspace size). beta 1 reads C = D (wgrad accumulating), 0 never reads it.
template <class Gemm, class Fill>
void run_grouped(const Call& c, const Fill& fill, int row_multiple, float beta, ZeroMode zero_mode,
                 long long zero_unit_bytes, const char* what) {
  char* base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(c.workspace) + kWorkspaceAlign - 1) /
                                       kWorkspaceAlign * kWorkspaceAlign);
  Arrays<Gemm> arrays{};
  carve(base, c.num_experts, arrays);

  const SetupParams<Gemm, Fill> p{arrays,         fill,      c.counts,  int(c.num_experts),
                                  row_multiple,   c.m_total, zero_mode, static_cast<char*>(c.d),
                                  zero_unit_bytes};
  const long long zero_max = zero_mode == ZeroMode::tail_rows      ? c.m_total * zero_unit_bytes
                             : zero_mode == ZeroMode::empty_groups ? c.num_experts * zero_unit_bytes
                                                                   : 0;
  const long long per_block = kSetupThreads * 16LL * 8;  // eight 16-byte stores per thread, at most 2 blocks/SM
  const int blocks = int(std::clamp<long long>((zero_max + per_block - 1) / per_block, 1, 2LL * c.sm_count));
  setup_kernel<Gemm, Fill><<<blocks, kSetupThreads, 0, c.stream>>>(p);
  FLOWMOE_CUDA_CHECK_LAUNCH();

  using Kernel = typename Gemm::GemmKernel;
  const typename Gemm::Arguments args = make_arguments<Gemm>(arrays, c.num_experts, c.device, c.sm_count, beta);
  check_cutlass(Gemm::can_implement(args), what, "can_implement");
  check_cutlass(Kernel::initialize_workspace(args, arrays.cutlass_workspace, c.stream), what, "initialize_workspace");
  // Raised once per device here: GemmUniversalAdapter::initialize would call cudaFuncSetAttribute on
  // every launch.
  allow_smem(cutlass::device_kernel<typename Gemm::GemmKernel>, size_t(Gemm::GemmKernel::SharedStorageSize));
  typename Kernel::Params params = Kernel::to_underlying_arguments(args, arrays.cutlass_workspace);
  check_cutlass(Gemm::run(params, c.stream), what, "launch");
  FLOWMOE_CUDA_CHECK_LAUNCH();
}

}  // namespace flowmoe::grouped_gemm
