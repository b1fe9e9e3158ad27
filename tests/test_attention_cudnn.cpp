// The cuDNN attention backend (kernels/attention_cudnn.h): its launchers called directly against the f64 CPU
// reference (o, lse, d_q, d_k, d_v; causal; head widths 64 and 128, and the wide heads 192 / 128; T not a
// multiple of 64; batch > 1), deterministic backward; the op on cuDNN against the op on the flash kernels, `auto`
// resolving to cuDNN; the op's errors for a model.attention_kernel=cudnn it cannot honour. GPU tests skip without
// a device, and without the backend in the build, where one test checks that it says it is absent. The config
// key's error: tests/test_config.cpp.
#include <string>
#include <utility>
#include <vector>

#include "kernels/attention_cudnn.h"
#include "tests/support/attention_checks.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

#define FLOWMOE_REQUIRE_CUDNN()                                                              \
  do {                                                                                       \
    FLOWMOE_REQUIRE_CUDA();                                                                  \
    if (!attention_cudnn_built()) GTEST_SKIP() << "no cuDNN backend in this build: skipped"; \
  } while (0)

namespace {

struct CudnnResult {
  Result r;    // o and the gradients, on the GPU
  Tensor lse;  // [B, nh, T] f32, on the GPU
};

// The forward, then the backward on its o and lse, through the launchers, with workspaces from the allocator.
// Inputs are bf16 on the GPU; v and d_out may be narrower than q and k.
CudnnResult run_cudnn(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& d_out) {
  const Shape& s = q.shape();
  const AttentionCudnnShape shape{s[0], s[1], s[2], s[3], v.size(3)};
  std::string why;
  EXPECT_TRUE(attention_cudnn_supports(shape, &why)) << why;
  const Device dev = q.device();
  cudaStream_t stream = current_stream(dev.index);
  auto workspace = [&](bool backward) {
    return Tensor::empty({attention_cudnn_workspace_bytes(shape, backward)}, DType::u8, dev);
  };
  CudnnResult c;
  Result& r = c.r;
  r.out = Tensor::empty(v.shape(), q.dtype(), dev);
  c.lse = Tensor::empty({s[0], s[2], s[1]}, DType::f32, dev);
  Tensor forward_ws = workspace(false);
  attention_forward_cudnn(r.out.raw_data(), c.lse.data<float>(), q.raw_data(), k.raw_data(), v.raw_data(), shape,
                          forward_ws.raw_data(), stream);
  r.d_q = Tensor::empty(s, q.dtype(), dev);
  r.d_k = Tensor::empty(s, q.dtype(), dev);
  r.d_v = Tensor::empty(v.shape(), q.dtype(), dev);
  Tensor backward_ws = workspace(true);
  attention_backward_cudnn(r.d_q.raw_data(), r.d_k.raw_data(), r.d_v.raw_data(), d_out.raw_data(), q.raw_data(),
                           k.raw_data(), v.raw_data(), r.out.raw_data(), c.lse.data<float>(), shape,
                           backward_ws.raw_data(), stream);
  cuda_synchronize(dev.index);
  return c;
}

Result on_cpu_f64(const Result& r) {
  const auto f64 = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::f64); };
  return {f64(r.out), f64(r.d_q), f64(r.d_k), f64(r.d_v)};
}

// The same bits in o and every gradient.
void expect_same_bits(const Result& got, const Result& want, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_TRUE(bit_equal(got.out, want.out)) << "out";
  EXPECT_TRUE(bit_equal(got.d_q, want.d_q)) << "d_q";
  EXPECT_TRUE(bit_equal(got.d_k, want.d_k)) << "d_k";
  EXPECT_TRUE(bit_equal(got.d_v, want.d_v)) << "d_v";
}

// (q's shape [B, T, nh, hd], v's head width): one width at 64 and 128, the wide heads 192 / 128 (DeepSeek-V3's MLA);
// T = 2, T not a multiple of 64, T past several tiles; batch > 1. (cuDNN refuses T = 1: AutoFallsBackToFlash below.)
const std::vector<std::pair<Shape, int64_t>> kShapes = {{{1, 2, 1, 128}, 128},   {{2, 100, 3, 64}, 64},
                                                        {{2, 257, 2, 128}, 128}, {{3, 130, 1, 64}, 64},
                                                        {{2, 200, 2, 192}, 128}, {{1, 1024, 1, 192}, 128}};

}  // namespace

// The launchers against the f64 CPU reference on the same bf16 values: lse within 1e-3 (absolute), o and the
// gradients within the tensor-core tolerances; a second backward gives the same bits (deterministic).
TEST(AttentionCudnn, MatchesCpu) {
  FLOWMOE_REQUIRE_CUDNN();
  Rng rng(test_seed());
  for (const auto& [s, v_hd] : kShapes) {
    SCOPED_TRACE(shape_str(s) + " v " + std::to_string(v_hd));
    const AttentionCase in = attention_case(rng, s, v_hd);
    const Device gpu = Device::cuda();
    const Tensor qg = in.q.to(gpu), kg = in.k.to(gpu), vg = in.v.to(gpu), dg = in.d_out.to(gpu);
    const CudnnResult c = run_cudnn(qg, kg, vg, dg);
    ASSERT_EQ(c.r.out.shape(), in.v.shape());
    EXPECT_TRUE(all_close(c.lse, reference_lse(in.q.to(DType::f64), in.k.to(DType::f64)), 0, 1e-3)) << "lse";
    expect_tensor_core_close(on_cpu_f64(c.r), in.ref, "cudnn vs f64");
    expect_same_bits(run_cudnn(qg, kg, vg, dg).r, c.r, "cudnn twice");
  }
}

// The op on cuDNN and on the flash kernels agree within the tensor-core tolerances (a value head narrower than the
// key's too, which the op pads for both); `auto` runs cuDNN where the build has it: the same bits as cudnn.
TEST(AttentionCudnn, AgreesWithFlash) {
  FLOWMOE_REQUIRE_CUDNN();
  Rng rng(test_seed());
  std::vector<std::pair<Shape, int64_t>> shapes = kShapes;
  shapes.push_back({{2, 100, 2, 64}, 48});
  for (const auto& [s, v_hd] : shapes) {
    SCOPED_TRACE(shape_str(s) + " v " + std::to_string(v_hd));
    const Device gpu = Device::cuda();
    const Shape v_shape = {s[0], s[1], s[2], v_hd};
    Tensor q = random_tensor(rng, s, DType::bf16, gpu), k = random_tensor(rng, s, DType::bf16, gpu);
    Tensor v = random_tensor(rng, v_shape, DType::bf16, gpu), d_out = random_tensor(rng, v_shape, DType::bf16, gpu);
    const Result cudnn = attend_with_grads(q, k, v, d_out, AttentionBackend::cudnn);
    const Result flash = attend_with_grads(q, k, v, d_out, AttentionBackend::flash);
    const Result automatic = attend_with_grads(q, k, v, d_out, AttentionBackend::automatic);
    ASSERT_EQ(cudnn.out.shape(), v_shape);
    expect_tensor_core_close(on_cpu_f64(cudnn), on_cpu_f64(flash), "cudnn vs flash");
    expect_same_bits(automatic, cudnn, "auto vs cudnn");
  }
}

// model.attention_kernel=cudnn is not quietly replaced: f32 is a DTypeError and a head width cuDNN does not take
// (not a multiple of 8) an Error, each naming the key and the shape; auto takes the flash kernels for both.
TEST(AttentionCudnn, OpRefusesWhatCudnnCannotRun) {
  FLOWMOE_REQUIRE_CUDNN();
  Rng rng(test_seed());
  const Device gpu = Device::cuda();
  const Variable f32(random_tensor(rng, {1, 16, 1, 64}, DType::f32, gpu));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { causal_attention(f32, f32, f32, AttentionBackend::cudnn); },
                                        {"model.attention_kernel=cudnn", "f32"}));
  EXPECT_EQ(causal_attention(f32, f32, f32, AttentionBackend::automatic).data().shape(), f32.data().shape());
  const Variable odd(random_tensor(rng, {1, 16, 1, 12}, DType::bf16, gpu));
  EXPECT_TRUE(throws_naming<Error>([&] { causal_attention(odd, odd, odd, AttentionBackend::cudnn); },
                                   {"model.attention_kernel=cudnn", "[1, 16, 1, 12]"}));
  EXPECT_EQ(causal_attention(odd, odd, odd, AttentionBackend::automatic).data().shape(), odd.data().shape());
}

// A build without cuDNN says so: no shape is supported (with the reason), and the launchers throw naming the
// missing backend, so `auto` resolves to the flash kernels and nothing reaches cuDNN.
TEST(AttentionCudnn, AbsentFromABuildWithoutIt) {
  if (attention_cudnn_built()) GTEST_SKIP() << "this build has the cuDNN backend";
  const AttentionCudnnShape shape{2, 100, 3, 64, 64};
  std::string why;
  EXPECT_FALSE(attention_cudnn_supports(shape, &why));
  EXPECT_NE(why.find("no cuDNN attention backend"), std::string::npos) << why;
  EXPECT_TRUE(throws_naming<Error>([&] { attention_cudnn_workspace_bytes(shape, false); },
                                   {"attention_cudnn_workspace_bytes", "no cuDNN attention backend"}));
  EXPECT_TRUE(throws_naming<Error>(
      [&] { attention_forward_cudnn(nullptr, nullptr, nullptr, nullptr, nullptr, shape, nullptr, nullptr); },
      {"attention_forward_cudnn", "no cuDNN attention backend"}));
}

// A shape cuDNN refuses (one query and one key: "s_q = s_kv = 1 is not supported" in cuDNN 9) runs on the flash
// kernels under `auto`, with flash's bits, and is an error naming the key under `cudnn`.
TEST(AttentionCudnn, AutoFallsBackToFlashWhereCudnnRefuses) {
  FLOWMOE_REQUIRE_CUDNN();
  Rng rng(test_seed());
  const Shape s = {2, 1, 2, 128};
  std::string why;
  EXPECT_FALSE(attention_cudnn_supports(AttentionCudnnShape{s[0], s[1], s[2], s[3], s[3]}, &why));
  EXPECT_FALSE(why.empty());
  const Device gpu = Device::cuda();
  Tensor q = random_tensor(rng, s, DType::bf16, gpu), k = random_tensor(rng, s, DType::bf16, gpu);
  Tensor v = random_tensor(rng, s, DType::bf16, gpu), d_out = random_tensor(rng, s, DType::bf16, gpu);
  expect_same_bits(attend_with_grads(q, k, v, d_out, AttentionBackend::automatic),
                   attend_with_grads(q, k, v, d_out, AttentionBackend::flash), "auto vs flash");
  EXPECT_TRUE(throws_naming<Error>([&] { attend_with_grads(q, k, v, d_out, AttentionBackend::cudnn); },
                                   {"model.attention_kernel=cudnn", "[2, 1, 2, 128]"}));
}
