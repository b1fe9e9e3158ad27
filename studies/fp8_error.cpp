// The FP8 error study of the expert GEMMs (see fp8_error.h): the operands' FP8 versions through the
// CPU twins of the kernels (bit-identical to the GPU's), the per-expert products in f32 against f64.
#include "studies/fp8_error.h"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <map>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "dataset/data.h"
#include "engine/host_threads.h"
#include "engine/op_tensor_hook.h"
#include "io/file_io.h"
#include "kernels/common/error.h"
#include "kernels/fp8.h"
#include "kernels/fp8_transpose.h"
#include "kernels/linear.h"
#include "kernels/quantize.h"
#include "train/memory_estimate.h"
#include "train/run_setup.h"
#include "train/trainer.h"

namespace flowmoe {

void GemmErrorSums::add(const GemmErrorSums& o) {
  rows += o.rows;
  x_amax = std::max(x_amax, o.x_amax);
  dy_amax = std::max(dy_amax, o.dy_amax);
  x_sq += o.x_sq, x_err_sq += o.x_err_sq, dy_sq += o.dy_sq, dy_err_sq += o.dy_err_sq;
  fprop_ref_sq += o.fprop_ref_sq, fprop_sq += o.fprop_sq, dgrad_ref_sq += o.dgrad_ref_sq, dgrad_sq += o.dgrad_sq;
  ref_sq += o.ref_sq, transpose_sq += o.transpose_sq, requantize_sq += o.requantize_sq, colwise_sq += o.colwise_sq;
}

namespace {

double ratio_sqrt(double num, double den) { return den > 0 ? std::sqrt(num / den) : NAN; }

// One operand a [M,C], its rowwise FP8 version and its three colwise ones, dequantized back to f32 [M,C].
struct Operand {
  std::vector<float> rowwise, transpose, requantize, colwise;
  double amax = 0, sq = 0, rowwise_err_sq = 0;
};

Operand fp8_versions(const float* a, int64_t M, int64_t C, const std::vector<int64_t>& segments) {
  const int64_t E = int64_t(segments.size()), nb = fp8_num_blocks(C);
  const int64_t num_col_blocks = colwise_num_blocks(segments.data(), E);
  const size_t n = size_t(M * C);
  std::vector<uint8_t> q(n), q_t(n);
  std::vector<float> s(size_t(M * nb)), s_t(size_t(num_col_blocks * C));
  Operand o;
  std::vector<float>& rowwise = o.rowwise;
  o.rowwise.resize(n), o.transpose.resize(n), o.requantize.resize(n), o.colwise.resize(n);
  auto colwise_back = [&](std::vector<float>& out) {
    dequantize_colwise_cpu(DType::f32, q_t.data(), s_t.data(), M, C, segments.data(), E, out.data());
  };
  quantize_rowwise_cpu(DType::f32, a, M, C, q.data(), s.data());
  dequantize_rowwise_cpu(DType::f32, q.data(), s.data(), M, C, rowwise.data());
  fp8_transpose_cpu(q.data(), s.data(), M, C, segments.data(), E, q_t.data(), s_t.data());
  colwise_back(o.transpose);
  quantize_colwise_cpu(DType::f32, rowwise.data(), M, C, segments.data(), E, q_t.data(), s_t.data());
  colwise_back(o.requantize);
  quantize_colwise_cpu(DType::f32, a, M, C, segments.data(), E, q_t.data(), s_t.data());
  colwise_back(o.colwise);
  for (size_t i = 0; i < n; ++i) {
    const double v = a[i], e = double(rowwise[i]) - v;
    o.amax = std::max(o.amax, std::abs(v));
    o.sq += v * v;
    o.rowwise_err_sq += e * e;
  }
  return o;
}

// Sum of squares of a, and of a - ref.
void add_sq(const std::vector<float>& a, const std::vector<double>& ref, double& ref_sq, double& err_sq) {
  for (size_t i = 0; i < ref.size(); ++i) {
    ref_sq += ref[i] * ref[i];
    err_sq += (double(a[i]) - ref[i]) * (double(a[i]) - ref[i]);
  }
}

// The three products of the experts e = first, first + step, ...: y[e] = x[e]·W[e]ᵀ [rows,N],
// dx[e] = dy[e]·W[e] [rows,K] and dW[e] = dy[e]ᵀ·x[e] [N,K], in f64 from the operands and in f32 from
// their FP8 versions (w, wq: [E,N,K] f32, the weight and its 128x128-block FP8 version dequantized).
void expert_sums(const float* x, const float* dy, const float* w, const float* wq, const Operand& ox,
                 const Operand& ody, const std::vector<int64_t>& segments, const std::vector<int64_t>& offsets,
                 int64_t K, int64_t N, size_t first, size_t step, GemmErrorSums& out) {
  std::vector<double> x64, dy64, w64(size_t(N * K)), ref(size_t(N * K)), y_ref, dx_ref;
  std::vector<float> dw(size_t(N * K)), y, dx;
  for (size_t e = first; e < segments.size(); e += step) {
    const int64_t rows = segments[e], off = offsets[e];
    if (rows == 0) continue;
    x64.assign(x + off * K, x + (off + rows) * K);
    dy64.assign(dy + off * N, dy + (off + rows) * N);
    w64.assign(w + int64_t(e) * N * K, w + int64_t(e + 1) * N * K);
    const float* wq_e = wq + int64_t(e) * N * K;
    y_ref.resize(size_t(rows * N)), y.resize(size_t(rows * N)), dx_ref.resize(size_t(rows * K)),
        dx.resize(size_t(rows * K));
    gemm_cpu<double>(false, true, rows, N, K, x64.data(), w64.data(), y_ref.data(), false);
    gemm_cpu<float>(false, true, rows, N, K, ox.rowwise.data() + off * K, wq_e, y.data(), false);
    add_sq(y, y_ref, out.fprop_ref_sq, out.fprop_sq);
    gemm_cpu<double>(false, false, rows, K, N, dy64.data(), w64.data(), dx_ref.data(), false);
    gemm_cpu<float>(false, false, rows, K, N, ody.rowwise.data() + off * N, wq_e, dx.data(), false);
    add_sq(dx, dx_ref, out.dgrad_ref_sq, out.dgrad_sq);
    gemm_cpu<double>(true, false, N, K, rows, dy64.data(), x64.data(), ref.data(), false);
    for (double r : ref) out.ref_sq += r * r;
    auto path_err = [&](const std::vector<float>& px, const std::vector<float>& pdy) {
      gemm_cpu<float>(true, false, N, K, rows, pdy.data() + off * N, px.data() + off * K, dw.data(), false);
      double ref_sq = 0, sq = 0;
      add_sq(dw, ref, ref_sq, sq);
      return sq;
    };
    out.transpose_sq += path_err(ox.transpose, ody.transpose);
    out.requantize_sq += path_err(ox.requantize, ody.requantize);
    out.colwise_sq += path_err(ox.colwise, ody.colwise);
  }
}

}  // namespace

GemmErrorSums gemm_error_sums(const Tensor& x_in, const Tensor& dy_in, const Tensor& w_in,
                              const std::vector<int64_t>& segments, int num_threads) {
  const int64_t E = int64_t(segments.size());
  FLOWMOE_CHECK(x_in.dim() == 2 && dy_in.dim() == 2 && x_in.size(0) == dy_in.size(0) && w_in.dim() == 3 &&
                    w_in.shape() == (Shape{E, dy_in.size(1), x_in.size(1)}),
                ShapeError, "fp8-error: expert GEMM operands x ", x_in.describe(), ", dy ", dy_in.describe(),
                " and weight ", w_in.describe(), " must be [M,K], [M,N] and [E,N,K] with E = ", E, " segments");
  const auto host_f32 = [](const Tensor& t) { return t.to(Device::cpu()).to(DType::f32).contiguous(); };
  const Tensor x = host_f32(x_in), dy = host_f32(dy_in), w = host_f32(w_in);
  const int64_t K = x.size(1), N = dy.size(1);
  const int64_t M = colwise_total_rows(segments.data(), E);  // the routed rows; the tail is unused
  FLOWMOE_CHECK(M <= x.size(0), ShapeError, "fp8-error: the segments hold ", M, " rows, x only ", x.size(0));
  std::vector<int64_t> offsets(segments.size(), 0);
  for (size_t e = 1; e < segments.size(); ++e) offsets[e] = offsets[e - 1] + segments[e - 1];

  const Operand ox = fp8_versions(x.data<float>(), M, K, segments);
  const Operand ody = fp8_versions(dy.data<float>(), M, N, segments);
  std::vector<uint8_t> wq8(size_t(E * N * K));
  std::vector<float> w_scale(size_t(E * fp8_num_blocks(N) * fp8_num_blocks(K))), wq(wq8.size());
  quantize_block_cpu(DType::f32, w.data<float>(), E, N, K, wq8.data(), w_scale.data(), nullptr, nullptr);
  dequantize_block_cpu(DType::f32, wq8.data(), w_scale.data(), E, N, K, wq.data());
  const size_t workers = std::clamp<size_t>(num_threads > 0 ? size_t(num_threads) : size_t(usable_cpu_count()), 1,
                                            std::max<size_t>(1, segments.size()));
  std::vector<GemmErrorSums> parts(workers);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < workers; ++i)
    threads.emplace_back(expert_sums, x.data<float>(), dy.data<float>(), w.data<float>(), wq.data(), std::cref(ox),
                         std::cref(ody), std::cref(segments), std::cref(offsets), K, N, i, workers, std::ref(parts[i]));
  for (std::thread& t : threads) t.join();

  GemmErrorSums s;
  for (const GemmErrorSums& p : parts) s.add(p);
  s.rows = M;
  s.x_amax = ox.amax, s.dy_amax = ody.amax;
  s.x_sq = ox.sq, s.x_err_sq = ox.rowwise_err_sq, s.dy_sq = ody.sq, s.dy_err_sq = ody.rowwise_err_sq;
  return s;
}

double GemmErrorRow::x_rel_err() const { return ratio_sqrt(sums.x_err_sq, sums.x_sq); }
double GemmErrorRow::dy_rel_err() const { return ratio_sqrt(sums.dy_err_sq, sums.dy_sq); }
double GemmErrorRow::fprop() const { return ratio_sqrt(sums.fprop_sq, sums.fprop_ref_sq); }
double GemmErrorRow::dgrad() const { return ratio_sqrt(sums.dgrad_sq, sums.dgrad_ref_sq); }
double GemmErrorRow::transpose() const { return ratio_sqrt(sums.transpose_sq, sums.ref_sq); }
double GemmErrorRow::requantize() const { return ratio_sqrt(sums.requantize_sq, sums.ref_sq); }
double GemmErrorRow::colwise() const { return ratio_sqrt(sums.colwise_sq, sums.ref_sq); }
double GemmErrorRow::ratio() const { return requantize() / transpose(); }

namespace {

// The study's batches: num_batches of the validation split (wrapping around a small one), else the
// first training windows; or, for train_step N, the micro-batches the run trained on at step N.
std::vector<Batch> study_batches(const Config& cfg, DataLoader& data, int64_t num_batches, int64_t train_step,
                                 std::string& split) {
  std::vector<Batch> batches;
  const bool val = train_step == 0 && data.num_val_windows() > 0;
  split = val ? "validation" : train_step > 0 ? "step " + std::to_string(train_step) + "'s training" : "training";
  if (train_step > 0) {
    const int64_t per_step = cfg.train.grad_accum_steps;
    for (int64_t i = 0; i < (train_step - 1) * per_step; ++i) data.next_train(cfg.train.batch_size);
    num_batches = per_step;
  }
  const int64_t batch_size = val ? std::min(cfg.train.batch_size, data.num_val_windows()) : cfg.train.batch_size;
  for (int64_t i = 0; i < num_batches; ++i)
    batches.push_back(val ? data.val_batch(i % (data.num_val_windows() / batch_size), batch_size)
                          : data.next_train(batch_size));
  return batches;
}

// Whether the config's shapes take `recipe` (fp8_full's dense FP8 GEMMs need more of them than the experts' do).
bool admits_recipe(Config cfg, MoeRecipe recipe) {
  cfg.precision.recipe = recipe;
  try {
    validate(cfg);
  } catch (const ConfigError&) {
    return false;
  }
  return true;
}

// The mean LM loss of `batches` under `recipe` through the weights and buffers of `loaded`, the same
// model in another recipe (no graph; the checkpoint is not read again).
double recipe_loss(Config cfg, MoeRecipe recipe, const Transformer& loaded, const std::vector<Batch>& batches) {
  cfg.precision.recipe = recipe;
  Transformer model(cfg.model, loaded.device(), loaded.compute_dtype(), uint64_t(cfg.train.seed), moe_options(cfg));
  auto take = [](const std::vector<Variable>& to, const std::vector<Variable>& from) {
    for (size_t i = 0; i < to.size(); ++i) Variable(to[i]).set_data(from[i].data());  // handles share the value
  };
  take(model.parameters(), loaded.parameters());
  take(model.buffers(), loaded.buffers());
  NoGradGuard no_grad;
  double sum = 0;
  for (const Batch& b : batches) sum += double(model.losses(b.inputs, b.targets).lm.data().to_floats()[0]);
  return sum / double(batches.size());
}

}  // namespace

Fp8ErrorStudy fp8_error_study(Config cfg, const std::string& checkpoint, int64_t num_batches, int64_t train_step) {
  FLOWMOE_CHECK(cfg.model.n_routed_experts > 0, ConfigError,
                "fp8-error: the model has no routed experts (model.n_routed_experts is 0)");
  FLOWMOE_CHECK(num_batches >= 1, ConfigError, "fp8-error: --batches must be at least 1, got ", num_batches);
  FLOWMOE_CHECK(train_step >= 0 && train_step <= cfg.train.steps, ConfigError, "fp8-error: --train-step ", train_step,
                " is not a step of the run (1 to train.steps = ", cfg.train.steps, ")");
  cfg.precision.recipe = MoeRecipe::bf16;  // unquantized operands: the reference holds no FP8 error
  cfg.train.recompute = "";
  cfg.parallel.expert_parallel_size = 1;
  RunSetup setup(cfg);
  DataLoader& data = setup.read_data();
  setup.check_fits(MemoryUse::train);
  Transformer& model = setup.build_model(uint64_t(cfg.train.seed), moe_options(cfg));
  const CheckpointMeta meta = setup.load_weights(checkpoint);

  Fp8ErrorStudy study;
  study.checkpoint = checkpoint;
  study.step = meta.step;
  const std::vector<Batch> batches = study_batches(cfg, data, num_batches, train_step, study.split);
  study.num_batches = int64_t(batches.size());
  std::map<std::string, Tensor> weights;  // the expert weights by name
  for (const Variable& p : model.parameters()) weights[p.name()] = p.data();
  std::map<std::string, GemmErrorSums> by_weight;
  double bf16_loss = 0;
  std::vector<std::string> seen;  // backward order: the last layer first, fc2 before fc1
  {
    ScopedOpTensorHook guard(
        [&](const std::string& site, const std::vector<Tensor>& t, const std::vector<int64_t>& segments) {
          const std::string weight = site.substr(0, site.rfind(' '));
          FLOWMOE_CHECK(weights.count(weight), Error, "fp8-error: no parameter named '", weight, "'");
          if (!by_weight.count(weight)) seen.push_back(weight);
          by_weight[weight].add(gemm_error_sums(t[0], t[1], weights[weight], segments));
        });
    for (const Batch& b : batches) {
      study.num_tokens += b.inputs.numel();
      const Transformer::Losses parts = model.losses(b.inputs, b.targets);
      bf16_loss += double(parts.lm.data().to_floats()[0]) / double(batches.size());
      parts.total().backward();
    }
  }
  for (auto it = seen.rbegin(); it != seen.rend(); ++it) {
    study.rows.push_back({*it, by_weight[*it]});
    study.pooled.sums.add(by_weight[*it]);
  }
  study.pooled.weight = "all";
  study.recipe_losses.push_back({moe_recipe_name(MoeRecipe::bf16), bf16_loss});  // the tapped pass is the bf16 forward
  for (MoeRecipe recipe : {MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow, MoeRecipe::fp8_full})
    if (admits_recipe(cfg, recipe))
      study.recipe_losses.push_back({moe_recipe_name(recipe), recipe_loss(cfg, recipe, model, batches)});
  return study;
}

namespace {

std::string num(double v, const char* fmt = "%.6g") {
  if (!std::isfinite(v)) return "null";
  char buf[48];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

std::string row_json(const GemmErrorRow& r) {
  return "{\"weight\": " + json_escape(r.weight) + ", \"rows\": " + std::to_string(r.sums.rows) +
         ", \"x_amax\": " + num(r.sums.x_amax) + ", \"dy_amax\": " + num(r.sums.dy_amax) +
         ", \"x_rowwise_rel_err\": " + num(r.x_rel_err()) + ", \"dy_rowwise_rel_err\": " + num(r.dy_rel_err()) +
         ", \"fprop_rel_err\": " + num(r.fprop()) + ", \"dgrad_rel_err\": " + num(r.dgrad()) +
         ", \"wgrad_rel_err\": {\"transpose\": " + num(r.transpose()) + ", \"requantize\": " + num(r.requantize()) +
         ", \"colwise\": " + num(r.colwise()) + "}, \"requantize_over_transpose\": " + num(r.ratio()) + "}";
}

}  // namespace

std::string fp8_error_json(const Fp8ErrorStudy& s) {
  std::string j = "{\n  \"checkpoint\": " + json_escape(s.checkpoint) + ",\n  \"step\": " + std::to_string(s.step) +
                  ",\n  \"split\": " + json_escape(s.split) + ",\n  \"batches\": " + std::to_string(s.num_batches) +
                  ",\n  \"tokens\": " + std::to_string(s.num_tokens) + ",\n  \"gemms\": [";
  for (size_t i = 0; i < s.rows.size(); ++i) j += std::string(i ? "," : "") + "\n    " + row_json(s.rows[i]);
  j += "\n  ],\n  \"pooled\": " + row_json(s.pooled) + ",\n  \"lm_loss\": {";
  for (size_t i = 0; i < s.recipe_losses.size(); ++i)
    j += std::string(i ? ", " : "") + json_escape(s.recipe_losses[i].first) + ": " + num(s.recipe_losses[i].second);
  return j + "}\n}\n";
}

std::string fp8_error_table(const Fp8ErrorStudy& s) {
  std::string t;
  char line[256];
  std::snprintf(line, sizeof line, "%-38s %7s %9s %9s %9s %9s | %9s %9s %9s %6s\n", "expert GEMM", "rows", "x q",
                "dy q", "fprop", "dgrad", "wgrad: tr", "requant", "colwise", "ratio");
  t += line;
  auto add = [&](const GemmErrorRow& r) {
    const auto e = [](double v) { return num(v, "%.3e"); };
    std::snprintf(line, sizeof line, "%-38s %7" PRId64 " %9s %9s %9s %9s | %9s %9s %9s %6s\n", r.weight.c_str(),
                  r.sums.rows, e(r.x_rel_err()).c_str(), e(r.dy_rel_err()).c_str(), e(r.fprop()).c_str(),
                  e(r.dgrad()).c_str(), e(r.transpose()).c_str(), e(r.requantize()).c_str(), e(r.colwise()).c_str(),
                  num(r.ratio(), "%.4f").c_str());
    t += line;
  };
  for (const GemmErrorRow& r : s.rows) add(r);
  add(s.pooled);
  std::string losses;
  for (const auto& [recipe, loss] : s.recipe_losses)
    losses += (losses.empty() ? "" : " | ") + recipe + " " + num(loss, "%.4f");
  if (!losses.empty()) t += "LM loss of these batches from the same weights: " + losses + "\n";
  return t;
}

}  // namespace flowmoe
