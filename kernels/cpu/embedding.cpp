// CPU reference for the embedding lookup and its scatter-add backward (see kernels/embedding.h).
#include "kernels/embedding.h"

#include "kernels/common/error.h"

namespace flowmoe {

static void check_id(int32_t id, int64_t pos, int64_t vocab, const char* what) {
  FLOWMOE_CHECK(id >= 0 && id < vocab, Error, what, ": id ", id, " at position ", pos, " is outside [0, ", vocab, ")");
}

template <class T>
void embedding_forward_cpu(T* out, const T* weight, const int32_t* ids, int64_t num_ids, int64_t vocab,
                           int64_t hidden) {
  for (int64_t i = 0; i < num_ids; ++i) {
    check_id(ids[i], i, vocab, "embedding");
    const T* row = weight + int64_t(ids[i]) * hidden;
    for (int64_t j = 0; j < hidden; ++j) out[i * hidden + j] = row[j];
  }
}

template <class T>
void embedding_backward_cpu(T* d_weight, const T* d_out, const int32_t* ids, int64_t num_ids, int64_t vocab,
                            int64_t hidden) {
  for (int64_t k = 0; k < vocab * hidden; ++k) d_weight[k] = T(0);
  for (int64_t i = 0; i < num_ids; ++i) {
    check_id(ids[i], i, vocab, "embedding_backward");
    T* row = d_weight + int64_t(ids[i]) * hidden;
    for (int64_t j = 0; j < hidden; ++j) row[j] += d_out[i * hidden + j];
  }
}

template void embedding_forward_cpu<float>(float*, const float*, const int32_t*, int64_t, int64_t, int64_t);
template void embedding_forward_cpu<double>(double*, const double*, const int32_t*, int64_t, int64_t, int64_t);
template void embedding_backward_cpu<float>(float*, const float*, const int32_t*, int64_t, int64_t, int64_t);
template void embedding_backward_cpu<double>(double*, const double*, const int32_t*, int64_t, int64_t, int64_t);

}  // namespace flowmoe
