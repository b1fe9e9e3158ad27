// FP8 grouped fprop / dgrad in one launch (fp8_grouped_gemm_device_cuda, kernels/grouped_gemm_device.h):
// y_e = x_e · w[e]ᵀ on e4m3 with power-of-two block scales. Per expert (M, N, K) = (r_e, n, k), A = x_e, B =
// w[e], both K-major ("TN"); CUTLASS's blockwise mainloop scales each 128-deep k-block's partial sums by
// scale_a(row) · scale_b(n-block) into fp32. Scale granularity (1, 128, 128), both grids K-major and read in
// place (x's [m_total, k/128] from row off_e, w's [E, n/128, k/128] from expert e). D = y_e row-major, bf16
// or f32 (grouped_gemm_fp8_fprop_{bf16,f32}.cu). Tile 128x128x128 (128x256 would need 256 registers per
// thread with the promotion buffer), cluster 1x2 (x multicast), cooperative. CPU reference:
// fp8_grouped_gemm_cpu (kernels/cpu/fp8_grouped_linear.cpp); tests: tests/test_grouped_gemm_device.cpp.
#pragma once
#include "kernels/cuda/grouped_gemm_sm90.cuh"

namespace flowmoe::grouped_gemm {

using Fp8ScaleConfig =
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, cute::GMMA::Major::K>;

template <class Out>
using Fp8FpropGemm = typename GroupedGemm<
    cutlass::float_e4m3_t, cute::tuple<cutlass::layout::RowMajor*, decltype(Fp8ScaleConfig::deduce_layoutSFA())*>,
    cutlass::float_e4m3_t, cute::tuple<cutlass::layout::ColumnMajor*, decltype(Fp8ScaleConfig::deduce_layoutSFB())*>,
    void, Out, cute::Shape<cute::_128, cute::_128, cute::_128>, cute::Shape<cute::_1, cute::_2, cute::_1>,
    cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::Gemm;

template <class Out>
struct Fp8FpropFill {
  using Gemm = Fp8FpropGemm<Out>;
  using T = GemmTypes<Gemm>;
  using Fp8 = cutlass::float_e4m3_t;
  const Fp8* x;     // [m_total, k]
  const float* xs;  // [m_total, k/128]
  const Fp8* w;     // [E, n, k]
  const float* ws;  // [E, n/128, k/128]
  Out* y;           // [m_total, n]
  int64_t n, k;
  __device__ static const char* name() { return "fp8_grouped_gemm_device_cuda"; }
  __device__ void operator()(const Arrays<Gemm>& a, int e, long long rows, long long off, long long) const {
    const int64_t kb = k / 128, nb = n / 128;
    const int m = rows > 0 ? int(rows) : 0;
    a.shapes[e] = rows > 0 ? cute::make_shape(m, int(n), int(k)) : cute::make_shape(0, 0, 0);
    a.a[e] = x + off * k;
    a.b[e] = w + e * n * k;
    a.d[e] = y + off * n;
    a.stride_a[e] = ld_stride<typename T::StrideA>(k);
    a.stride_b[e] = ld_stride<typename T::StrideB>(k);
    a.stride_d[e] = ld_stride<typename T::StrideD>(n);
    a.a_scale[e] = xs + off * kb;
    a.b_scale[e] = ws + e * nb * kb;
    // The mainloop derives the same layouts from the group's shape; they are filled for completeness.
    a.a_scale_layout[e] = Fp8ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(m, int(n), int(k), 1));
    a.b_scale_layout[e] = Fp8ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(m, int(n), int(k), 1));
  }
};

template <class Out>
void fp8_fprop_run_as(const Call& c) {
  using Fp8 = cutlass::float_e4m3_t;
  const Fp8FpropFill<Out> fill{static_cast<const Fp8*>(c.a),
                               c.a_scale,
                               static_cast<const Fp8*>(c.b),
                               c.b_scale,
                               static_cast<Out*>(c.d),
                               c.n,
                               c.k};
  run_grouped<Fp8FpropGemm<Out>>(c, fill, 1, 0.f, c.zero_tail ? ZeroMode::tail_rows : ZeroMode::none,
                                 c.n * (long long)sizeof(Out), "fp8_grouped_gemm_device_cuda");
}

}  // namespace flowmoe::grouped_gemm
