// Tensors: dtype conversions (bf16 / FP8 against their definitions and the GPU), views, copies,
// device moves, RNG reproducibility and error messages.
#include <cmath>

#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16_bits(1.0f), 0x3F80);
  // 1 + 2^-8 is exactly halfway between two bf16 values: ties go to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3F80);
  EXPECT_EQ(f32_to_bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3F82);
  EXPECT_TRUE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(NAN))));
  EXPECT_EQ(bf16_bits_to_f32(f32_to_bf16_bits(-0.0f)), 0.0f);
  EXPECT_TRUE(std::signbit(bf16_bits_to_f32(f32_to_bf16_bits(-0.0f))));
}

TEST(DType, E4m3EveryCodeRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    float v = e4m3_to_f32(uint8_t(b));
    if ((b & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v));
      continue;
    }
    EXPECT_EQ(f32_to_e4m3(v), uint8_t(b)) << "code " << b << " value " << v;
  }
  EXPECT_EQ(e4m3_to_f32(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e4m3_to_f32(0x08), std::ldexp(1.0f, -6));  // smallest normal
}

TEST(DType, E4m3SaturatesAndRoundsToEven) {
  EXPECT_EQ(f32_to_e4m3(1000.0f), 0x7E);
  EXPECT_EQ(f32_to_e4m3(-1000.0f), 0xFE);
  EXPECT_EQ(f32_to_e4m3(INFINITY), 0x7E);
  EXPECT_EQ(f32_to_e4m3(NAN), 0x7F);
  EXPECT_EQ(f32_to_e4m3(-NAN), 0x7F);
  // Between 1.0 (0x38) and 1.125 (0x39): the midpoint goes to the even code 0x38.
  EXPECT_EQ(f32_to_e4m3(1.0625f), 0x38);
  EXPECT_EQ(f32_to_e4m3(1.0626f), 0x39);
  // Subnormal grid (spacing 2^-9): 1.5 * 2^-9 ties to 2 * 2^-9 (even), 0.5 * 2^-9 ties to 0.
  EXPECT_EQ(f32_to_e4m3(1.5f * std::ldexp(1.0f, -9)), 0x02);
  EXPECT_EQ(f32_to_e4m3(0.5f * std::ldexp(1.0f, -9)), 0x00);
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
}

TEST(DType, E5m2EveryCodeRoundTrips) {
  for (int b = 0; b < 256; ++b) {
    float v = e5m2_to_f32(uint8_t(b));
    if (std::isnan(v) || std::isinf(v)) continue;
    EXPECT_EQ(f32_to_e5m2(v), uint8_t(b)) << "code " << b;
  }
  EXPECT_EQ(f32_to_e5m2(1e6f), 0x7B);
}

TEST(Tensor, ShapesViewsAndCopies) {
  Rng rng(test_seed());
  Tensor a = random_tensor(rng, {3, 4, 5});
  EXPECT_EQ(a.numel(), 60);
  EXPECT_TRUE(a.is_contiguous());
  Tensor t = a.transpose(0, 2);
  EXPECT_EQ(t.shape(), (Shape{5, 4, 3}));
  EXPECT_FALSE(t.is_contiguous());
  Tensor c = t.contiguous();
  auto av = a.to_floats(), cv = c.to_floats();
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 5; ++k) EXPECT_EQ(cv[size_t((k * 4 + j) * 3 + i)], av[size_t((i * 4 + j) * 5 + k)]);
  Tensor s = a.slice(1, 1, 3);
  EXPECT_EQ(s.shape(), (Shape{3, 2, 5}));
  EXPECT_EQ(s.contiguous().to_floats()[0], av[5]);
  EXPECT_EQ(a.view({-1, 5}).shape(), (Shape{12, 5}));
  EXPECT_TRUE(a.view({12, 5}).shares_storage_with(a));
  Tensor e = Tensor::empty({0, 7}, DType::f32);
  EXPECT_TRUE(e.defined());
  EXPECT_EQ(e.numel(), 0);
}

TEST(Tensor, ErrorsNameBothSides) {
  Tensor a = Tensor::zeros({2, 3}, DType::f32), b = Tensor::zeros({3, 2}, DType::f32);
  try {
    check_same_shape(a, b, "test");
    FAIL() << "no throw";
  } catch (const ShapeError& e) {
    EXPECT_NE(std::string(e.what()).find("[2, 3] vs [3, 2]"), std::string::npos) << e.what();
  }
  try {
    check_same_dtype(a, Tensor::zeros({2, 3}, DType::bf16), "test");
    FAIL() << "no throw";
  } catch (const DTypeError& e) {
    EXPECT_NE(std::string(e.what()).find("f32 vs bf16"), std::string::npos) << e.what();
  }
  EXPECT_THROW(a.view({4, 2}), ShapeError);
  EXPECT_THROW(a.data<double>(), DTypeError);
  EXPECT_THROW(Device::parse("gpu0"), DeviceError);
  EXPECT_EQ(Device::parse("cuda:3").index, 3);
}

// An expert-parallel rank draws only its rows of a full tensor: the same bits as the full draw's rows,
// and the stream goes on where the full draw leaves it.
TEST(Rng, NormalRowsAreTheFullDrawsRows) {
  Rng full(11), part(11);
  const Tensor whole = full.normal({8, 3, 5}, 0.1, 2.0);
  for (const auto& [begin, rows] : {std::pair<int64_t, int64_t>{0, 8}, {2, 3}, {7, 1}, {4, 0}}) {
    Rng r(11);
    const Tensor mine = r.normal_rows({8, 3, 5}, begin, rows, 0.1, 2.0);
    EXPECT_TRUE(bit_equal(mine, whole.slice(0, begin, begin + rows).contiguous()))
        << "rows [" << begin << ", " << begin + rows << ")";
    EXPECT_EQ(r.offset(), full.offset());
  }
  part.normal_rows({8, 3, 5}, 6, 2, 0.1, 2.0);
  EXPECT_TRUE(bit_equal(part.normal({4}, 0, 1), full.normal({4}, 0, 1)));
  EXPECT_THROW(part.normal_rows({8, 3}, 7, 2, 0, 1), ShapeError);
}

TEST(Rng, SameSeedSameValuesAnyDevice) {
  Rng r1(7), r2(7);
  EXPECT_TRUE(bit_equal(r1.normal({100}, 0, 1), r2.normal({100}, 0, 1)));
  Rng r3(8);
  EXPECT_FALSE(bit_equal(Rng(7).normal({100}, 0, 1), r3.normal({100}, 0, 1)));
  // State save/restore continues the same stream.
  Rng a(3);
  a.uniform({10}, 0, 1);
  Rng b(0);
  b.set_state(a.seed(), a.offset());
  EXPECT_TRUE(bit_equal(a.uniform({5}, 0, 1), b.uniform({5}, 0, 1)));
  // A large draw is filled in chunks on several threads: element i is still the single draw at
  // offset base + 2i (normal) or base + i (uniform), across chunk and thread boundaries.
  const int64_t n = 3 * (int64_t(1) << 18) + 7;
  Rng big(5);
  big.uniform({3}, 0, 1);
  const std::vector<float> normals = big.normal({n}, 0.5, 2).to_floats();
  const std::vector<float> uniforms = big.uniform({n}, -1, 3).to_floats();
  EXPECT_EQ(big.offset(), uint64_t(3 + 3 * n));
  for (int64_t i : {int64_t(0), int64_t(1) << 16, (int64_t(1) << 16) - 1, n / 2, n - 1}) {
    Rng one(5);
    one.set_state(5, uint64_t(3 + 2 * i));
    EXPECT_EQ(one.normal({1}, 0.5, 2).to_floats()[0], normals[size_t(i)]) << "normal element " << i;
    one.set_state(5, uint64_t(3 + 2 * n + i));
    EXPECT_EQ(one.uniform({1}, -1, 3).to_floats()[0], uniforms[size_t(i)]) << "uniform element " << i;
  }
  if (cuda_available()) {
    Rng g(7), h(7);
    EXPECT_TRUE(bit_equal(g.normal({100}, 0, 1, DType::f32, Device::cuda()), h.normal({100}, 0, 1)));
  }
}

TEST(TensorCuda, CastsMatchCpuBitForBit) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  // Wide range (with some values past the FP8 limits) plus the special values.
  std::vector<float> v = rng.uniform({4093}, -600, 600).to_floats();
  std::vector<float> small = rng.uniform({1000}, -0.01, 0.01).to_floats();
  v.insert(v.end(), small.begin(), small.end());
  for (float s : {0.0f, -0.0f, NAN, -NAN, INFINITY, -INFINITY, 448.0f, 449.0f, 1e-30f}) v.push_back(s);
  Tensor host = Tensor::from_floats(v, {int64_t(v.size())});
  Tensor dev = host.to(Device::cuda());
  for (DType t : {DType::bf16, DType::e4m3, DType::e5m2}) {
    SCOPED_TRACE(dtype_name(t));
    EXPECT_TRUE(bit_equal(dev.to(t), host.to(t)));
    EXPECT_TRUE(bit_equal(dev.to(t).to(DType::f32), host.to(t).to(DType::f32)));
  }
  Tensor ints = Tensor::from_ints({1, -5, 1 << 30, 7}, {4}, DType::i64);
  EXPECT_TRUE(bit_equal(ints.to(Device::cuda()).to(DType::i32), ints.to(DType::i32)));
}

TEST(TensorCuda, ContiguousAndCopiesMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  for (DType t : {DType::f32, DType::bf16, DType::e4m3, DType::i64}) {
    Tensor a = t == DType::i64 ? rng.randint({7, 130, 3}, -100, 100, DType::i64) : random_tensor(rng, {7, 130, 3}, t);
    Tensor g = a.to(Device::cuda());
    EXPECT_TRUE(bit_equal(g.transpose(0, 1).contiguous(), a.transpose(0, 1).contiguous()));
    EXPECT_TRUE(
        bit_equal(g.slice(1, 5, 129).transpose(1, 2).contiguous(), a.slice(1, 5, 129).transpose(1, 2).contiguous()));
    EXPECT_TRUE(bit_equal(g.clone(), a));
  }
  EXPECT_TRUE(
      bit_equal(Tensor::full({5, 3}, 2.5, DType::bf16, Device::cuda()), Tensor::full({5, 3}, 2.5, DType::bf16)));
  EXPECT_TRUE(bit_equal(Tensor::zeros({0, 3}, DType::f32, Device::cuda()), Tensor::zeros({0, 3}, DType::f32)));
  EXPECT_THROW(Tensor::empty({1}, DType::f32, Device::cuda(cuda_device_count())), DeviceError);
}

// Every read of a GPU tensor into host memory waits for the GPU and counts as a host synchronisation (what
// train.cuda_graph: auto reads before it captures a step); copies that stay on one side do not.
TEST(TensorCuda, EveryReadToTheHostCountsAsAHostSync) {
  FLOWMOE_REQUIRE_CUDA();
  Tensor host = Tensor::from_floats({1, 2, 3, 4}, {4});
  const uint64_t before = num_host_syncs();
  Tensor gpu = host.to(Device::cuda());  // host to device
  Tensor other = gpu.clone();            // device to device
  host.copy_(Tensor::from_floats({5, 6, 7, 8}, {4}));
  EXPECT_EQ(num_host_syncs(), before) << "no read to the host yet";
  EXPECT_EQ(gpu.to_floats(), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ(num_host_syncs(), before + 1) << "to_floats";
  EXPECT_EQ(Tensor::from_ints({3}, {1}, DType::i32, Device::cuda()).to_ints(), (std::vector<int64_t>{3}));
  EXPECT_EQ(num_host_syncs(), before + 2) << "to_ints";
  EXPECT_EQ(other.to_doubles().size(), 4u);
  EXPECT_EQ(num_host_syncs(), before + 3) << "to_doubles";
  EXPECT_TRUE(other.to(Device::cpu()).defined());
  EXPECT_EQ(num_host_syncs(), before + 4) << "to(cpu)";
  host.copy_(other);
  EXPECT_EQ(num_host_syncs(), before + 5) << "copy_ into a host tensor";
}

TEST(TensorFp8, ScalesTravelWithTheValue) {
  Tensor data = Tensor::zeros({4, 256}, DType::e4m3);
  Tensor s = Tensor::full({4, 2}, 0.5, DType::f32);
  Tensor q = data.with_scales(s, ScalingMode::rowwise_1x128);
  ASSERT_NE(q.fp8_scales(), nullptr);
  EXPECT_EQ(q.fp8_scales()->mode, ScalingMode::rowwise_1x128);
  EXPECT_EQ(data.fp8_scales(), nullptr);
  EXPECT_EQ(q.view({8, 128}).fp8_scales(), nullptr);  // a reshaped view no longer matches its scales
  EXPECT_THROW(Tensor::zeros({2}, DType::f32).with_scales(s, ScalingMode::rowwise_1x128), DTypeError);
  // An FP8 value flows through the graph as a value, scales attached.
  Variable v(q);
  Variable r = checkpoint([](const std::vector<Variable>& in) { return in; }, {v})[0];
  ASSERT_NE(r.data().fp8_scales(), nullptr);
  EXPECT_TRUE(r.data().fp8_scales()->scale_inv.shares_storage_with(s));
}
