// Checks of rowwise 1x128 FP8 outputs (data and scale_inv) for the tests of the ops that emit them
// (tests/test_swiglu_quant.cpp, tests/test_rmsnorm_quant.cpp): bit for bit, or within one e4m3 step where two
// backends' f32 arithmetic differs by an ulp before the quantize.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "engine/tensor.h"
#include "kernels/common/dtype.h"
#include "kernels/fp8.h"

namespace flowmoe::test {

struct Fp8Rows {
  std::vector<uint8_t> q;  // [M,K] e4m3
  std::vector<float> s;    // [M, ceil(K/128)]
};

// The bytes and scales of q [M,K] e4m3 and s [M, ceil(K/128)], on the host.
inline Fp8Rows fp8_of(const Tensor& q, const Tensor& s) {
  Tensor qc = q.to(Device::cpu()).contiguous();
  auto* p = static_cast<const uint8_t*>(qc.raw_data());
  return {std::vector<uint8_t>(p, p + qc.numel()), s.to(Device::cpu()).to_floats()};
}

// Every scale_inv and every byte equal; a failure names the first that differs.
inline ::testing::AssertionResult bytes_equal(const Fp8Rows& got, const Fp8Rows& ref, int64_t K) {
  if (got.q.size() != ref.q.size() || got.s.size() != ref.s.size())
    return ::testing::AssertionFailure() << "sizes " << got.q.size() << "/" << got.s.size() << " vs " << ref.q.size()
                                         << "/" << ref.s.size();
  const int64_t nb = fp8_num_blocks(K);
  for (size_t i = 0; i < got.s.size(); ++i)
    if (std::memcmp(&got.s[i], &ref.s[i], 4) != 0)
      return ::testing::AssertionFailure() << "scale_inv[" << int64_t(i) / nb << ", " << int64_t(i) % nb
                                           << "] = " << got.s[i] << ", want " << ref.s[i];
  for (size_t i = 0; i < got.q.size(); ++i)
    if (got.q[i] != ref.q[i])
      return ::testing::AssertionFailure() << "q[" << int64_t(i) / K << ", " << int64_t(i) % K << "] = 0x" << std::hex
                                           << int(got.q[i]) << ", want 0x" << int(ref.q[i]);
  return ::testing::AssertionSuccess();
}

// e4m3 codes as signed steps from zero (+0 and -0 both 0), so neighbours differ by one.
inline int e4m3_step(uint8_t c) { return (c & 0x80) ? -int(c & 0x7F) : int(c & 0x7F); }
inline bool e4m3_nan(uint8_t c) { return (c & 0x7F) == 0x7F; }

// GPU vs CPU end to end: scales equal and codes at most one e4m3 step apart for at most max_frac of the
// elements; or, in at most max(1, max_frac * blocks) blocks, scales a factor 2 apart with every value
// within one step of the coarser grid. NaN blocks must agree exactly.
inline ::testing::AssertionResult fp8_close(const Fp8Rows& got, const Fp8Rows& ref, int64_t K, double max_frac) {
  if (got.q.size() != ref.q.size() || got.s.size() != ref.s.size())
    return ::testing::AssertionFailure() << "sizes differ";
  const int64_t nb = fp8_num_blocks(K), M = K > 0 ? int64_t(got.q.size()) / K : 0;
  int64_t moved = 0, flipped = 0;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float sg = got.s[size_t(r * nb + b)], sr = ref.s[size_t(r * nb + b)];
      const bool same_scale = std::memcmp(&sg, &sr, 4) == 0;
      if (!same_scale && !(sg == 2 * sr || sr == 2 * sg))
        return ::testing::AssertionFailure() << "scale_inv[" << r << ", " << b << "] = " << sg << ", want " << sr;
      flipped += !same_scale;
      for (int64_t c = b * 128; c < std::min(K, b * 128 + 128); ++c) {
        const uint8_t qg = got.q[size_t(r * K + c)], qr = ref.q[size_t(r * K + c)];
        bool ok;
        if (e4m3_nan(qg) || e4m3_nan(qr)) {
          ok = qg == qr;
        } else if (same_scale) {
          ok = std::abs(e4m3_step(qg) - e4m3_step(qr)) <= 1;
          moved += qg != qr;
        } else {
          const double vg = double(e4m3_to_f32(qg)) * sg, vr = double(e4m3_to_f32(qr)) * sr;
          ok = std::fabs(vg - vr) <=
               std::ldexp(std::max(std::fabs(vg), std::fabs(vr)), -3) + std::ldexp(double(std::max(sg, sr)), -9);
        }
        if (!ok)
          return ::testing::AssertionFailure()
                 << "q[" << r << ", " << c << "] = 0x" << std::hex << int(qg) << ", want 0x" << int(qr) << std::dec
                 << " (scale_inv " << sg << " vs " << sr << ")";
      }
    }
  if (double(moved) > max_frac * double(got.q.size()) + 1)
    return ::testing::AssertionFailure() << moved << " of " << got.q.size() << " codes moved by one step";
  if (double(flipped) > std::max(1.0, max_frac * double(M * nb)))
    return ::testing::AssertionFailure() << flipped << " of " << M * nb << " block scales differ";
  return ::testing::AssertionSuccess();
}

}  // namespace flowmoe::test
