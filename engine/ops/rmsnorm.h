// RMSNorm's pieces that the fused RMSNorm + quantize (engine/ops/rmsnorm_quant.h) shares with rmsnorm
// (engine/ops/ops.h): the argument checks and the backward. Implementation: engine/ops/rmsnorm.cpp.
#pragma once
#include <vector>

#include "engine/tensor.h"

namespace flowmoe {

// x [..., H] and weight [H] agree in dtype and width, eps >= 0; returns H. Errors name `what`.
int64_t check_rmsnorm(const Tensor& x, const Tensor& weight, double eps, const char* what);

// {d_x, d_weight} of y = rmsnorm(x, weight, eps) from d_y (x's shape and dtype), on the inputs' device: the
// rmsnorm_backward primitive (rstd recomputed from x), not differentiable.
std::vector<Tensor> rmsnorm_backward(const Tensor& d_y, const Tensor& x, const Tensor& weight, double eps);

}  // namespace flowmoe
