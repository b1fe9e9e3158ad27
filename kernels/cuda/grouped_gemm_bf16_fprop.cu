// bf16 grouped fprop in one launch (kernels/grouped_gemm_device.h): y[off_e : off_e+r_e] = x_e · w[e]ᵀ with
// the row counts read on the device. CUTLASS GEMM per expert: (M, N, K) = (r_e, n, k), A = x_e [r_e, k]
// row-major, B = w[e] [n, k] (both K-major, "TN"), D = y_e [r_e, n] row-major bf16, fp32 accumulation;
// the setup kernel zeroes rows [sum(r), m_total) unless the call leaves them (zero_tail). Tile 128x256x64, cluster 1x2
// (the two CTAs of a cluster share x's tile, TMA multicast), cooperative. CPU reference: grouped_linear_forward_cpu
// (kernels/cpu/grouped_linear.cpp); tests: tests/test_grouped_gemm_device.cpp.
#include "kernels/cuda/grouped_gemm_sm90.cuh"

namespace flowmoe::grouped_gemm {

namespace {

using Bf16 = cutlass::bfloat16_t;
using Gemm =
    GroupedGemm<Bf16, cutlass::layout::RowMajor*, Bf16, cutlass::layout::ColumnMajor*, void, Bf16,
                cute::Shape<cute::_128, cute::_256, cute::_64>, cute::Shape<cute::_1, cute::_2, cute::_1>>::Gemm;
using T = GemmTypes<Gemm>;

struct Fill {
  const Bf16* x;  // [m_total, k]
  const Bf16* w;  // [E, n, k]
  Bf16* y;        // [m_total, n]
  int64_t n, k;
  __device__ static const char* name() { return "grouped_gemm_fprop_device_cuda"; }
  __device__ void operator()(const Arrays<Gemm>& a, int e, long long rows, long long off, long long) const {
    a.shapes[e] = rows > 0 ? cute::make_shape(int(rows), int(n), int(k)) : cute::make_shape(0, 0, 0);
    a.a[e] = x + off * k;
    a.b[e] = w + e * n * k;
    a.d[e] = y + off * n;
    a.stride_a[e] = ld_stride<T::StrideA>(k);
    a.stride_b[e] = ld_stride<T::StrideB>(k);
    a.stride_d[e] = ld_stride<T::StrideD>(n);
  }
};

}  // namespace

void bf16_fprop_run(const Call& c) {
  const Fill fill{static_cast<const Bf16*>(c.a), static_cast<const Bf16*>(c.b), static_cast<Bf16*>(c.d), c.n, c.k};
  run_grouped<Gemm>(c, fill, 1, 0.f, c.zero_tail ? ZeroMode::tail_rows : ZeroMode::none, c.n * 2,
                    "grouped_gemm_fprop_device_cuda");
}

size_t bf16_fprop_workspace_bytes(int64_t num_experts, int sm_count) {
  return workspace_bytes<Gemm>(num_experts, sm_count);
}

}  // namespace flowmoe::grouped_gemm
