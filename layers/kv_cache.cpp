// The cached attention step both attentions share (layers/kv_cache.h).
#include "layers/kv_cache.h"

#include <cmath>
#include <vector>

#include "engine/ops/ops.h"

namespace flowmoe {

namespace {

// Writes x [1, T, nh, d] into cache [nh, capacity, d] at positions [pos, pos + T), head by head.
void write_positions(const Tensor& cache, const Tensor& x, int64_t pos) {
  const int64_t nh = cache.size(0), capacity = cache.size(1), d = cache.size(2), t = x.size(1);
  const Tensor rows = cache.view({nh * capacity, d});
  const Tensor heads = x.reshape({t, nh, d});
  for (int64_t h = 0; h < nh; ++h)
    rows.slice(0, h * capacity + pos, h * capacity + pos + t).copy_(heads.slice(1, h, h + 1).reshape({t, d}));
}

// One query q [1, 1, nh, qk] against the cache's first n positions: per head softmax(q·Kᵀ/sqrt(qk))·V.
Variable attend_cached(const Variable& q, const Tensor& keys, const Tensor& values, int64_t n) {
  const int64_t nh = keys.size(0), capacity = keys.size(1), qk = keys.size(2), vd = values.size(2);
  const Tensor q_heads = q.data().reshape({nh, qk});
  const Tensor k_rows = keys.view({nh * capacity, qk}), v_rows = values.view({nh * capacity, vd});
  std::vector<Variable> heads;
  for (int64_t h = 0; h < nh; ++h) {
    const Variable k(k_rows.slice(0, h * capacity, h * capacity + n)),
        v(v_rows.slice(0, h * capacity, h * capacity + n));
    const Variable scores = scale(linear(Variable(q_heads.slice(0, h, h + 1)), k), 1.0 / std::sqrt(double(qk)));
    heads.push_back(matmul(softmax(scores), v));  // [1, vd]
  }
  return reshape(concat_rows(heads), {1, 1, nh, vd});
}

}  // namespace

Variable attend_with_cache(const Variable& q, const Variable& k, const Variable& v, const Tensor& keys,
                           const Tensor& values, int64_t pos, AttentionBackend backend, const char* what) {
  const int64_t t = q.size(1), nh = q.size(2), qk = q.size(3), vd = v.size(3);
  FLOWMOE_CHECK(keys.dim() == 3 && keys.size(0) == nh && keys.size(2) == qk && values.dim() == 3 &&
                    values.size(0) == nh && values.size(1) == keys.size(1) && values.size(2) == vd,
                ShapeError, what, ": K/V cache ", keys.describe(), " / ", values.describe(), ", expected [", nh,
                ", capacity, ", qk, "] / [", nh, ", capacity, ", vd, "]");
  FLOWMOE_CHECK(pos + t <= keys.size(1), ShapeError, what, ": positions [", pos, ", ", pos + t,
                ") exceed the K/V cache's ", keys.size(1));
  FLOWMOE_CHECK(pos == 0 || t == 1, ShapeError, what, ": a cached forward takes the prompt at position 0 or one",
                " token after it, got ", t, " tokens at position ", pos);
  write_positions(keys, k.data(), pos);
  write_positions(values, v.data(), pos);
  return pos == 0 ? causal_attention(q, k, v, backend) : attend_cached(q, keys, values, pos + 1);
}

}  // namespace flowmoe
