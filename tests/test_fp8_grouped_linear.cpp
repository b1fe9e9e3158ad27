// fp8_grouped_linear: the CPU reference against a naive double-precision triple loop written here (its
// own dequantization of every layout), NaN propagation, errors naming the bad values, and CUDA vs the
// CPU reference on fresh random inputs over edge shapes.
//
// Inputs: values u·2^(a_i + b_j) (u uniform in [-1, 1), a_i, b_j random in [-3, 3] per row / column, so
// neighbouring blocks get different power-of-two scales and a wrong scale layout shows), quantized here
// with the scalar fp8.h / dtype.h code: rowwise 1x128, 128x128 weight blocks, colwise over segments.
// Tolerances: CPU (f32 accumulation) vs naive (double): rtol 1e-5, atol 1e-5·max|ref| for f32 output;
// bf16 output within one bf16 rounding (rtol 8e-3). CUDA vs CPU, per expert segment: f32 output
// rel_error <= 5e-4 and all_close(rtol 1e-3, atol 2e-3·max|ref|) (DESIGN.md §4 measured 1.3e-4 / 1.6e-3
// against an exact reference); bf16 output rel_error <= 5e-4 + 2·2^-9 = 4.4e-3, the f32 bound plus one
// bf16 rounding on each side (2e-3 failed once on the H200 at 2.2e-3, a 16-row segment whose fp32
// results straddled bf16 rounding points). Tail rows and empty experts must be exactly 0.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "kernels/fp8.h"
#include "kernels/fp8_grouped_linear.h"
#include "kernels/grouped_linear.h"
#include "tests/support/checks.h"
#include "tests/support/fp8_operands.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

using Rows = std::vector<int64_t>;
int64_t sum_rows(const Rows& r) { return std::accumulate(r.begin(), r.end(), int64_t(0)); }

// ---- naive references (double) -----------------------------------------------------------------

double deq(uint8_t q, float s) { return double(e4m3_to_f32(q)) * double(s); }

// y [m_total, n]: Σ_j x[r, j]·w[e][c, j] over the expert's rows; tail rows 0.
std::vector<double> naive_fprop(const Quantized& x, const Quantized& w, const Rows& rows, int64_t m_total, int64_t n,
                                int64_t k) {
  const int64_t kb = fp8_num_blocks(k), nb = fp8_num_blocks(n);
  std::vector<double> y(size_t(m_total * n), 0.0);
  int64_t off = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    for (int64_t r = off; r < off + rows[e]; ++r)
      for (int64_t c = 0; c < n; ++c) {
        double acc = 0;
        for (int64_t j = 0; j < k; ++j) {
          size_t wi = size_t((int64_t(e) * n + c) * k + j);
          acc += deq(x.q[size_t(r * k + j)], x.s[size_t(r * kb + j / 128)]) *
                 deq(w.q[wi], w.s[size_t((int64_t(e) * nb + c / 128) * kb + j / 128)]);
        }
        y[size_t(r * n + c)] = acc;
      }
    off += rows[e];
  }
  return y;
}

// Colwise operand back to [m_total, cols] in double (tail rows 0).
std::vector<double> deq_colwise(const Quantized& t, const Rows& rows, int64_t m_total, int64_t cols) {
  std::vector<double> v(size_t(m_total * cols), 0.0);
  int64_t off = 0, blk = 0;
  for (int64_t r : rows) {
    for (int64_t i = 0; i < r; ++i)
      for (int64_t c = 0; c < cols; ++c)
        v[size_t((off + i) * cols + c)] =
            deq(t.q[size_t(c * m_total + off + i)], t.s[size_t((blk + i / 128) * cols + c)]);
    off += r;
    blk += fp8_num_blocks(r);
  }
  return v;
}

// dw [E, n, k] = (dw0 when accumulating) + Σ_r dy[r, a]·x[r, b] over each expert's rows.
std::vector<double> naive_wgrad(const Quantized& dy_t, const Quantized& x_t, const Rows& rows, int64_t m_total,
                                int64_t n, int64_t k, const std::vector<float>* dw0) {
  std::vector<double> dy = deq_colwise(dy_t, rows, m_total, n), x = deq_colwise(x_t, rows, m_total, k);
  std::vector<double> dw(rows.size() * size_t(n * k), 0.0);
  if (dw0) std::copy(dw0->begin(), dw0->end(), dw.begin());
  int64_t off = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    for (int64_t a = 0; a < n; ++a)
      for (int64_t b = 0; b < k; ++b) {
        double acc = 0;
        for (int64_t r = off; r < off + rows[e]; ++r) acc += dy[size_t(r * n + a)] * x[size_t(r * k + b)];
        dw[(e * size_t(n) + size_t(a)) * size_t(k) + size_t(b)] += acc;
      }
    off += rows[e];
  }
  return dw;
}

// ---- runners -----------------------------------------------------------------------------------

template <class T>
Tensor host_tensor(const std::vector<T>& v, DType dtype) {
  Tensor t = Tensor::empty({int64_t(v.size())}, dtype);
  if (!v.empty()) std::memcpy(t.raw_data(), v.data(), v.size() * sizeof(T));
  return t;
}

struct Problem {
  Rows rows;
  int64_t m_total, n, k;
  Quantized x, w;          // fprop operands
  Quantized dy_t, x_t;     // wgrad operands
  std::vector<float> dw0;  // accumulate's starting dw
};

Problem make_problem(std::mt19937_64& gen, Rows rows, int64_t m_total, int64_t n, int64_t k) {
  Problem p{rows, m_total, n, k, {}, {}, {}, {}, {}};
  const int64_t E = int64_t(rows.size()), live = sum_rows(rows);
  p.x = quantize_rowwise(make_values(gen, m_total, k, live), m_total, k);
  p.w = quantize_blocks(make_values(gen, E * n, k, E * n), E, n, k);
  p.dy_t = quantize_colwise(make_values(gen, m_total, n, live), rows, m_total, n);
  p.x_t = quantize_colwise(make_values(gen, m_total, k, live), rows, m_total, k);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  p.dw0.resize(size_t(E * n * k));
  for (auto& v : p.dw0) v = u(gen);
  return p;
}

Tensor fprop_cpu(const Problem& p, DType out) {
  Tensor y = Tensor::full({p.m_total, p.n}, std::numeric_limits<double>::quiet_NaN(), out);
  fp8_grouped_gemm_cpu(out, p.x.q.data(), p.x.s.data(), p.w.q.data(), p.w.s.data(), y.raw_data(), p.rows.data(),
                       int64_t(p.rows.size()), p.m_total, p.n, p.k);
  return y;
}
Tensor wgrad_cpu(const Problem& p, bool accumulate) {
  const int64_t E = int64_t(p.rows.size());
  Tensor dw = accumulate ? host_tensor(p.dw0, DType::f32).view({E, p.n, p.k})
                         : Tensor::full({E, p.n, p.k}, std::numeric_limits<double>::quiet_NaN(), DType::f32);
  fp8_grouped_wgrad_cpu(p.dy_t.q.data(), p.dy_t.s.data(), p.x_t.q.data(), p.x_t.s.data(), dw.data<float>(),
                        p.rows.data(), E, p.m_total, p.n, p.k, accumulate);
  return dw;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

// Rows [off, off + r) of a [m, cols] tensor.
Tensor rows_of(const Tensor& t, int64_t off, int64_t r) { return t.slice(0, off, off + r); }

void expect_zero(const Tensor& t, const char* what) {
  for (double v : t.to_doubles())
    if (v != 0.0 || std::signbit(v)) {
      ADD_FAILURE() << what << " must be exactly +0, found " << v;
      return;
    }
}

}  // namespace

// ---- CPU reference -----------------------------------------------------------------------------

TEST(Fp8GroupedLinearCpu, FpropMatchesNaive) {
  std::mt19937_64 gen(test_seed());
  struct Case {
    Rows rows;
    int64_t m_total, n, k;
  };
  for (const Case& c : {Case{{0, 16, 48, 160}, 256, 128, 256}, Case{{16, 0, 160, 48}, 240, 256, 128},
                        Case{{144}, 160, 128, 384}, Case{{0, 0}, 32, 128, 128}, Case{{0, 0}, 0, 128, 128},
                        Case{{5, 0, 37}, 50, 72, 200}}) {  // the reference also takes partial blocks
    SCOPED_TRACE(::testing::Message() << "rows " << ::testing::PrintToString(c.rows) << " M_total " << c.m_total
                                      << " N " << c.n << " K " << c.k);
    Problem p = make_problem(gen, c.rows, c.m_total, c.n, c.k);
    std::vector<double> ref = naive_fprop(p.x, p.w, p.rows, c.m_total, c.n, c.k);
    Tensor ref_t = Tensor::from_doubles(ref, {c.m_total, c.n});
    const double atol = 1e-5 * max_abs(ref);
    Tensor y32 = fprop_cpu(p, DType::f32), y16 = fprop_cpu(p, DType::bf16);
    EXPECT_TRUE(all_close(y32, ref_t, 1e-5, atol)) << "f32 output";
    EXPECT_TRUE(all_close(y16, ref_t.to(DType::bf16), 8e-3, atol)) << "bf16 output";
    const int64_t total = sum_rows(c.rows);
    expect_zero(rows_of(y32, total, c.m_total - total), "f32 tail rows");
    expect_zero(rows_of(y16, total, c.m_total - total), "bf16 tail rows");
  }
}

TEST(Fp8GroupedLinearCpu, WgradMatchesNaive) {
  std::mt19937_64 gen(test_seed());
  struct Case {
    Rows rows;
    int64_t m_total, n, k;
  };
  for (const Case& c : {Case{{0, 16, 48, 160}, 256, 128, 256}, Case{{144, 0}, 160, 256, 128},
                        Case{{0, 0}, 32, 128, 128}, Case{{5, 0, 37}, 50, 72, 200}}) {
    for (bool acc : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "rows " << ::testing::PrintToString(c.rows) << " N " << c.n << " K " << c.k
                                        << " accumulate " << acc);
      Problem p = make_problem(gen, c.rows, c.m_total, c.n, c.k);
      std::vector<double> ref = naive_wgrad(p.dy_t, p.x_t, p.rows, c.m_total, c.n, c.k, acc ? &p.dw0 : nullptr);
      Tensor got = wgrad_cpu(p, acc);
      EXPECT_TRUE(all_close(got, Tensor::from_doubles(ref, got.shape()), 1e-5, 1e-5 * max_abs(ref)));
      for (size_t e = 0; e < c.rows.size(); ++e)  // an empty expert: exactly 0, or exactly its old dw
        if (c.rows[e] == 0) {
          Tensor de = got.slice(0, int64_t(e), int64_t(e) + 1);
          if (acc)
            EXPECT_TRUE(
                bit_equal(de, host_tensor(p.dw0, DType::f32).view(got.shape()).slice(0, int64_t(e), int64_t(e) + 1)));
          else
            expect_zero(de, "dw of an empty expert");
        }
    }
  }
}

// A NaN code in x (or a NaN scale_inv, which a non-finite amax produces) makes its output row NaN.
TEST(Fp8GroupedLinearCpu, NanPropagates) {
  std::mt19937_64 gen(test_seed());
  Problem p = make_problem(gen, {32, 16}, 48, 128, 256);
  p.x.q[size_t(3 * 256 + 200)] = 0x7F;        // row 3 (expert 0), second block
  p.x.s[size_t(40 * 2 + 0)] = std::nanf("");  // row 40 (expert 1), first block
  Tensor y = fprop_cpu(p, DType::f32);
  std::vector<double> v = y.to_doubles();
  for (int64_t r = 0; r < 48; ++r)
    for (int64_t c = 0; c < 128; c += 37)
      EXPECT_EQ(std::isnan(v[size_t(r * 128 + c)]), r == 3 || r == 40) << "row " << r << " col " << c;
}

TEST(Fp8GroupedLinearCpu, Errors) {
  std::vector<uint8_t> q(64 * 128, 0);
  std::vector<float> s(64 * 128, 1.f), y(64 * 128);
  Rows neg{16, -16}, over{48, 32}, ok{16, 16};
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        fp8_grouped_gemm_cpu(DType::f32, q.data(), s.data(), q.data(), s.data(), y.data(), neg.data(), 2, 64, 128, 128);
      },
      {"expert 1", "-16"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        fp8_grouped_gemm_cpu(DType::f32, q.data(), s.data(), q.data(), s.data(), y.data(), over.data(), 2, 64, 128,
                             128);
      },
      {"80", "64"}));
  EXPECT_TRUE(throws_naming<DTypeError>(
      [&] {
        fp8_grouped_gemm_cpu(DType::f64, q.data(), s.data(), q.data(), s.data(), y.data(), ok.data(), 2, 64, 128, 128);
      },
      {"f64"}));
  EXPECT_TRUE(throws_naming<ShapeError>(
      [&] {
        fp8_grouped_wgrad_cpu(q.data(), s.data(), q.data(), s.data(), y.data(), over.data(), 2, 64, 32, 32, false);
      },
      {"80", "64"}));
  // x scales (256·3, rounded up to 64 floats) + 2 experts · (512/128 = 4) rows of round_up(3, 4) weight scales.
  EXPECT_EQ(fp8_grouped_gemm_workspace_bytes(256, 384, 2, 512), size_t((768 + 2 * 4 * 4) * 4));
  EXPECT_EQ(fp8_grouped_gemm_workspace_bytes(0, 384, 0, 128), size_t(0));
}

// ---- CUDA --------------------------------------------------------------------------------------

namespace {

Tensor dev(const Tensor& t) { return t.to(Device::cuda()); }

Tensor fprop_cuda(const Problem& p, DType out) {
  Tensor x = dev(host_tensor(p.x.q, DType::e4m3)), xs = dev(host_tensor(p.x.s, DType::f32));
  Tensor w = dev(host_tensor(p.w.q, DType::e4m3)), ws = dev(host_tensor(p.w.s, DType::f32));
  Tensor y = Tensor::full({p.m_total, p.n}, std::numeric_limits<double>::quiet_NaN(), out, Device::cuda());
  Tensor work = Tensor::empty({int64_t(fp8_grouped_gemm_workspace_bytes(p.m_total, p.k, int64_t(p.rows.size()), p.n))},
                              DType::u8, Device::cuda());
  fp8_grouped_gemm_cuda(out, x.data<uint8_t>(), xs.data<float>(), w.data<uint8_t>(), ws.data<float>(), y.raw_data(),
                        p.rows.data(), int64_t(p.rows.size()), p.m_total, p.n, p.k, work.raw_data(), current_stream(0));
  return y.to(Device::cpu());
}

Tensor wgrad_cuda(const Problem& p, bool accumulate) {
  const int64_t E = int64_t(p.rows.size());
  Tensor dy = dev(host_tensor(p.dy_t.q, DType::e4m3)), dys = dev(host_tensor(p.dy_t.s, DType::f32));
  Tensor x = dev(host_tensor(p.x_t.q, DType::e4m3)), xs = dev(host_tensor(p.x_t.s, DType::f32));
  Tensor dw = accumulate
                  ? dev(host_tensor(p.dw0, DType::f32))
                  : Tensor::full({E * p.n * p.k}, std::numeric_limits<double>::quiet_NaN(), DType::f32, Device::cuda());
  fp8_grouped_wgrad_cuda(dy.data<uint8_t>(), dys.data<float>(), x.data<uint8_t>(), xs.data<float>(), dw.data<float>(),
                         p.rows.data(), E, p.m_total, p.n, p.k, accumulate, current_stream(0));
  return dw.to(Device::cpu()).view({E, p.n, p.k});
}

// Per expert segment (so one wrong expert cannot hide in a norm); `rel_f32` checks f32 outputs.
void expect_segments_close(const Tensor& got, const Tensor& ref, const Rows& rows, bool is_f32, bool by_expert) {
  int64_t off = 0;
  for (size_t e = 0; e < rows.size(); ++e) {
    const int64_t r = rows[e], ei = int64_t(e);
    SCOPED_TRACE(::testing::Message() << "expert " << e << " (" << r << " rows at " << off << ")");
    if (r > 0 || by_expert) {
      Tensor g = by_expert ? got.slice(0, ei, ei + 1) : rows_of(got, off, r);
      Tensor w = by_expert ? ref.slice(0, ei, ei + 1) : rows_of(ref, off, r);
      if (is_f32) {
        EXPECT_LE(rel_error(g, w), 5e-4);
        EXPECT_TRUE(all_close(g, w, 1e-3, 2e-3 * max_abs(w.to_doubles())));
      } else {  // the f32 bound plus a bf16 rounding (relative 2^-9) of each side
        EXPECT_LE(rel_error(g, w), 5e-4 + 2 * std::ldexp(1.0, -9));
      }
    }
    off += r;
  }
}

struct CudaCase {
  Rows rows;
  int64_t m_total, n, k;
};

void check_fprop(std::mt19937_64& gen, const CudaCase& c) {
  SCOPED_TRACE(::testing::Message() << "rows " << ::testing::PrintToString(c.rows) << " M_total " << c.m_total << " N "
                                    << c.n << " K " << c.k);
  Problem p = make_problem(gen, c.rows, c.m_total, c.n, c.k);
  const int64_t total = sum_rows(c.rows);
  for (DType out : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(out));
    Tensor got = fprop_cuda(p, out), ref = fprop_cpu(p, out);
    ASSERT_EQ(got.dtype(), out);
    expect_segments_close(got, ref, c.rows, out == DType::f32, false);
    expect_zero(rows_of(got, total, c.m_total - total), "tail rows");
  }
}

void check_wgrad(std::mt19937_64& gen, const CudaCase& c) {
  for (bool acc : {false, true}) {
    SCOPED_TRACE(::testing::Message() << "rows " << ::testing::PrintToString(c.rows) << " M_total " << c.m_total
                                      << " N " << c.n << " K " << c.k << " accumulate " << acc);
    Problem p = make_problem(gen, c.rows, c.m_total, c.n, c.k);
    Tensor got = wgrad_cuda(p, acc), ref = wgrad_cpu(p, acc);
    expect_segments_close(got, ref, c.rows, true, true);
    for (size_t e = 0; e < c.rows.size(); ++e)
      if (c.rows[e] == 0) {  // exactly 0, or exactly the old dw
        Tensor ge = got.slice(0, int64_t(e), int64_t(e) + 1);
        if (acc)
          EXPECT_TRUE(bit_equal(ge, ref.slice(0, int64_t(e), int64_t(e) + 1)));
        else
          expect_zero(ge, "dw of an empty expert");
      }
  }
}

}  // namespace

// What cuBLASLt's block-scaled GEMM accepts as one expert's row count (the VEC128 operand's outer
// size): printed as a table, so docs/PERF.md and the recipes' alignment rule rest on a measurement.
TEST(Fp8GroupedLinearCuda, RowCountSupportProbe) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  struct Dims {
    int64_t n, k;
    DType out;
  };
  for (Dims d : {Dims{256, 256, DType::f32}, Dims{384, 512, DType::bf16}, Dims{256, 512, DType::f32},
                 Dims{384, 256, DType::f32}, Dims{256, 256, DType::bf16}})
    for (int64_t r : {16, 32, 48, 128, 208, 256, 1024}) {
      Problem p = make_problem(gen, {r}, r, d.n, d.k);
      std::string verdict;
      try {
        Tensor got = fprop_cuda(p, d.out), ref = fprop_cpu(p, d.out);
        double err = rel_error(got, ref);
        verdict = err <= 2e-3 ? "ok" : "WRONG (rel error " + std::to_string(err) + ")";
      } catch (const CudaError& e) {
        verdict = std::string("refused: ") + e.what();
      }
      std::printf("[fp8 row-count probe] N %lld K %lld %s rows %5lld: %s\n", (long long)d.n, (long long)d.k,
                  dtype_name(d.out), (long long)r, verdict.substr(0, 60).c_str());
    }
}

// Which scale layouts cuBLASLt reads (printed): the activation's VEC128 scales as [K/128][rows] or
// [rows][K/128], the weight's 128x128 scales as [N/128][K/128] or [K/128][N/128]. Dimensions differ so
// a transposed read cannot pass by accident.
TEST(Fp8GroupedLinearCuda, ScaleLayoutProbe) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  const int64_t rows = 256, n = 384, k = 512, kb = k / 128, nb = n / 128;
  Problem p = make_problem(gen, {rows}, rows, n, k);
  Tensor ref = fprop_cpu(p, DType::f32);
  for (bool b_rows_major : {false, true})
    for (bool a_transposed : {false, true}) {
      Problem q = p;
      if (b_rows_major) {  // feed the launcher's [rows][kb] -> [kb][rows] re-layout so it produces [rows][kb]
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t b = 0; b < kb; ++b) {
            const int64_t L = b * rows + r, rr = L / kb, bb = L % kb;
            q.x.s[size_t(r * kb + b)] = p.x.s[size_t(rr * kb + bb)];
          }
      }
      if (a_transposed)
        for (int64_t i = 0; i < nb; ++i)
          for (int64_t j = 0; j < kb; ++j) q.w.s[size_t(j * nb + i)] = p.w.s[size_t(i * kb + j)];
      Tensor got = fprop_cuda(q, DType::f32);
      std::printf("[fp8 scale-layout probe] B %s, A %s: rel error %.3g\n",
                  b_rows_major ? "[rows][K/128]" : "[K/128][rows]", a_transposed ? "[K/128][N/128]" : "[N/128][K/128]",
                  rel_error(got, ref));
    }
}

// Spreading the expert GEMMs over side streams (set_grouped_linear_streams) changes no bit.
TEST(Fp8GroupedLinearCuda, SideStreamsGiveIdenticalResults) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  Problem p = make_problem(gen, {128, 0, 256, 512, 128, 384}, 1408, 256, 512);
  const int saved = grouped_linear_streams();
  set_grouped_linear_streams(1);
  Tensor y1 = fprop_cuda(p, DType::bf16), w1 = wgrad_cuda(p, false);
  set_grouped_linear_streams(4);
  Tensor y4 = fprop_cuda(p, DType::bf16), w4 = wgrad_cuda(p, false);
  set_grouped_linear_streams(saved);
  EXPECT_TRUE(bit_equal(y4, y1));
  EXPECT_TRUE(bit_equal(w4, w1));
}

TEST(Fp8GroupedLinearCuda, FpropMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  for (const CudaCase& c : {CudaCase{{0, 16, 48, 160}, 256, 128, 256},  // empty expert, short segments, tail
                            CudaCase{{16, 0, 160, 48}, 256, 256, 384},  // k/128 = 3 (weight scale rows not 4-aligned)
                            CudaCase{{0, 0, 512, 0}, 512, 128, 128},    // one hot expert
                            CudaCase{{144}, 160, 256, 256},             // E = 1
                            CudaCase{{0, 0}, 32, 128, 128},             // zero total rows: all tail
                            CudaCase{{0, 0}, 0, 128, 128},              // no rows at all
                            CudaCase{{64, 32, 16, 0, 128, 48, 256, 80}, 640, 256, 1408},  // fc2-like K (11 blocks)
                            CudaCase{{512, 256, 1024, 256}, 2048, 512, 1024}}) {
    check_fprop(gen, c);
  }
}

// dgrad is the fprop call on dy [m_total, n] and w_t [E, k, n]: only the roles of n and k swap.
TEST(Fp8GroupedLinearCuda, DgradShapesMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  check_fprop(gen, CudaCase{{48, 0, 208}, 272, 1408, 256});
}

// Segments that are multiples of 128: every 1x128 block along the reduction dim is full.
TEST(Fp8GroupedLinearCuda, WgradFullBlocksMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  for (const CudaCase& c : {CudaCase{{128, 0, 256}, 400, 128, 256}, CudaCase{{0, 512, 0}, 512, 256, 128},
                            CudaCase{{0, 0}, 32, 128, 128}, CudaCase{{1024, 128}, 1152, 256, 1408}}) {
    check_wgrad(gen, c);
  }
}

// Segments of 16, 48, 144 rows: the last 1x128 block of each is partial. If cuBLASLt refuses VEC128 with
// such an inner dim this fails with a CudaError saying so (the integrator then pads to 128).
TEST(Fp8GroupedLinearCuda, WgradPartialBlocksMatchCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  for (const CudaCase& c : {CudaCase{{0, 16, 48, 144}, 240, 128, 256}, CudaCase{{144}, 160, 256, 128},
                            CudaCase{{16, 400, 0, 96}, 528, 128, 384}}) {
    try {
      check_wgrad(gen, c);
    } catch (const CudaError& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

TEST(Fp8GroupedLinearCuda, NanPropagates) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  Problem p = make_problem(gen, {32, 16}, 48, 128, 256);
  p.x.q[size_t(3 * 256 + 200)] = 0x7F;
  p.x.s[size_t(40 * 2 + 0)] = std::nanf("");
  std::vector<double> v = fprop_cuda(p, DType::f32).to_doubles();
  for (int64_t r = 0; r < 48; ++r)
    for (int64_t c = 0; c < 128; c += 37)
      EXPECT_EQ(std::isnan(v[size_t(r * 128 + c)]), r == 3 || r == 40) << "row " << r << " col " << c;
}

// The launchers check their arguments before touching the device (so these run without a GPU too,
// in a CUDA build).
TEST(Fp8GroupedLinearCuda, ShapeErrors) {
  if (!built_with_cuda()) GTEST_SKIP() << "built without CUDA: the launchers only throw";
  Rows ok{16, 32}, odd{16, 24};
  auto fprop = [](const Rows& rows, int64_t m_total, int64_t n, int64_t k, DType out = DType::bf16) {
    fp8_grouped_gemm_cuda(out, nullptr, nullptr, nullptr, nullptr, nullptr, rows.data(), int64_t(rows.size()), m_total,
                          n, k, nullptr, nullptr);
  };
  auto wgrad = [](const Rows& rows, int64_t m_total, int64_t n, int64_t k) {
    fp8_grouped_wgrad_cuda(nullptr, nullptr, nullptr, nullptr, nullptr, rows.data(), int64_t(rows.size()), m_total, n,
                           k, false, nullptr);
  };
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fprop(ok, 64, 100, 128); }, {"N=100", "128"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fprop(ok, 64, 128, 200); }, {"K=200"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fprop(odd, 48, 128, 128); }, {"expert 1", "24 rows"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fprop(ok, 56, 128, 128); }, {"M_total=56"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { fprop(ok, 32, 128, 128); }, {"48", "32"}));
  EXPECT_TRUE(throws_naming<DTypeError>([&] { fprop(ok, 64, 128, 128, DType::e4m3); }, {"e4m3"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { wgrad(odd, 48, 128, 128); }, {"expert 1", "24 rows"}));
  EXPECT_TRUE(throws_naming<ShapeError>([&] { wgrad(ok, 64, 256, 72); }, {"K=72"}));
}
