// The colwise FP8 kernels over device counts (kernels/fp8_transpose.h: fp8_transpose_device_*,
// kernels/quantize.h: quantize_colwise_device_*). The CPU reference expert by expert against the host-count
// kernel run on that expert's rows alone (its q_t columns at its row offset, its scale rows from
// Σ_{i<e} ceil(r_i/128), the layout the one-launch FP8 wgrad reads), rows of scale_inv past the real blocks
// 1.0f and columns past the total zero, outputs pre-filled with junk so every byte must be written;
// argument errors naming the values; CUDA against the host-count CUDA kernels (the first num_blocks scale
// rows, all of q_t) and the CPU reference (every byte) on edge counts: 0 tokens, M = 0, an empty expert,
// one hot expert, M not a multiple of 128 or of 16, K not a multiple of 16, E = 1 and E = 256; and the
// launchers captured in a CUDA graph (capture fails on any host synchronisation) replayed with new counts.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/fp8.h"
#include "kernels/fp8_transpose.h"
#include "kernels/quantize.h"
#include "tests/support/captured_graph.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

using Counts = std::vector<int32_t>;

struct Case {
  const char* what;
  int64_t M, K;
  Counts counts;
};

std::vector<Case> edge_cases(std::mt19937_64& gen) {
  std::vector<Case> cases = {
      {"0 tokens", 300, 256, {0, 0, 0, 0}},
      {"M = 0", 0, 128, {0, 0}},
      {"an empty expert and a tail", 500, 200, {37, 0, 128, 300}},
      {"one hot expert", 384, 384, {0, 384, 0}},
      {"E = 1, M not a multiple of 16", 1000, 136, {999}},
      {"no tail, empty experts at both ends", 466, 128, {0, 37, 128, 300, 1, 0}},
      {"K not a multiple of 16", 260, 17, {129, 131}},
  };
  std::uniform_int_distribution<int32_t> rows(0, 20);
  Counts many(256);
  for (size_t e = 0; e < many.size(); ++e) many[e] = e % 5 == 0 ? 0 : rows(gen);
  cases.push_back({"E = 256", std::accumulate(many.begin(), many.end(), int64_t(0)) + 77, 256, many});
  cases.push_back({"E = 256, all rows in the last", 200, 128, Counts(256, 0)});
  cases.back().counts.back() = 200;
  return cases;
}

int64_t blocks_of(const Counts& c) {
  int64_t n = 0;
  for (int32_t r : c) n += fp8_num_blocks(r);
  return n;
}

// Rowwise FP8 input: random e4m3 bytes (no NaN codes) with power-of-two scales 2^[-20, 4], about one
// block in eight all zeros at scale 1 (as pad rows are).
struct Rowwise {
  Tensor q, s;  // u8 [M, K], f32 [M, ceil(K/128)] on the CPU
};
Rowwise random_rowwise(std::mt19937_64& gen, int64_t M, int64_t K) {
  const int64_t nb = fp8_num_blocks(K);
  Rowwise x{Tensor::empty({M, K}, DType::u8), Tensor::empty({M, nb}, DType::f32)};
  std::uniform_int_distribution<int> byte(0, 255), e(-20, 4), die(0, 7);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t b = 0; b < nb; ++b) {
      const bool zero = die(gen) == 0;
      x.s.data<float>()[i * nb + b] = zero ? 1.f : fp8_pow2(e(gen));
      for (int64_t j = b * 128; j < std::min(K, b * 128 + 128); ++j) {
        int v = byte(gen);
        while ((v & 0x7F) == 0x7F) v = byte(gen);
        x.q.data<uint8_t>()[i * K + j] = uint8_t(zero ? v & 0x80 : v);
      }
    }
  return x;
}
// High-precision input of rows with magnitudes spread over 2^[-12, 12] (per row), in f32 or bf16.
Tensor random_rows(Rng& rng, std::mt19937_64& gen, int64_t M, int64_t K, DType dtype) {
  std::vector<float> v = random_tensor(rng, {M, K}).to_floats();
  std::uniform_int_distribution<int> e(-12, 12);
  for (int64_t i = 0; i < M; ++i) {
    const float scale = fp8_pow2(e(gen));
    for (int64_t j = 0; j < K; ++j) v[size_t(i * K + j)] *= scale;
  }
  return Tensor::from_floats(v, {M, K}, dtype);
}

// check(x, case) for every edge case on fresh inputs: rowwise FP8 for the transpose, f32 and bf16 rows
// for the quantize.
template <class Check>
void for_each_transpose_case(Check&& check) {
  std::mt19937_64 gen(test_seed());
  for (const Case& c : edge_cases(gen)) {
    SCOPED_TRACE(c.what);
    check(random_rowwise(gen, c.M, c.K), c);
  }
}
template <class Check>
void for_each_quantize_case(Check&& check) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (DType dtype : {DType::f32, DType::bf16})
    for (const Case& c : edge_cases(gen)) {
      SCOPED_TRACE(std::string(c.what) + " " + dtype_name(dtype));
      check(random_rows(rng, gen, c.M, c.K, dtype), c);
    }
}

// A colwise result: q [K, M] u8 and scale_inv [rows, K] f32, on the CPU.
struct Colwise {
  Tensor q, s;
};
Colwise junk_colwise(int64_t M, int64_t K, int64_t scale_rows, Device dev = Device::cpu()) {
  return {Tensor::full({K, M}, 0xAB, DType::u8, dev), Tensor::full({scale_rows, K}, -7.0, DType::f32, dev)};
}

// The CPU references over host counts.
Colwise transpose_cpu(const Rowwise& x, const Counts& c) {
  const int64_t M = x.q.size(0), K = x.q.size(1);
  Colwise out = junk_colwise(M, K, fp8_colwise_max_blocks(M, int64_t(c.size())));
  fp8_transpose_device_cpu(x.q.data<uint8_t>(), x.s.data<float>(), M, K, c.data(), int64_t(c.size()),
                           out.q.data<uint8_t>(), out.s.data<float>());
  return out;
}
Colwise quantize_cpu(const Tensor& x, const Counts& c) {
  const int64_t M = x.size(0), K = x.size(1);
  Colwise out = junk_colwise(M, K, fp8_colwise_max_blocks(M, int64_t(c.size())));
  quantize_colwise_device_cpu(x.dtype(), x.raw_data(), M, K, c.data(), int64_t(c.size()), out.q.data<uint8_t>(),
                              out.s.data<float>());
  return out;
}
// The host-count kernels on rows [row0, row0 + rows) alone, as one segment.
Colwise transpose_rows(const Rowwise& x, int64_t row0, int64_t rows) {
  const int64_t K = x.q.size(1);
  Tensor q = x.q.slice(0, row0, row0 + rows).contiguous(), s = x.s.slice(0, row0, row0 + rows).contiguous();
  Colwise out = junk_colwise(rows, K, fp8_num_blocks(rows));
  fp8_transpose_cpu(q.data<uint8_t>(), s.data<float>(), rows, K, &rows, 1, out.q.data<uint8_t>(), out.s.data<float>());
  return out;
}
Colwise quantize_rows(const Tensor& x, int64_t row0, int64_t rows) {
  const int64_t K = x.size(1);
  Tensor xs = x.slice(0, row0, row0 + rows).contiguous();
  Colwise out = junk_colwise(rows, K, fp8_num_blocks(rows));
  quantize_colwise_cpu(xs.dtype(), xs.raw_data(), rows, K, &rows, 1, out.q.data<uint8_t>(), out.s.data<float>());
  return out;
}

// Expert e of `got` against `per_expert(off_e, r_e)`; then the fill: scale rows past the real blocks 1.0f,
// q columns past the total +0.
template <class PerExpert>
::testing::AssertionResult expert_by_expert(const Colwise& got, const Counts& c, PerExpert&& per_expert) {
  const int64_t K = got.q.size(0), M = got.q.size(1);
  const auto* q = got.q.data<uint8_t>();
  const auto* s = got.s.data<float>();
  int64_t off = 0, blk = 0;
  for (size_t e = 0; e < c.size(); ++e) {
    const int64_t r = c[e], nb = fp8_num_blocks(r);
    if (r == 0) continue;  // owns no column and no scale row
    const Colwise want = per_expert(off, r);
    for (int64_t j = 0; j < K; ++j)
      for (int64_t i = 0; i < r; ++i)
        if (q[j * M + off + i] != want.q.data<uint8_t>()[j * r + i])
          return ::testing::AssertionFailure()
                 << "expert " << e << ": q[" << j << ", " << off + i << "] = 0x" << std::hex << int(q[j * M + off + i]);
    for (int64_t n = 0; n < nb * K; ++n)
      if (fp8_f32_bits(s[blk * K + n]) != fp8_f32_bits(want.s.data<float>()[n]))
        return ::testing::AssertionFailure() << "expert " << e << ": scale row " << blk + n / K << " column " << n % K
                                             << " = " << s[blk * K + n] << ", want " << want.s.data<float>()[n];
    off += r, blk += nb;
  }
  for (int64_t n = blk * K; n < got.s.numel(); ++n)
    if (fp8_f32_bits(s[n]) != fp8_f32_bits(1.f))
      return ::testing::AssertionFailure() << "unused scale row " << n / K << " = " << s[n] << ", want 1";
  for (int64_t j = 0; j < K; ++j)
    for (int64_t i = off; i < M; ++i)
      if (q[j * M + i] != 0) return ::testing::AssertionFailure() << "tail q[" << j << ", " << i << "] is not 0";
  return ::testing::AssertionSuccess();
}

}  // namespace

TEST(Fp8ColwiseDevice, TransposeCpuIsTheHostKernelPerExpert) {
  for_each_transpose_case([](const Rowwise& x, const Case& c) {
    const Colwise got = transpose_cpu(x, c.counts);
    EXPECT_EQ(got.s.size(0), fp8_num_blocks(c.M) + int64_t(c.counts.size()));
    EXPECT_TRUE(expert_by_expert(got, c.counts, [&](int64_t off, int64_t r) { return transpose_rows(x, off, r); }));
  });
}

TEST(Fp8ColwiseDevice, QuantizeCpuIsTheHostKernelPerExpert) {
  for_each_quantize_case([](const Tensor& x, const Case& c) {
    const Colwise got = quantize_cpu(x, c.counts);
    EXPECT_TRUE(expert_by_expert(got, c.counts, [&](int64_t off, int64_t r) { return quantize_rows(x, off, r); }));
  });
}

TEST(Fp8ColwiseDevice, ErrorsNameTheValues) {
  std::vector<uint8_t> q(64 * 8), q_t(64 * 8);
  std::vector<float> s(64 * 8), s_t(64 * 8);
  auto transpose = [&](const Counts& c, int64_t M) {
    fp8_transpose_device_cpu(q.data(), s.data(), M, 8, c.data(), int64_t(c.size()), q_t.data(), s_t.data());
  };
  auto quantize = [&](const Counts& c) {
    quantize_colwise_device_cpu(DType::f32, s.data(), 8, 8, c.data(), int64_t(c.size()), q_t.data(), s_t.data());
  };
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        transpose({3, -2}, 8);
      },
      {"fp8_transpose_device_cpu", "expert 1", "-2"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { transpose({5, 4}, 8); }, {"sum to 9", "M = 8"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { transpose(Counts(257, 0), 8); }, {"E=257", "256"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { quantize({9}); }, {"quantize_colwise_device_cpu", "sum to 9"}));
  EXPECT_TRUE(throws_naming<Error>(
      [&] { fp8_transpose_device_cpu(q.data(), s.data(), 8, 8, nullptr, 2, q_t.data(), s_t.data()); }, {"no counts"}));
  if (!built_with_cuda()) return;  // the launchers check their arguments before any device work
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { fp8_transpose_device_cuda(nullptr, nullptr, 64, 128, nullptr, 300, nullptr, nullptr, nullptr); },
      {"fp8_transpose_device_cuda", "E=300"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] { quantize_colwise_device_cuda(DType::f32, nullptr, -1, 128, nullptr, 0, nullptr, nullptr, nullptr); },
      {"quantize_colwise_device_cuda", "[-1, 128]"}));
}

// ---- CUDA ---------------------------------------------------------------------------------------

namespace {

Tensor gpu_counts(const Counts& c) {
  return Tensor::from_ints(std::vector<int64_t>(c.begin(), c.end()), {int64_t(c.size())}, DType::i32, Device::cuda());
}
Colwise to_cpu(const Colwise& c) { return {c.q.to(Device::cpu()), c.s.to(Device::cpu())}; }

Colwise transpose_cuda(const Rowwise& x, const Counts& c) {
  const int64_t M = x.q.size(0), K = x.q.size(1);
  Tensor q = x.q.to(Device::cuda()), s = x.s.to(Device::cuda()), counts = gpu_counts(c);
  Colwise out = junk_colwise(M, K, fp8_colwise_max_blocks(M, int64_t(c.size())), Device::cuda());
  fp8_transpose_device_cuda(q.data<uint8_t>(), s.data<float>(), M, K, counts.data<int32_t>(), int64_t(c.size()),
                            out.q.data<uint8_t>(), out.s.data<float>(), current_stream(0));
  return to_cpu(out);
}
Colwise quantize_cuda(const Tensor& x_cpu, const Counts& c) {
  const int64_t M = x_cpu.size(0), K = x_cpu.size(1);
  Tensor x = x_cpu.to(Device::cuda()), counts = gpu_counts(c);
  Colwise out = junk_colwise(M, K, fp8_colwise_max_blocks(M, int64_t(c.size())), Device::cuda());
  quantize_colwise_device_cuda(x.dtype(), x.raw_data(), M, K, counts.data<int32_t>(), int64_t(c.size()),
                               out.q.data<uint8_t>(), out.s.data<float>(), current_stream(0));
  return to_cpu(out);
}
// The host-count CUDA kernels: the outputs the device-count ones must equal on their first num_blocks rows.
template <class Launch>
Colwise host_count_cuda(int64_t M, int64_t K, const Counts& c, Launch&& launch) {
  const std::vector<int64_t> rows(c.begin(), c.end());
  Colwise out = junk_colwise(M, K, blocks_of(c), Device::cuda());
  launch(rows, out.q.data<uint8_t>(), out.s.data<float>());
  return to_cpu(out);
}

void expect_same(const Colwise& got, const Colwise& cpu, const Colwise& host, int64_t num_blocks) {
  EXPECT_TRUE(bit_equal(got.q, cpu.q)) << "q vs the CPU reference";
  EXPECT_TRUE(bit_equal(got.s, cpu.s)) << "scale_inv vs the CPU reference";
  EXPECT_TRUE(bit_equal(got.q, host.q)) << "q vs the host-count kernel";
  EXPECT_TRUE(bit_equal(got.s.slice(0, 0, num_blocks).contiguous(), host.s)) << "scale_inv vs the host-count kernel";
}

}  // namespace

TEST(Fp8ColwiseDeviceCuda, TransposeMatchesHostCountKernelAndCpu) {
  FLOWMOE_REQUIRE_CUDA();
  for_each_transpose_case([](const Rowwise& x, const Case& c) {
    Tensor q = x.q.to(Device::cuda()), s = x.s.to(Device::cuda());
    auto launch = [&](const std::vector<int64_t>& rows, uint8_t* q_t, float* s_t) {
      fp8_transpose_cuda(q.data<uint8_t>(), s.data<float>(), c.M, c.K, rows.data(), int64_t(rows.size()), q_t, s_t,
                         current_stream(0));
    };
    const Colwise host = host_count_cuda(c.M, c.K, c.counts, launch);
    expect_same(transpose_cuda(x, c.counts), transpose_cpu(x, c.counts), host, blocks_of(c.counts));
  });
}

TEST(Fp8ColwiseDeviceCuda, QuantizeMatchesHostCountKernelAndCpu) {
  FLOWMOE_REQUIRE_CUDA();
  for_each_quantize_case([](const Tensor& x, const Case& c) {
    Tensor xg = x.to(Device::cuda());
    auto launch = [&](const std::vector<int64_t>& rows, uint8_t* q, float* s) {
      quantize_colwise_cuda(x.dtype(), xg.raw_data(), c.M, c.K, rows.data(), int64_t(rows.size()), q, s,
                            current_stream(0));
    };
    const Colwise host = host_count_cuda(c.M, c.K, c.counts, launch);
    expect_same(quantize_cuda(x, c.counts), quantize_cpu(x, c.counts), host, blocks_of(c.counts));
  });
}

#if defined(FLOWMOE_WITH_CUDA)
// Both launchers captured into one CUDA graph (stream capture rejects any call that synchronises the host),
// then replayed: each replay reads the counts from their device buffer, so new counts copied into it give
// that step's layouts, bit for bit those of the CPU reference.
TEST(Fp8ColwiseDeviceCuda, CapturedInAGraphAndReplayedWithNewCounts) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  const int64_t M = 640, K = 256;
  const Counts first = {100, 0, 300, 33}, second = {0, 640, 0, 0}, none = {0, 0, 0, 0};
  const int64_t E = int64_t(first.size()), max_blocks = fp8_colwise_max_blocks(M, E);
  const Rowwise x = random_rowwise(gen, M, K);
  const Tensor xf = random_rows(rng, gen, M, K, DType::bf16);
  Tensor q = x.q.to(Device::cuda()), s = x.s.to(Device::cuda()), xg = xf.to(Device::cuda());
  Tensor counts = gpu_counts(first);
  Colwise t = junk_colwise(M, K, max_blocks, Device::cuda()), c = junk_colwise(M, K, max_blocks, Device::cuda());
  CapturedGraph g;
  cudaStream_t st = g.stream();
  auto launch_all = [&] {
    fp8_transpose_device_cuda(q.data<uint8_t>(), s.data<float>(), M, K, counts.data<int32_t>(), E, t.q.data<uint8_t>(),
                              t.s.data<float>(), st);
    quantize_colwise_device_cuda(DType::bf16, xg.raw_data(), M, K, counts.data<int32_t>(), E, c.q.data<uint8_t>(),
                                 c.s.data<float>(), st);
  };
  ASSERT_TRUE(g.capture(launch_all));
  for (const Counts& rows : {first, second, none, second}) {
    SCOPED_TRACE(::testing::Message() << "replay with counts " << ::testing::PrintToString(rows));
    ASSERT_EQ(cudaMemcpyAsync(counts.raw_data(), rows.data(), rows.size() * 4, cudaMemcpyHostToDevice, st),
              cudaSuccess);
    ASSERT_TRUE(g.replay());
    const Colwise tt = to_cpu(t), cc = to_cpu(c), want_t = transpose_cpu(x, rows), want_c = quantize_cpu(xf, rows);
    EXPECT_TRUE(bit_equal(tt.q, want_t.q));
    EXPECT_TRUE(bit_equal(tt.s, want_t.s));
    EXPECT_TRUE(bit_equal(cc.q, want_c.q));
    EXPECT_TRUE(bit_equal(cc.s, want_c.s));
  }
}
#endif
