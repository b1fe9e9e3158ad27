// grouped_gemm_device: the one-launch grouped GEMMs with device row counts (kernels/grouped_gemm_device.h),
// each against its CPU reference and against the per-expert cuBLASLt launcher it replaces, on fresh random
// inputs over edge shapes (E = 1 and 64, an empty expert, one hot expert with every row, 0 rows in total,
// rows past sum(counts), N and K multiples of 128 but not of the 256-wide bf16 tile, FP8 wgrad segments
// ending in a partial 1x128 block); argument errors; and the absence of host synchronisation: the
// launchers are captured into a CUDA graph (capture fails on any synchronising call) and the graph is
// replayed with new counts written into the same device buffer.
//
// Tolerances, with a tolerance rather than bitwise because CUTLASS and cuBLASLt sum in different orders
// (rel_error per expert segment, so one wrong expert cannot hide in a norm):
//   bf16 y / dx: 1e-2 against the f32 CPU reference on bf16-representable inputs (the output is rounded to
//   bf16), 4e-3 against cuBLASLt (both round the same fp32 sums; a few elements land one bf16 step apart);
//   bf16 dw (fp32 out): 1e-4 against the CPU, 1e-5 against cuBLASLt (fp32 sums in another order);
//   FP8: the bounds of tests/test_fp8_grouped_linear.cpp (f32 out rel_error <= 5e-4, bf16 out 5e-4 + 2·2^-9),
//   both against the CPU (dequantize, f32 GEMM) and against cuBLASLt (FP8 tensor-core sums in other orders).
// Rows past sum(counts) and experts with no rows must be exactly +0 (or keep dw, bit for bit, when
// accumulating). Repeated launches are bit-identical (no atomics, no split-K). A count that is negative,
// not a multiple of 16 (FP8 wgrad) or sums past m_total traps on the device; that is not tested here (a
// trap ends the process's CUDA context).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#if defined(FLOWMOE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

#include "kernels/fp8_grouped_linear.h"
#include "kernels/grouped_gemm_device.h"
#include "kernels/grouped_linear.h"
#include "tests/support/captured_graph.h"
#include "tests/support/checks.h"
#include "tests/support/fp8_operands.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

using Rows = std::vector<int64_t>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

int64_t sum_rows(const Rows& r) { return std::accumulate(r.begin(), r.end(), int64_t(0)); }

// Counts for num_experts experts, each uniform in [0, max_rows] rounded down to a multiple of `multiple`;
// zero_every > 0 empties every zero_every-th expert.
Rows random_counts(std::mt19937_64& gen, int64_t num_experts, int64_t max_rows, int64_t multiple, int64_t zero_every) {
  std::uniform_int_distribution<int64_t> dist(0, max_rows);
  Rows rows;
  for (int64_t e = 0; e < num_experts; ++e) rows.push_back(e % zero_every == 0 ? 0 : dist(gen) / multiple * multiple);
  return rows;
}

Tensor device_counts(const Rows& rows) {
  return Tensor::from_ints(rows, {int64_t(rows.size())}, DType::i32, Device::cuda());
}
Tensor device_workspace(int64_t num_experts) {
  return Tensor::empty({int64_t(grouped_gemm_device_workspace_bytes(num_experts))}, DType::u8, Device::cuda());
}
size_t bytes_of(const Tensor& t) { return t.nbytes(); }

void expect_zero(const Tensor& t, const char* what) {
  for (double v : t.to_doubles())
    if (v != 0.0 || std::signbit(v)) {
      ADD_FAILURE() << what << " must be exactly +0, found " << v;
      return;
    }
}

// Rows of [m_total, cols] outputs, per expert segment, and the tail rows (exactly 0 in `got`).
void expect_rows_close(const Tensor& got, const Tensor& ref, const Rows& rows, double tol, const char* what) {
  ASSERT_EQ(got.shape(), ref.shape()) << what;
  int64_t off = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    const int64_t r = rows[e];
    if (r > 0) {
      EXPECT_LE(rel_error(got.slice(0, off, off + r), ref.slice(0, off, off + r)), tol)
          << what << ", expert " << e << " (" << r << " rows at " << off << ")";
    }
    off += r;
  }
  expect_zero(got.slice(0, off, got.size(0)), what);
}

// dw [E, n, k] per expert; an expert with no rows is exactly 0, or exactly `kept` when accumulating.
void expect_experts_close(const Tensor& got, const Tensor& ref, const Rows& rows, double tol, const Tensor* kept,
                          const char* what) {
  ASSERT_EQ(got.shape(), ref.shape()) << what;
  for (size_t e = 0; e < rows.size(); ++e) {
    const int64_t ei = int64_t(e);
    Tensor g = got.slice(0, ei, ei + 1);
    if (rows[e] > 0) {
      EXPECT_LE(rel_error(g, ref.slice(0, ei, ei + 1)), tol) << what << ", expert " << e << " (" << rows[e] << " rows)";
    } else if (kept) {
      EXPECT_TRUE(bit_equal(g.contiguous(), kept->slice(0, ei, ei + 1).contiguous())) << what << ", empty expert " << e;
    } else {
      expect_zero(g, what);
    }
  }
}

// ---- bf16 ---------------------------------------------------------------------------------------

// f32 host tensors holding bf16-representable values (so the reference sees what the GPU sees), and an
// f32 dw to accumulate into.
struct Bf16Problem {
  Rows rows;
  int64_t m_total, n, k;
  Tensor x, w, dy, dw0;
};
Bf16Problem make_bf16(Rng& rng, Rows rows, int64_t tail, int64_t n, int64_t k) {
  const int64_t m = sum_rows(rows) + tail, e = int64_t(rows.size());
  auto draw = [&](const Shape& s) { return random_tensor(rng, s).to(DType::bf16).to(DType::f32); };
  return {rows, m, n, k, draw({m, k}), draw({e, n, k}), draw({m, n}), random_tensor(rng, {e, n, k})};
}

struct Bf16Results {
  Tensor y, dx, dw, dw_acc;  // host
};

Bf16Results bf16_cpu(const Bf16Problem& p) {
  const int64_t e = int64_t(p.rows.size());
  Bf16Results r{Tensor::empty({p.m_total, p.n}, DType::f32), Tensor::empty({p.m_total, p.k}, DType::f32),
                Tensor::empty({e, p.n, p.k}, DType::f32), p.dw0.clone()};
  grouped_linear_forward_cpu<float>(p.x.data<float>(), p.w.data<float>(), r.y.data<float>(), p.rows.data(), e,
                                    p.m_total, p.n, p.k);
  grouped_linear_dgrad_cpu<float>(p.dy.data<float>(), p.w.data<float>(), r.dx.data<float>(), p.rows.data(), e,
                                  p.m_total, p.n, p.k);
  grouped_linear_wgrad_cpu<float>(p.x.data<float>(), p.dy.data<float>(), r.dw.data<float>(), p.rows.data(), e, p.n, p.k,
                                  false);
  grouped_linear_wgrad_cpu<float>(p.x.data<float>(), p.dy.data<float>(), r.dw_acc.data<float>(), p.rows.data(), e, p.n,
                                  p.k, true);
  return r;
}

// The one-launch launchers (device_counts) or the per-expert cuBLASLt ones, outputs pre-filled with NaN.
Bf16Results bf16_cuda(const Bf16Problem& p, bool one_launch) {
  const Device gpu = Device::cuda();
  const int64_t e = int64_t(p.rows.size()), m = p.m_total, n = p.n, k = p.k;
  Tensor x = p.x.to(DType::bf16).to(gpu), w = p.w.to(DType::bf16).to(gpu), dy = p.dy.to(DType::bf16).to(gpu);
  Tensor y = Tensor::full({m, n}, kNaN, DType::bf16, gpu), dx = Tensor::full({m, k}, kNaN, DType::bf16, gpu);
  Tensor dw = Tensor::full({e, n, k}, kNaN, DType::f32, gpu), acc = p.dw0.to(gpu);
  cudaStream_t s = current_stream(0);
  if (one_launch) {
    Tensor counts = device_counts(p.rows), ws = device_workspace(e);
    const int32_t* c = counts.data<int32_t>();
    grouped_gemm_fprop_device_cuda(DType::bf16, x.raw_data(), w.raw_data(), y.raw_data(), c, e, m, n, k, ws.raw_data(),
                                   bytes_of(ws), s);
    grouped_gemm_dgrad_device_cuda(DType::bf16, dy.raw_data(), w.raw_data(), dx.raw_data(), c, e, m, n, k,
                                   ws.raw_data(), bytes_of(ws), s);
    grouped_gemm_wgrad_device_cuda(DType::bf16, x.raw_data(), dy.raw_data(), dw.data<float>(), c, e, m, n, k, false,
                                   ws.raw_data(), bytes_of(ws), s);
    grouped_gemm_wgrad_device_cuda(DType::bf16, x.raw_data(), dy.raw_data(), acc.data<float>(), c, e, m, n, k, true,
                                   ws.raw_data(), bytes_of(ws), s);
  } else {
    const int64_t* r = p.rows.data();
    grouped_linear_forward_cuda(DType::bf16, x.raw_data(), w.raw_data(), y.raw_data(), r, e, m, n, k, s);
    grouped_linear_dgrad_cuda(DType::bf16, dy.raw_data(), w.raw_data(), dx.raw_data(), r, e, m, n, k, s);
    grouped_linear_wgrad_cuda(DType::bf16, x.raw_data(), dy.raw_data(), dw.data<float>(), r, e, m, n, k, false, s);
    grouped_linear_wgrad_cuda(DType::bf16, x.raw_data(), dy.raw_data(), acc.data<float>(), r, e, m, n, k, true, s);
  }
  const Device cpu = Device::cpu();
  return {y.to(cpu), dx.to(cpu), dw.to(cpu), acc.to(cpu)};
}

void check_bf16(const Bf16Problem& p) {
  const Bf16Results got = bf16_cuda(p, true), cpu = bf16_cpu(p), lt = bf16_cuda(p, false);
  expect_rows_close(got.y, cpu.y, p.rows, 1e-2, "y vs CPU");
  expect_rows_close(got.dx, cpu.dx, p.rows, 1e-2, "dx vs CPU");
  expect_experts_close(got.dw, cpu.dw, p.rows, 1e-4, nullptr, "dw vs CPU");
  expect_experts_close(got.dw_acc, cpu.dw_acc, p.rows, 1e-4, &p.dw0, "accumulated dw vs CPU");
  expect_rows_close(got.y, lt.y, p.rows, 4e-3, "y vs cuBLASLt");
  expect_rows_close(got.dx, lt.dx, p.rows, 4e-3, "dx vs cuBLASLt");
  expect_experts_close(got.dw, lt.dw, p.rows, 1e-5, nullptr, "dw vs cuBLASLt");
  expect_experts_close(got.dw_acc, lt.dw_acc, p.rows, 1e-5, &p.dw0, "accumulated dw vs cuBLASLt");
}

// ---- FP8 ----------------------------------------------------------------------------------------
// Inputs and their quantized forms: tests/support/fp8_operands.h.

template <class T>
Tensor host_tensor(const std::vector<T>& v, DType dtype) {
  Tensor t = Tensor::empty({int64_t(v.size())}, dtype);
  if (!v.empty()) std::memcpy(t.raw_data(), v.data(), v.size() * sizeof(T));
  return t;
}
template <class T>
Tensor device_tensor(const std::vector<T>& v, DType dtype) {
  return host_tensor(v, dtype).to(Device::cuda());
}

struct Fp8Problem {
  Rows rows;
  int64_t m_total, n, k;
  Quantized x, w;          // fprop: x [m_total, k] rowwise, w [E, n, k] blocks
  Quantized dy_t, x_t;     // wgrad: colwise over the segments
  std::vector<float> dw0;  // accumulate's starting dw
};
Fp8Problem make_fp8(std::mt19937_64& gen, Rows rows, int64_t m_total, int64_t n, int64_t k, bool wgrad) {
  Fp8Problem p{rows, m_total, n, k, {}, {}, {}, {}, {}};
  const int64_t e = int64_t(rows.size()), live = sum_rows(rows);
  if (!wgrad) {
    p.x = quantize_rowwise(make_values(gen, m_total, k, live), m_total, k);
    p.w = quantize_blocks(make_values(gen, e * n, k, e * n), e, n, k);
    return p;
  }
  p.dy_t = quantize_colwise(make_values(gen, m_total, n, live), rows, m_total, n);
  p.x_t = quantize_colwise(make_values(gen, m_total, k, live), rows, m_total, k);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  p.dw0.resize(size_t(e * n * k));
  for (auto& v : p.dw0) v = u(gen);
  return p;
}

enum class Fp8Path { cpu, one_launch, cublaslt };

Tensor fp8_fprop(const Fp8Problem& p, DType out, Fp8Path path) {
  const int64_t e = int64_t(p.rows.size());
  if (path == Fp8Path::cpu) {
    Tensor y = Tensor::full({p.m_total, p.n}, kNaN, out);
    fp8_grouped_gemm_cpu(out, p.x.q.data(), p.x.s.data(), p.w.q.data(), p.w.s.data(), y.raw_data(), p.rows.data(), e,
                         p.m_total, p.n, p.k);
    return y;
  }
  Tensor x = device_tensor(p.x.q, DType::e4m3), xs = device_tensor(p.x.s, DType::f32);
  Tensor w = device_tensor(p.w.q, DType::e4m3), ws = device_tensor(p.w.s, DType::f32);
  Tensor y = Tensor::full({p.m_total, p.n}, kNaN, out, Device::cuda());
  cudaStream_t s = current_stream(0);
  if (path == Fp8Path::one_launch) {
    Tensor counts = device_counts(p.rows), work = device_workspace(e);
    fp8_grouped_gemm_device_cuda(out, x.data<uint8_t>(), xs.data<float>(), w.data<uint8_t>(), ws.data<float>(),
                                 y.raw_data(), counts.data<int32_t>(), e, p.m_total, p.n, p.k, work.raw_data(),
                                 bytes_of(work), s);
  } else {
    Tensor work =
        Tensor::empty({int64_t(fp8_grouped_gemm_workspace_bytes(p.m_total, p.k, e, p.n))}, DType::u8, Device::cuda());
    fp8_grouped_gemm_cuda(out, x.data<uint8_t>(), xs.data<float>(), w.data<uint8_t>(), ws.data<float>(), y.raw_data(),
                          p.rows.data(), e, p.m_total, p.n, p.k, work.raw_data(), s);
  }
  return y.to(Device::cpu());
}

Tensor fp8_wgrad(const Fp8Problem& p, bool accumulate, Fp8Path path) {
  const int64_t e = int64_t(p.rows.size());
  Tensor dw0 = host_tensor(p.dw0, DType::f32).view({e, p.n, p.k});
  if (path == Fp8Path::cpu) {
    Tensor dw = accumulate ? dw0.clone() : Tensor::full({e, p.n, p.k}, kNaN, DType::f32);
    fp8_grouped_wgrad_cpu(p.dy_t.q.data(), p.dy_t.s.data(), p.x_t.q.data(), p.x_t.s.data(), dw.data<float>(),
                          p.rows.data(), e, p.m_total, p.n, p.k, accumulate);
    return dw;
  }
  Tensor dy = device_tensor(p.dy_t.q, DType::e4m3), dys = device_tensor(p.dy_t.s, DType::f32);
  Tensor x = device_tensor(p.x_t.q, DType::e4m3), xs = device_tensor(p.x_t.s, DType::f32);
  Tensor dw = accumulate ? dw0.to(Device::cuda()) : Tensor::full({e, p.n, p.k}, kNaN, DType::f32, Device::cuda());
  cudaStream_t s = current_stream(0);
  if (path == Fp8Path::one_launch) {
    Tensor counts = device_counts(p.rows), work = device_workspace(e);
    fp8_grouped_wgrad_device_cuda(dy.data<uint8_t>(), dys.data<float>(), x.data<uint8_t>(), xs.data<float>(),
                                  dw.data<float>(), counts.data<int32_t>(), e, p.m_total, p.n, p.k, accumulate,
                                  work.raw_data(), bytes_of(work), s);
  } else {
    fp8_grouped_wgrad_cuda(dy.data<uint8_t>(), dys.data<float>(), x.data<uint8_t>(), xs.data<float>(), dw.data<float>(),
                           p.rows.data(), e, p.m_total, p.n, p.k, accumulate, s);
  }
  return dw.to(Device::cpu());
}

double fp8_tol(DType out) { return out == DType::f32 ? 5e-4 : 5e-4 + 2 * std::ldexp(1.0, -9); }

void check_fp8_fprop(std::mt19937_64& gen, const Rows& rows, int64_t m_total, int64_t n, int64_t k) {
  SCOPED_TRACE(::testing::Message() << "rows " << ::testing::PrintToString(rows) << " M_total " << m_total << " N " << n
                                    << " K " << k);
  const Fp8Problem p = make_fp8(gen, rows, m_total, n, k, false);
  for (DType out : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(out));
    const Tensor got = fp8_fprop(p, out, Fp8Path::one_launch);
    ASSERT_EQ(got.dtype(), out);
    expect_rows_close(got, fp8_fprop(p, out, Fp8Path::cpu), rows, fp8_tol(out), "y vs CPU");
    expect_rows_close(got, fp8_fprop(p, out, Fp8Path::cublaslt), rows, fp8_tol(out), "y vs cuBLASLt");
  }
}

void check_fp8_wgrad(std::mt19937_64& gen, const Rows& rows, int64_t m_total, int64_t n, int64_t k) {
  const Fp8Problem p = make_fp8(gen, rows, m_total, n, k, true);
  const Tensor dw0 = host_tensor(p.dw0, DType::f32).view({int64_t(rows.size()), n, k});
  for (bool acc : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "rows " << ::testing::PrintToString(rows) << " M_total " << m_total << " N "
                                      << n << " K " << k << " accumulate " << acc);
    const Tensor got = fp8_wgrad(p, acc, Fp8Path::one_launch);
    expect_experts_close(got, fp8_wgrad(p, acc, Fp8Path::cpu), rows, 5e-4, acc ? &dw0 : nullptr, "dw vs CPU");
    try {  // cuBLASLt may refuse a segment whose reduction ends in a partial 1x128 block
      expect_experts_close(got, fp8_wgrad(p, acc, Fp8Path::cublaslt), rows, 5e-4, acc ? &dw0 : nullptr,
                           "dw vs cuBLASLt");
    } catch (const CudaError& e) {
      std::printf("[grouped_gemm_device] cuBLASLt comparison skipped: %s\n", e.what());
    }
  }
}

}  // namespace

// ---- argument errors (before any device work: these run in a CUDA build without a GPU) ------------

TEST(GroupedGemmDevice, ErrorsNameTheValues) {
  if (!built_with_cuda()) GTEST_SKIP() << "built without CUDA: the launchers only throw";
  auto fprop = [](DType t, int64_t e, int64_t m, int64_t n, int64_t k) {
    grouped_gemm_fprop_device_cuda(t, nullptr, nullptr, nullptr, nullptr, e, m, n, k, nullptr, 0, nullptr);
  };
  auto dgrad = [](int64_t n, int64_t k) {
    grouped_gemm_dgrad_device_cuda(DType::bf16, nullptr, nullptr, nullptr, nullptr, 2, 64, n, k, nullptr, 0, nullptr);
  };
  auto wgrad = [](DType t) {
    grouped_gemm_wgrad_device_cuda(t, nullptr, nullptr, nullptr, nullptr, 2, 64, 128, 128, false, nullptr, 0, nullptr);
  };
  auto fp8 = [](DType out, int64_t n, int64_t k) {
    fp8_grouped_gemm_device_cuda(out, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 2, 64, n, k, nullptr, 0,
                                 nullptr);
  };
  auto fp8_wgrad_call = [](int64_t m) {
    fp8_grouped_wgrad_device_cuda(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 2, m, 128, 128, false, nullptr,
                                  0, nullptr);
  };
  EXPECT_TRUE(throws_naming<DTypeError>([&] { fprop(DType::f32, 2, 64, 128, 128); },
                                        {"grouped_gemm_fprop_device_cuda", "f32"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fprop(DType::bf16, 2, 64, 100, 128); }, {"N=100", "8"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fprop(DType::bf16, 257, 64, 128, 128); }, {"E=257", "256"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fprop(DType::bf16, 2, -1, 128, 128); }, {"M_total=-1"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { dgrad(128, 12); }, {"grouped_gemm_dgrad_device_cuda", "K=12"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { wgrad(DType::f32); }, {"grouped_gemm_wgrad_device_cuda", "f32"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fp8(DType::bf16, 200, 128); }, {"N=200", "128"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { fp8(DType::e4m3, 128, 128); }, {"e4m3"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fp8_wgrad_call(56); }, {"fp8_grouped_wgrad_device_cuda", "M_total=56"}));
}

// ---- CUDA ---------------------------------------------------------------------------------------

TEST(GroupedGemmDeviceCuda, WorkspaceAndPointerErrors) {
  FLOWMOE_REQUIRE_CUDA();
  const Device gpu = Device::cuda();
  Tensor x = Tensor::zeros({64, 128}, DType::bf16, gpu), w = Tensor::zeros({2, 128, 128}, DType::bf16, gpu);
  Tensor y = Tensor::zeros({64, 128}, DType::bf16, gpu), counts = device_counts({32, 32});
  const size_t need = grouped_gemm_device_workspace_bytes(2);
  EXPECT_GT(need, size_t(0));
  EXPECT_GE(grouped_gemm_device_workspace_bytes(64), need);
  Tensor ws = Tensor::empty({int64_t(need)}, DType::u8, gpu);
  auto fprop = [&](const void* xp, size_t ws_bytes, const int32_t* c) {
    grouped_gemm_fprop_device_cuda(DType::bf16, xp, w.raw_data(), y.raw_data(), c, 2, 64, 128, 128, ws.raw_data(),
                                   ws_bytes, current_stream(0));
  };
  EXPECT_TRUE(throws_naming<Error>([&] { fprop(x.raw_data(), 16, counts.data<int32_t>()); },
                                   {"workspace of 16 bytes", "needs"}));
  EXPECT_TRUE(
      throws_naming<Error>([&] { fprop(static_cast<const char*>(x.raw_data()) + 2, need, counts.data<int32_t>()); },
                           {"not 16-byte aligned"}));
  EXPECT_TRUE(throws_naming<Error>([&] { fprop(x.raw_data(), need, nullptr); }, {"padded_tokens_per_expert"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { grouped_gemm_device_workspace_bytes(300); }, {"E=300"}));
}

TEST(GroupedGemmDeviceCuda, Bf16MatchesCpuAndCublasLt) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  std::mt19937_64 gen(test_seed());
  struct Case {
    const char* what;
    Rows rows;
    int64_t tail, n, k;
  };
  const Case cases[] = {
      {"E=1", {48}, 0, 384, 640},
      {"an empty expert and tail rows", {32, 0, 16, 64}, 16, 384, 640},
      {"one hot expert with every row", {0, 0, 256, 0}, 0, 640, 384},
      {"0 rows in total", {0, 0, 0}, 32, 384, 256},
      {"odd counts, N and K multiples of 8 only", {17, 1, 0, 33}, 3, 200, 136},
      {"E=64, multiples of 16", random_counts(gen, 64, 96, 16, 7), 48, 256, 384},
      {"E=4, 512 rows each", {512, 512, 512, 512}, 0, 1024, 512},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.what << ": rows " << ::testing::PrintToString(c.rows) << " tail " << c.tail
                                      << " N " << c.n << " K " << c.k);
    check_bf16(make_bf16(rng, c.rows, c.tail, c.n, c.k));
  }
}

TEST(GroupedGemmDeviceCuda, Fp8FpropMatchesCpuAndCublasLt) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  check_fp8_fprop(gen, {144}, 160, 256, 384);                               // E = 1, tail rows
  check_fp8_fprop(gen, {0, 16, 48, 160}, 256, 128, 256);                    // an empty expert, short segments
  check_fp8_fprop(gen, {0, 0, 512, 0}, 512, 384, 256);                      // one hot expert
  check_fp8_fprop(gen, {0, 0}, 32, 128, 128);                               // 0 rows in total
  check_fp8_fprop(gen, {64, 32, 16, 0, 128, 48, 256, 80}, 640, 256, 1408);  // K of 11 blocks (fc2-like dgrad)
  Rows many = random_counts(gen, 64, 96, 16, 9);
  check_fp8_fprop(gen, many, sum_rows(many) + 16, 256, 384);  // E = 64
}

TEST(GroupedGemmDeviceCuda, Fp8WgradMatchesCpuAndCublasLt) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  check_fp8_wgrad(gen, {128, 0, 256}, 400, 128, 256);     // full 1x128 blocks, an empty expert
  check_fp8_wgrad(gen, {0, 16, 48, 144}, 240, 128, 256);  // partial last blocks
  check_fp8_wgrad(gen, {144}, 160, 256, 128);             // E = 1
  check_fp8_wgrad(gen, {0, 512, 0}, 512, 384, 128);       // one hot expert
  check_fp8_wgrad(gen, {0, 0}, 32, 128, 128);             // 0 rows in total
  Rows many = random_counts(gen, 64, 160, 16, 9);
  check_fp8_wgrad(gen, many, sum_rows(many) + 32, 128, 256);  // E = 64
}

// zero_tail false (a worst-case buffer nobody reads past its counts): the counted rows are those of the
// zeroing call bit for bit, and the tail keeps what was there (NaN here), for bf16 fprop / dgrad and FP8.
TEST(GroupedGemmDeviceCuda, TailRowsLeftUnwrittenOnRequest) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  std::mt19937_64 gen(test_seed());
  const Rows rows = {64, 0, 32, 48};
  const int64_t e = 4, m = 512, n = 256, k = 384, live = sum_rows(rows);
  const Device gpu = Device::cuda();
  Bf16Problem bp = make_bf16(rng, rows, m - live, n, k);
  Fp8Problem fp = make_fp8(gen, rows, m, n, k, false);
  Tensor x = bp.x.to(DType::bf16).to(gpu), w = bp.w.to(DType::bf16).to(gpu), dy = bp.dy.to(DType::bf16).to(gpu);
  Tensor qx = device_tensor(fp.x.q, DType::e4m3), qxs = device_tensor(fp.x.s, DType::f32);
  Tensor qw = device_tensor(fp.w.q, DType::e4m3), qws = device_tensor(fp.w.s, DType::f32);
  Tensor counts = device_counts(rows), ws = device_workspace(e);
  const int32_t* c = counts.data<int32_t>();
  cudaStream_t s = current_stream(0);
  struct Out {
    Tensor y, dx, qy;
  };
  auto run = [&](bool zero_tail) {
    Out o{Tensor::full({m, n}, kNaN, DType::bf16, gpu), Tensor::full({m, k}, kNaN, DType::bf16, gpu),
          Tensor::full({m, n}, kNaN, DType::bf16, gpu)};
    grouped_gemm_fprop_device_cuda(DType::bf16, x.raw_data(), w.raw_data(), o.y.raw_data(), c, e, m, n, k,
                                   ws.raw_data(), bytes_of(ws), s, zero_tail);
    grouped_gemm_dgrad_device_cuda(DType::bf16, dy.raw_data(), w.raw_data(), o.dx.raw_data(), c, e, m, n, k,
                                   ws.raw_data(), bytes_of(ws), s, zero_tail);
    fp8_grouped_gemm_device_cuda(DType::bf16, qx.data<uint8_t>(), qxs.data<float>(), qw.data<uint8_t>(),
                                 qws.data<float>(), o.qy.raw_data(), c, e, m, n, k, ws.raw_data(), bytes_of(ws), s,
                                 zero_tail);
    return Out{o.y.to(Device::cpu()), o.dx.to(Device::cpu()), o.qy.to(Device::cpu())};
  };
  const Out zeroed = run(true), left = run(false);
  const std::pair<const char*, std::pair<Tensor, Tensor>> outputs[] = {
      {"bf16 fprop", {zeroed.y, left.y}}, {"bf16 dgrad", {zeroed.dx, left.dx}}, {"fp8 fprop", {zeroed.qy, left.qy}}};
  for (const auto& [what, pair] : outputs) {
    SCOPED_TRACE(what);
    const Tensor &z = pair.first, &l = pair.second;
    EXPECT_TRUE(bit_equal(l.slice(0, 0, live).contiguous(), z.slice(0, 0, live).contiguous())) << "counted rows";
    expect_zero(z.slice(0, live, m), what);
    for (double v : l.slice(0, live, m).to_doubles())
      if (!std::isnan(v)) {
        ADD_FAILURE() << "a tail row was written (" << v << ")";
        break;
      }
  }
}

#if defined(FLOWMOE_WITH_CUDA)
// The launchers captured into one CUDA graph (stream capture rejects any call that synchronises the host),
// then replayed: the counts are read from their device buffer at each replay, so new counts copied into
// it give that step's results; a repeated replay is bit-identical.
TEST(GroupedGemmDeviceCuda, CapturedInAGraphAndReplayedWithNewCounts) {
  FLOWMOE_REQUIRE_CUDA();
  Rng rng(test_seed());
  std::mt19937_64 gen(test_seed());
  const Rows first = {64, 0, 32, 96}, second = {0, 128, 16, 64};  // both leave tail rows of the 256
  const int64_t e = 4, m = 256, n = 384, k = 256;
  const Device gpu = Device::cuda();
  Bf16Problem bp = make_bf16(rng, first, m - sum_rows(first), n, k);
  Fp8Problem fp = make_fp8(gen, first, m, n, k, false);
  Tensor x = bp.x.to(DType::bf16).to(gpu), w = bp.w.to(DType::bf16).to(gpu), dy = bp.dy.to(DType::bf16).to(gpu);
  Tensor y = Tensor::full({m, n}, kNaN, DType::bf16, gpu), dx = Tensor::full({m, k}, kNaN, DType::bf16, gpu);
  Tensor dw = Tensor::full({e, n, k}, kNaN, DType::f32, gpu);
  Tensor qx = device_tensor(fp.x.q, DType::e4m3), qxs = device_tensor(fp.x.s, DType::f32);
  Tensor qw = device_tensor(fp.w.q, DType::e4m3), qws = device_tensor(fp.w.s, DType::f32);
  Tensor qy = Tensor::full({m, n}, kNaN, DType::f32, gpu);
  Tensor counts = device_counts(first), ws = device_workspace(e);
  CapturedGraph g;
  cudaStream_t s = g.stream();
  auto launch_all = [&] {
    const int32_t* c = counts.data<int32_t>();
    grouped_gemm_fprop_device_cuda(DType::bf16, x.raw_data(), w.raw_data(), y.raw_data(), c, e, m, n, k, ws.raw_data(),
                                   bytes_of(ws), s);
    grouped_gemm_dgrad_device_cuda(DType::bf16, dy.raw_data(), w.raw_data(), dx.raw_data(), c, e, m, n, k,
                                   ws.raw_data(), bytes_of(ws), s);
    grouped_gemm_wgrad_device_cuda(DType::bf16, x.raw_data(), dy.raw_data(), dw.data<float>(), c, e, m, n, k, false,
                                   ws.raw_data(), bytes_of(ws), s);
    fp8_grouped_gemm_device_cuda(DType::f32, qx.data<uint8_t>(), qxs.data<float>(), qw.data<uint8_t>(),
                                 qws.data<float>(), qy.raw_data(), c, e, m, n, k, ws.raw_data(), bytes_of(ws), s);
  };
  ASSERT_TRUE(g.capture(launch_all));
  Tensor y_before;
  Rows rows_before;
  for (const Rows& rows : {first, second, second}) {
    SCOPED_TRACE(::testing::Message() << "replay with rows " << ::testing::PrintToString(rows));
    const std::vector<int32_t> c32(rows.begin(), rows.end());
    ASSERT_EQ(cudaMemcpyAsync(counts.raw_data(), c32.data(), c32.size() * 4, cudaMemcpyHostToDevice, s), cudaSuccess);
    ASSERT_TRUE(g.replay());
    Bf16Problem p = bp;
    p.rows = rows;
    const Bf16Results cpu = bf16_cpu(p);
    const Tensor yh = y.to(Device::cpu());
    expect_rows_close(yh, cpu.y, rows, 1e-2, "y");
    expect_rows_close(dx.to(Device::cpu()), cpu.dx, rows, 1e-2, "dx");
    expect_experts_close(dw.to(Device::cpu()), cpu.dw, rows, 1e-4, nullptr, "dw");
    Fp8Problem q = fp;
    q.rows = rows;
    expect_rows_close(qy.to(Device::cpu()), fp8_fprop(q, DType::f32, Fp8Path::cpu), rows, fp8_tol(DType::f32), "fp8 y");
    if (rows == rows_before) {
      EXPECT_TRUE(bit_equal(yh, y_before)) << "the same counts gave another y";
    }
    y_before = yh;
    rows_before = rows;
  }
}
#endif
