// FP8 grouped wgrad in one launch (fp8_grouped_wgrad_device_cuda, kernels/grouped_gemm_device.h): dw[e] (+)=
// Σ over the expert's r_e tokens of dy ⊗ x, on the colwise dy_t [n, m_total], x_t [k, m_total]. Per expert
// (M, N, K) = (n, k, r_e), A = dy_t + off_e, B = x_t + off_e, K-major with leading dim m_total; TMA reads
// columns past r_e as zeros (a partial last 1x128 block adds only its own columns). Scale granularity (1, 1, 128),
// both grids MN-major ([block][n], [block][k] from row blk_e), loads predicated on the group's
// ceil(r_e/128) blocks: no read past the expert's scales. D = dw[e] f32 row-major, C = D when accumulating;
// an expert with no rows has no tiles (zeroed by the setup kernel, or kept). Tile 128x128x128, cluster 1x2,
// cooperative. CPU reference: fp8_grouped_wgrad_cpu (kernels/cpu/fp8_grouped_linear.cpp); tests:
// tests/test_grouped_gemm_device.cpp.
#include "kernels/cuda/grouped_gemm_sm90.cuh"

namespace flowmoe::grouped_gemm {

namespace {

using Fp8 = cutlass::float_e4m3_t;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, 128, cute::GMMA::Major::MN, cute::GMMA::Major::MN>;
using Gemm =
    GroupedGemm<Fp8, cute::tuple<cutlass::layout::RowMajor*, decltype(ScaleConfig::deduce_layoutSFA())*>, Fp8,
                cute::tuple<cutlass::layout::ColumnMajor*, decltype(ScaleConfig::deduce_layoutSFB())*>, float, float,
                cute::Shape<cute::_128, cute::_128, cute::_128>, cute::Shape<cute::_1, cute::_2, cute::_1>,
                cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise>::Gemm;
using T = GemmTypes<Gemm>;

struct Fill {
  const Fp8* dy_t;   // [n, m_total]
  const float* dys;  // [num_blocks, n]
  const Fp8* x_t;    // [k, m_total]
  const float* xs;   // [num_blocks, k]
  float* dw;         // [E, n, k]
  int64_t m_total, n, k;
  __device__ static const char* name() { return "fp8_grouped_wgrad_device_cuda"; }
  __device__ void operator()(const Arrays<Gemm>& a, int e, long long rows, long long off, long long blk) const {
    const int r = rows > 0 ? int(rows) : 0;
    a.shapes[e] = rows > 0 ? cute::make_shape(int(n), int(k), r) : cute::make_shape(0, 0, 0);
    a.a[e] = dy_t + off;
    a.b[e] = x_t + off;
    a.d[e] = dw + e * n * k;
    a.stride_a[e] = ld_stride<T::StrideA>(m_total);
    a.stride_b[e] = ld_stride<T::StrideB>(m_total);
    a.stride_d[e] = ld_stride<T::StrideD>(k);
    a.a_scale[e] = dys + blk * n;
    a.b_scale[e] = xs + blk * k;
    a.a_scale_layout[e] = ScaleConfig::tile_atom_to_shape_SFA(cute::make_shape(int(n), int(k), r, 1));
    a.b_scale_layout[e] = ScaleConfig::tile_atom_to_shape_SFB(cute::make_shape(int(n), int(k), r, 1));
  }
};

}  // namespace

void fp8_wgrad_run(const Call& c) {
  const Fill fill{static_cast<const Fp8*>(c.a),
                  c.a_scale,
                  static_cast<const Fp8*>(c.b),
                  c.b_scale,
                  static_cast<float*>(c.d),
                  c.m_total,
                  c.n,
                  c.k};
  // Rows multiples of 16: every expert's columns then start 16-byte aligned, as TMA requires.
  run_grouped<Gemm>(c, fill, 16, c.accumulate ? 1.f : 0.f, c.accumulate ? ZeroMode::none : ZeroMode::empty_groups,
                    c.n * c.k * 4, "fp8_grouped_wgrad_device_cuda");
}

size_t fp8_wgrad_workspace_bytes(int64_t num_experts, int sm_count) {
  return workspace_bytes<Gemm>(num_experts, sm_count);
}

}  // namespace flowmoe::grouped_gemm
