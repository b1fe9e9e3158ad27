// Where FP8 error enters the expert GEMMs, on a trained model's own activations and gradients (`flowmoe fp8-error`,
// docs/PARITY.md). Each expert GEMM y[e] = x[e]·W[e]ᵀ runs three products: fprop and dgrad (dx[e] = dy[e]·W[e])
// take x and dy rowwise 1x128 and W in 128x128 blocks, as every FP8 recipe does, and are measured once each. The
// wgrad dW[e] = dy[e]ᵀ·x[e] needs both operands 1x128-blocked along the tokens (colwise); three ways to get
// colwise FP8 operands from the high-precision x and dy, each compared with the f64 product:
//   transpose   rowwise quantize, then the scaling-aware transpose (fp8_flow; kernels/fp8_transpose.h)
//   requantize  rowwise quantize, dequantize, colwise quantize ("double quantization", fp8_blockwise)
//   colwise     one colwise quantize of the high-precision operand (a floor neither recipe reaches: the rowwise
//               copy is what the forward and the dgrad need)
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config/config.h"
#include "engine/tensor.h"

namespace flowmoe {

// Squared sums of one expert GEMM over one or more calls; the errors are their ratios.
struct GemmErrorSums {
  int64_t rows = 0;                                            // routed rows (pad rows included), over the calls
  double x_amax = 0, dy_amax = 0;                              // the largest |x| and |dy|
  double x_sq = 0, x_err_sq = 0;                               // ||x||², ||rowwise FP8 x - x||²
  double dy_sq = 0, dy_err_sq = 0;                             // the same for dy
  double fprop_ref_sq = 0, fprop_sq = 0;                       // ||y_ref||², ||y_fp8 - y_ref||²
  double dgrad_ref_sq = 0, dgrad_sq = 0;                       // the same for dx
  double ref_sq = 0;                                           // ||dW_ref||²
  double transpose_sq = 0, requantize_sq = 0, colwise_sq = 0;  // ||dW_path - dW_ref||²

  void add(const GemmErrorSums& o);
};

// The sums of one call: x [M,K] and dy [M,N] f32 on the CPU, segments the rows per expert (padded
// counts; rows past their sum are left out), w [E,N,K] the weight (any device and float dtype).
// Experts are spread over `num_threads` threads (0: all cores).
GemmErrorSums gemm_error_sums(const Tensor& x, const Tensor& dy, const Tensor& w, const std::vector<int64_t>& segments,
                              int num_threads = 0);

// One expert GEMM's row of the study.
struct GemmErrorRow {
  std::string weight;  // "model.layers.3.mlp.experts.fc1.weight"; "all" for the pooled row
  GemmErrorSums sums;
  double x_rel_err() const;  // ||q(x) - x|| / ||x||, rowwise 1x128
  double dy_rel_err() const;
  double fprop() const;  // ||y_fp8 - y_ref|| / ||y_ref||
  double dgrad() const;
  double transpose() const;  // ||dW_transpose - dW_ref|| / ||dW_ref||
  double requantize() const;
  double colwise() const;
  double ratio() const;  // requantize / transpose
};

struct Fp8ErrorStudy {
  std::string checkpoint;
  int64_t step = 0;  // the checkpoint's
  int64_t num_batches = 0, num_tokens = 0;
  std::string split;               // "validation" or "training"
  std::vector<GemmErrorRow> rows;  // layer order, fc1 before fc2
  GemmErrorRow pooled;             // every row's sums added
  // The batches' mean LM loss through the same weights in each recipe (bf16, fp8_blockwise, fp8_flow, and fp8_full
  // where the config takes it): how much of a loss gap
  // between two runs the arithmetic of one step makes, apart from their weights having drifted apart.
  std::vector<std::pair<std::string, double>> recipe_losses;
};

// Runs num_batches batches of the config's data (its validation split, else its first training
// windows; with train_step N > 0, the micro-batches the run trained on at step N) forward and backward
// in bf16 through the weights of `checkpoint`, one process, and measures every expert GEMM; then the
// same batches' loss in each FP8 recipe its shapes take (fp8_full's only where its dense widths and data.seq_len
// suit FP8 GEMMs). Throws ConfigError for a model without routed experts.
// The bf16 recipe keeps the operands unquantized, so the f64 reference has no FP8 error in it. (It applies the
// routing probs at combine, so fc2's dy carries them where fp8_flow's fc2 input does; fc1's operands are the same
// in both.)
Fp8ErrorStudy fp8_error_study(Config cfg, const std::string& checkpoint, int64_t num_batches, int64_t train_step = 0);

std::string fp8_error_json(const Fp8ErrorStudy& study);   // non-finite numbers as null
std::string fp8_error_table(const Fp8ErrorStudy& study);  // the printed table, one line per GEMM

}  // namespace flowmoe
