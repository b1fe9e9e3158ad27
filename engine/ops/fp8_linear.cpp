// fp8_linear (engine/ops/fp8_linear.h): a dense linear as fp8_grouped_linear with one group.
#include "engine/ops/fp8_linear.h"

#include <utility>
#include <vector>

#include "engine/ops/fp8_grouped_linear.h"
#include "engine/ops/ops.h"
#include "kernels/fp8.h"

namespace flowmoe {

std::string fp8_width_error(int64_t n, const std::string& user, const std::string& gemms) {
  if (n % kFp8BlockSize == 0) return "";
  return std::to_string(n) + " is not a multiple of " + std::to_string(kFp8BlockSize) + ", which " + user +
         " needs: it runs " + gemms + " on FP8 blocks " + std::to_string(kFp8BlockSize) + " wide";
}

void check_fp8_linear_dims(int64_t out_features, int64_t in_features, const std::string& what) {
  for (const auto& [name, n] :
       {std::pair<const char*, int64_t>{"out_features", out_features}, {"in_features", in_features}}) {
    const std::string e = fp8_width_error(n, "an FP8 linear", "its GEMMs");
    FLOWMOE_CHECK(e.empty(), ShapeError, what, ": ", name, " ", e);
  }
}

QuantizedWeight quantize_linear_weight(const Tensor& w, const std::string& site, bool with_transpose) {
  FLOWMOE_CHECK(w.dim() == 2, ShapeError, "quantize_linear_weight at '", site, "': w must be [N, K], got ",
                w.describe());
  return quantize_weight(w.reshape({1, w.size(0), w.size(1)}), site, with_transpose);
}

Variable fp8_linear(const Variable& xq, const Variable& weight, const QuantizedWeight& wq, const std::string& site) {
  const Tensor &x = xq.data(), &w = weight.data();
  FLOWMOE_CHECK(w.dtype() == DType::f32 && w.dim() == 2, DTypeError, "fp8_linear at '", site,
                "': weight must be the f32 master [N, K], got ", w.describe());
  check_fp8_linear_dims(w.size(0), w.size(1), "fp8_linear at '" + site + "'");
  FLOWMOE_CHECK(x.dim() == 2 && x.size(1) == w.size(1), ShapeError, "fp8_linear at '", site, "': x ", x.describe(),
                " must be [M, ", w.size(1), "] for weight ", w.describe());
  // The wgrad operands are [K, M] and [N, M]: both backends hold to the GPU's row multiple, so a shape the CPU
  // runs, the GPU runs too.
  FLOWMOE_CHECK(x.size(0) % kFp8RowMultiple == 0, ShapeError, "fp8_linear at '", site, "': x ", x.describe(), " has ",
                x.size(0), " rows, not a multiple of ", kFp8RowMultiple,
                " (the FP8 GEMMs' leading dimension; data.seq_len sets it in training)");
  // One group of all M rows: the weight's gradient comes back [1, N, K] and the reshape returns it to [N, K].
  const Variable grouped = reshape(weight, {1, w.size(0), w.size(1)});
  return fp8_grouped_linear(xq, grouped, wq, std::vector<int64_t>{x.size(0)}, Fp8Wgrad::transpose, site);
}

}  // namespace flowmoe
