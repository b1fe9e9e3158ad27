// bf16 grouped wgrad in one launch (kernels/grouped_gemm_device.h): dw[e] (+)= dy_eᵀ · x_e, fp32 out, with
// the row counts read on the device. CUTLASS GEMM per expert: (M, N, K) = (n, k, r_e), the reduction over
// the expert's rows; A = dy_eᵀ (dy_e [r_e, n] row-major: M contiguous), B = x_eᵀ (x_e [r_e, k]: N
// contiguous), both MN-major (wgmma transposes 16-bit operands in shared memory); TMA reads rows past r_e
// as zeros, so r_e needs no alignment. D = dw[e] [n, k] row-major fp32; accumulating reads C = D with
// beta 1. An expert with no rows gets no tiles (shape 0): the setup kernel zeroes its dw, or it keeps dw.
// Tile 128x256x64, cluster 1x2, cooperative. CPU reference: grouped_linear_wgrad_cpu
// (kernels/cpu/grouped_linear.cpp); tests: tests/test_grouped_gemm_device.cpp.
#include "kernels/cuda/grouped_gemm_sm90.cuh"

namespace flowmoe::grouped_gemm {

namespace {

using Bf16 = cutlass::bfloat16_t;
using Gemm =
    GroupedGemm<Bf16, cutlass::layout::ColumnMajor*, Bf16, cutlass::layout::RowMajor*, float, float,
                cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>>::Gemm;
using T = GemmTypes<Gemm>;

struct Fill {
  const Bf16* dy;  // [m_total, n]
  const Bf16* x;   // [m_total, k]
  float* dw;       // [E, n, k]
  int64_t n, k;
  __device__ static const char* name() { return "grouped_gemm_wgrad_device_cuda"; }
  __device__ void operator()(const Arrays<Gemm>& a, int e, long long rows, long long off, long long) const {
    a.shapes[e] = rows > 0 ? cute::make_shape(int(n), int(k), int(rows)) : cute::make_shape(0, 0, 0);
    a.a[e] = dy + off * n;
    a.b[e] = x + off * k;
    a.d[e] = dw + e * n * k;
    a.stride_a[e] = ld_stride<T::StrideA>(n);  // A(i, r) = dy[off + r][i]
    a.stride_b[e] = ld_stride<T::StrideB>(k);  // B(j, r) = x[off + r][j]
    a.stride_d[e] = ld_stride<T::StrideD>(k);
  }
};

}  // namespace

void bf16_wgrad_run(const Call& c) {
  const Fill fill{static_cast<const Bf16*>(c.a), static_cast<const Bf16*>(c.b), static_cast<float*>(c.d), c.n, c.k};
  run_grouped<Gemm>(c, fill, 1, c.accumulate ? 1.f : 0.f, c.accumulate ? ZeroMode::none : ZeroMode::empty_groups,
                    c.n * c.k * 4, "grouped_gemm_wgrad_device_cuda");
}

size_t bf16_wgrad_workspace_bytes(int64_t num_experts, int sm_count) {
  return workspace_bytes<Gemm>(num_experts, sm_count);
}

}  // namespace flowmoe::grouped_gemm
