// The FP8 ops over an MoE layer's device counts (ExpertCounts with no host values): fp8_transpose and
// quantize_colwise_tensor give the host-count layouts' bytes in worst-case sized scales with the counts
// attached, and fp8_grouped_linear (both wgrad recipes) gives bit for bit the outputs and gradients of the
// host-count path. On the CPU a CPU i32 tensor stands in for the device counts and the references read it;
// on the GPU the comparison is with host + device counts (the same one-launch GEMMs, host-table layouts),
// no host synchronisation is counted, and the FP8 MoE layer on one GPU reads no counts and stays close to
// the layer that reads them (per-expert cuBLASLt GEMMs).
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "engine/cast_stats.h"
#include "engine/ops/fp8_grouped_linear.h"
#include "engine/ops/fp8_transpose.h"
#include "engine/ops/grouped_linear.h"
#include "kernels/fp8.h"
#include "layers/moe.h"
#include "tests/support/checks.h"
#include "tests/support/moe_config.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

using Rows = std::vector<int64_t>;

Tensor counts_tensor(const Rows& rows, Device dev) {
  return Tensor::from_ints(rows, {int64_t(rows.size())}, DType::i32, dev);
}

// The colwise result `dev` (over device counts) against `host` (over the same counts on the host): the
// same data bytes, the same first num_blocks scale rows, then rows of 1.0f up to the worst case.
void expect_same_layout(const Tensor& dev, const Tensor& host, const Tensor& counts) {
  ASSERT_TRUE(dev.fp8_scales() && host.fp8_scales());
  const Fp8Scales &d = *dev.fp8_scales(), &h = *host.fp8_scales();
  EXPECT_EQ(d.mode, ScalingMode::colwise_1x128);
  EXPECT_TRUE(d.rows_per_segment.empty());
  ASSERT_TRUE(d.segment_counts.defined());
  EXPECT_EQ(d.segment_counts.raw_data(), counts.raw_data()) << "the counts tensor itself is attached";
  const int64_t M = dev.size(1), K = dev.size(0), nb = h.scale_inv.size(0);
  ASSERT_EQ(d.scale_inv.shape(), (Shape{fp8_colwise_max_blocks(M, counts.numel()), K}));
  EXPECT_TRUE(bit_equal(dev.to(Device::cpu()), host.to(Device::cpu())));
  const Tensor ds = d.scale_inv.to(Device::cpu());
  EXPECT_TRUE(bit_equal(ds.slice(0, 0, nb).contiguous(), h.scale_inv.to(Device::cpu())));
  const Tensor ones = Tensor::full({ds.size(0) - nb, K}, 1.0, DType::f32);
  EXPECT_TRUE(bit_equal(ds.slice(0, nb, ds.size(0)).contiguous(), ones));
}

struct Case {
  const char* what;
  int64_t m;
  Rows rows;
};
const Case kCases[] = {
    {"0 tokens", 64, {0, 0, 0}},
    {"an empty expert, partial blocks, a tail", 240, {32, 0, 144, 16}},
    {"one hot expert", 256, {0, 256, 0}},
    {"E = 1 with a tail", 80, {48}},
};

struct GroupedRun {
  Tensor y, dx, dw;
  uint64_t host_syncs = 0;  // of the forward and backward, the reads of the results excluded
};

// One forward + backward of fp8_grouped_linear over `counts`, on the inputs' device; dy in y's dtype.
GroupedRun run_grouped(const Tensor& x_in, const Tensor& w_in, const Tensor& dy_in, const ExpertCounts& counts,
                       Fp8Wgrad wgrad) {
  Variable x(x_in, true), w(w_in, true, "w");
  QuantizedWeight wq = quantize_weight(w_in, "w");
  const uint64_t syncs = num_host_syncs();
  Variable y = fp8_grouped_linear(quantize_rowwise(x, "x"), w, wq, counts, wgrad, "fc");
  y.backward(dy_in.to(y.dtype()));
  const uint64_t host_syncs = num_host_syncs() - syncs;
  return {y.data().to(Device::cpu()), x.grad().to(Device::cpu()), w.grad().to(Device::cpu()), host_syncs};
}

// fp8_grouped_linear over device-only counts against `reference` counts, bit for bit, per case and recipe.
void check_grouped(Device dev, DType act, bool with_host_reference) {
  Rng rng(test_seed());
  const int64_t N = 256, K = 128;
  for (const Case& c : kCases)
    for (Fp8Wgrad wgrad : {Fp8Wgrad::transpose, Fp8Wgrad::requantize}) {
      SCOPED_TRACE(std::string(c.what) + (wgrad == Fp8Wgrad::transpose ? ", transpose" : ", requantize"));
      const int64_t E = int64_t(c.rows.size());
      Tensor x = random_tensor(rng, {c.m, K}, act, dev), dy = random_tensor(rng, {c.m, N}, act, dev);
      Tensor w = random_tensor(rng, {E, N, K}, DType::f32, dev, -0.1, 0.1);
      const Tensor counts = counts_tensor(c.rows, dev);
      const ExpertCounts reference{c.rows, with_host_reference ? counts : Tensor()};
      const GroupedRun want = run_grouped(x, w, dy, reference, wgrad);
      const GroupedRun got = run_grouped(x, w, dy, ExpertCounts{{}, counts}, wgrad);
      EXPECT_EQ(got.host_syncs, 0u) << "the device-count path read something to the host";
      EXPECT_TRUE(bit_equal(got.y, want.y)) << "y";
      EXPECT_TRUE(bit_equal(got.dx, want.dx)) << "dx";
      EXPECT_TRUE(bit_equal(got.dw, want.dw)) << "dW";
    }
}

}  // namespace

TEST(Fp8DeviceCounts, TransposeAndQuantizeOpsOverCpuCounts) {
  Rng rng(test_seed());
  const Rows rows = {32, 0, 150, 7};
  const int64_t M = 230, K = 200;
  const Tensor counts = counts_tensor(rows, Device::cpu());
  Tensor x = random_tensor(rng, {M, K});
  Tensor q = quantize_rowwise_tensor(x, "x");
  expect_same_layout(fp8_transpose(q, ExpertCounts{{}, counts}), fp8_transpose(q, rows), counts);
  reset_cast_counts();
  Tensor qc = quantize_colwise_tensor(x, ExpertCounts{{}, counts}, "x colwise");
  EXPECT_EQ(cast_counts().quantize, 1);
  const Tensor qc_host = quantize_colwise_tensor(x, rows, "x colwise");
  expect_same_layout(qc, qc_host, counts);
  // The CPU dequantizes a device-count layout through its counts: the host layout's values.
  EXPECT_TRUE(bit_equal(dequantize_tensor(qc, DType::f32, ""), dequantize_tensor(qc_host, DType::f32, "")));
  // With host counts beside them, the layouts keep the host-known shapes.
  const Tensor both = fp8_transpose(q, ExpertCounts{rows, counts});
  EXPECT_EQ(both.fp8_scales()->rows_per_segment, rows);
  EXPECT_FALSE(both.fp8_scales()->segment_counts.defined());
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] {
        fp8_transpose(q, ExpertCounts{{}, counts.to(DType::i64)});
      },
      {"fp8_transpose", "[E] i32", "i64"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        quantize_colwise_tensor(x, ExpertCounts{{}, counts_tensor({200, 31}, Device::cpu())}, "s");
      },
      {"sum to 231", "M = 230"}));
}

// The step profiler's FLOPs: the host counts' rows, or with device counts every row of x.
TEST(Fp8DeviceCounts, ProfilerFlops) {
  const Tensor x = Tensor::zeros({96, 128}, DType::f32), w = Tensor::zeros({3, 256, 128}, DType::f32);
  EXPECT_EQ(grouped_gemm_flops(ExpertCounts{{16, 0, 32}, Tensor()}, x, w), 2.0 * 48 * 256 * 128);
  EXPECT_EQ(grouped_gemm_flops(ExpertCounts{{}, counts_tensor({16, 0, 32}, Device::cpu())}, x, w),
            2.0 * 96 * 256 * 128);
}

TEST(Fp8DeviceCounts, GroupedLinearCpuMatchesHostCounts) { check_grouped(Device::cpu(), DType::f32, false); }

TEST(Fp8DeviceCounts, GroupedLinearChecksTheCounts) {
  Rng rng(test_seed());
  Tensor x = random_tensor(rng, {64, 128});
  Variable w(random_tensor(rng, {2, 128, 128}), true, "w");
  const QuantizedWeight wq = quantize_weight(w.data(), "w");
  Variable xq = quantize_rowwise(Variable(x), "x");
  auto run = [&](const ExpertCounts& counts) { fp8_grouped_linear(xq, w, wq, counts, Fp8Wgrad::transpose, "fc"); };
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        run(ExpertCounts{{}, counts_tensor({16, 32, 0}, Device::cpu())});
      },
      {"device counts", "i32[3]", "must be a contiguous [2] i32"}));
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] {
        run(ExpertCounts{{}, counts_tensor({16, 32}, Device::cpu()).to(DType::i64)});
      },
      {"i64[2]"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { run(ExpertCounts{{16, 32, 0}, Tensor()}); }, {"3 host counts"}));
}

// ---- CUDA ---------------------------------------------------------------------------------------

TEST(Fp8DeviceCountsCuda, GroupedLinearMatchesHostLayoutsBitForBit) {
  FLOWMOE_REQUIRE_CUDA();
  check_grouped(Device::cuda(), DType::bf16, true);
}

// ExpertCounts::tail_unread (an MoE layer's worst-case buffers): the rows past the counts are left unwritten
// (GPU) or NaN (CPU, so that a reader of them fails the tests), and nothing else changes: the counted rows of
// y and dx and every dW bit for bit, in FP8 (both wgrad recipes) and, on the GPU, bf16.
void check_tail_unread(Device dev) {
  Rng rng(test_seed());
  const int64_t N = 256, K = 128;
  const DType act = dev.is_cpu() ? DType::f32 : DType::bf16;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.what);
    const int64_t E = int64_t(c.rows.size());
    int64_t live = 0;
    for (int64_t r : c.rows) live += r;
    Tensor x = random_tensor(rng, {c.m, K}, act, dev), dy = random_tensor(rng, {c.m, N}, act, dev);
    Tensor w = random_tensor(rng, {E, N, K}, DType::f32, dev, -0.1, 0.1);
    const Tensor counts = counts_tensor(c.rows, dev);
    const auto expect_same = [&](const GroupedRun& got, const GroupedRun& want) {
      EXPECT_TRUE(bit_equal(got.y.slice(0, 0, live).contiguous(), want.y.slice(0, 0, live).contiguous())) << "y";
      EXPECT_TRUE(bit_equal(got.dx.slice(0, 0, live).contiguous(), want.dx.slice(0, 0, live).contiguous())) << "dx";
      EXPECT_TRUE(bit_equal(got.dw, want.dw)) << "dW";
      if (!dev.is_cpu()) return;
      for (const auto& [what, t] : {std::pair<const char*, Tensor>{"y", got.y}, {"dx", got.dx}})
        for (double v : t.slice(0, live, c.m).to_doubles())
          if (!std::isnan(v)) {
            ADD_FAILURE() << "a tail row of " << what << " is not NaN on the CPU: " << v;
            break;
          }
    };
    for (Fp8Wgrad wgrad : {Fp8Wgrad::transpose, Fp8Wgrad::requantize}) {
      SCOPED_TRACE(wgrad == Fp8Wgrad::transpose ? "fp8, transpose" : "fp8, requantize");
      expect_same(run_grouped(x, w, dy, ExpertCounts{{}, counts, true}, wgrad),
                  run_grouped(x, w, dy, ExpertCounts{{}, counts, false}, wgrad));
    }
    if (dev.is_cpu()) continue;  // bf16 grouped_linear takes device counts on a GPU only
    SCOPED_TRACE("bf16");
    const auto bf16 = [&](bool tail_unread) {
      Variable xv(x, true), wv(w, true, "w");
      Variable y = grouped_linear(xv, wv, ExpertCounts{{}, counts, tail_unread});
      y.backward(dy);
      return GroupedRun{y.data().to(Device::cpu()), xv.grad().to(Device::cpu()), wv.grad().to(Device::cpu())};
    };
    expect_same(bf16(true), bf16(false));
  }
}

TEST(Fp8DeviceCounts, TailUnreadIsNaNOnTheCpuAndChangesNoCountedValue) { check_tail_unread(Device::cpu()); }

TEST(Fp8DeviceCountsCuda, TailUnreadChangesNoCountedValue) {
  FLOWMOE_REQUIRE_CUDA();
  check_tail_unread(Device::cuda());
}

// The FP8 MoE layer on one GPU: forward and backward read no counts (host_syncs 0 for the whole step),
// and follow the layer that reads them (per-expert cuBLASLt GEMMs: other summation orders, hence a
// tolerance here; the bit-for-bit comparison of the device-count layouts is the test above).
TEST(Fp8DeviceCountsCuda, MoeLayerReadsNoCounts) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  const ModelConfig c = moe_test_config(8, 2, 256, 128, 1, 0.05);
  for (int64_t T : {0, 1, 300})
    for (MoeRecipe recipe : {MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow}) {
      SCOPED_TRACE(std::string(moe_recipe_name(recipe)) + " T=" + std::to_string(T));
      Tensor x = random_tensor(rng, {T, 256}, DType::bf16, Device::cuda());
      Tensor dy = random_tensor(rng, {T, 256}, DType::bf16, Device::cuda());
      std::vector<LayerRun> out;
      for (bool device_counts : {true, false}) {
        MoeOptions o(16);
        o.recipe = recipe;
        o.device_counts = device_counts;
        out.push_back(run_layer(c, o, x, dy, Device::cuda(), DType::bf16, 5));
        if (device_counts)
          EXPECT_EQ(out.back().host_syncs, 0u) << "the one-GPU FP8 layer read its counts";
        else
          EXPECT_EQ(out.back().host_syncs, 1u) << "the host path reads its counts once";
      }
      if (T == 0) continue;
      EXPECT_LT(rel_error(out[0].y, out[1].y), 2e-2) << "y";
      EXPECT_LT(rel_error(out[0].dx, out[1].dx), 2e-2) << "dx";
      // Gradient 0 is the router gate's, ill-conditioned with one token (tests/test_moe_fp8.cpp).
      for (size_t i = T == 1 ? 1 : 0; i < out[0].grads.size(); ++i)
        EXPECT_LT(rel_error(out[0].grads[i], out[1].grads[i]), 2e-2) << "gradient " << i;
    }
}
