// CPU reference for unpermute + unpad with merging probs and its backward (see kernels/unpermute.h).
#include "kernels/unpermute.h"

#include <algorithm>
#include <cmath>

namespace flowmoe {

template <class T>
void unpermute_cpu(const int32_t* row_map, int64_t num_tokens, int top_k, int64_t hidden, const T* rows,
                   const T* topk_prob, T* y) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    T* out = y + t * hidden;
    std::fill(out, out + hidden, T(0));
    for (int j = 0; j < top_k; ++j) {
      const int32_t r = row_map[t * top_k + j];
      if (r < 0) continue;
      const T p = topk_prob ? topk_prob[t * top_k + j] : T(1);
      const T* src = rows + int64_t(r) * hidden;
      for (int64_t h = 0; h < hidden; ++h) out[h] = std::fma(p, src[h], out[h]);  // the GPU's fmaf
    }
  }
}

template <class T>
void unpermute_backward_cpu(const int32_t* row_map, int64_t num_tokens, int top_k, int64_t hidden, int64_t num_rows,
                            const T* rows, const T* topk_prob, const T* dy, T* d_rows, T* d_topk_prob) {
  if (d_rows) std::fill(d_rows, d_rows + num_rows * hidden, T(0));  // pad and tail rows get no gradient
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* g = dy + t * hidden;
    for (int j = 0; j < top_k; ++j) {
      const int64_t i = t * top_k + j;
      const int32_t r = row_map[i];
      if (r < 0) {
        if (d_topk_prob) d_topk_prob[i] = T(0);
        continue;
      }
      const T p = topk_prob ? topk_prob[i] : T(1);
      if (d_rows)
        for (int64_t h = 0; h < hidden; ++h) d_rows[int64_t(r) * hidden + h] = p * g[h];
      if (d_topk_prob) {
        T dot = 0;
        for (int64_t h = 0; h < hidden; ++h) dot += rows[int64_t(r) * hidden + h] * g[h];
        d_topk_prob[i] = dot;
      }
    }
  }
}

template void unpermute_cpu<float>(const int32_t*, int64_t, int, int64_t, const float*, const float*, float*);
template void unpermute_cpu<double>(const int32_t*, int64_t, int, int64_t, const double*, const double*, double*);
template void unpermute_backward_cpu<float>(const int32_t*, int64_t, int, int64_t, int64_t, const float*, const float*,
                                            const float*, float*, float*);
template void unpermute_backward_cpu<double>(const int32_t*, int64_t, int, int64_t, int64_t, const double*,
                                             const double*, const double*, double*, double*);

}  // namespace flowmoe
