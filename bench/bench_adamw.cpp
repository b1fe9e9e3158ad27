// bench_adamw: the optimizer's update over a real model's parameter list (configs/gpu_small.yaml,
// configs/gpu_moe.yaml, or the config named): the gradient norm's sums and AdamW with bf16 copies of the matrices
// (as precision.param_dtype auto writes them), one multi-tensor launch per kTensorsPerLaunch tensors
// (kernels/adamw.h) against the baseline in the same run, one launch per tensor (two for its norm), both
// queued from the host and replayed as a CUDA graph (the trainer's step); with f32 moments and with bf16
// moments (optimizer.moment_dtype, stochastically rounded), or the one named:
// `bench_adamw [<config>.yaml] [f32|bf16] [section.key=value ...]` (overrides of the config, as --set).
// Bytes = the update's f32 param and grad read, param written, moments read and written (4 x 4 bytes per
// parameter in f32, 4 x 2 in bf16), the bf16 copies written, and the norm's gradient read; the table gives
// them per parameter too. Ceiling: the device's D2D cudaMemcpyAsync bandwidth (read + written) measured in the
// same run. Times are medians of event-timed runs. No GPU: prints a skip line and exits 0.
// Then the FP8 weights of the config under precision.recipe fp8_full (those train/optimizer.cpp hands to
// adamw_fp8 with precision.fp8_weights optimizer: f32 weights, no other copy): the fused update that writes their
// FP8 copies (kernels/adamw_fp8.h: 30 bytes per parameter with f32 moments, 22 with bf16) against the plain
// multi-tensor update of the same tensors writing a bf16 copy (the same bytes), and that update followed by the
// forward's quantize of each copy (quantize_block_cuda: 4 more), as graphs.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "config/config.h"
#include "engine/cuda_graph.h"
#include "engine/tensor.h"
#include "kernels/adamw.h"
#include "kernels/adamw_fp8.h"
#include "kernels/common/error.h"
#include "kernels/fp8.h"
#include "kernels/quantize.h"
#include "layers/transformer.h"
#include "train/train_options.h"

using namespace flowmoe;

namespace {

// One parameter's buffers: f32 weights and gradient, moments of the benchmark's dtype, a bf16 copy for a matrix.
struct ParamBuffers {
  Tensor param, grad, exp_avg, exp_avg_sq, copy;
};

// The shapes of a config's parameters; fp8_only: those of its FP8 weights under precision.recipe fp8_full (the
// parameters whose shard holds an FP8 copy).
std::vector<Shape> parameter_shapes(const std::string& config_path, const std::vector<std::string>& sets,
                                    bool fp8_only) {
  Config cfg = load_config(config_path, sets);
  if (fp8_only) cfg.precision.recipe = MoeRecipe::fp8_full;
  const Transformer model(cfg.model, Device::cuda(), DType::bf16, 1, moe_options(cfg));
  std::vector<Shape> shapes;
  for (size_t i = 0; i < model.parameters().size(); ++i)
    if (!fp8_only || model.parameter_shards()[i].fp8) shapes.push_back(model.parameters()[i].shape());
  return shapes;
}

std::vector<ParamBuffers> model_buffers(const std::vector<Shape>& shapes, DType moment_dtype) {
  std::vector<ParamBuffers> out;
  for (const Shape& shape : shapes) {
    const int64_t n = shape_numel(shape);
    ParamBuffers b{
        Tensor::full({n}, 0.01, DType::f32, Device::cuda()), Tensor::full({n}, 1e-3, DType::f32, Device::cuda()),
        Tensor::zeros({n}, moment_dtype, Device::cuda()), Tensor::zeros({n}, moment_dtype, Device::cuda()), Tensor()};
    if (shape.size() >= 2) b.copy = Tensor::zeros({n}, DType::bf16, Device::cuda());
    out.push_back(b);
  }
  return out;
}

// Parameter i's update of buffers b (step 1, lr 1e-4, weight decay 0.1), its bf16 copy written where it has one.
AdamWTensor adamw_tensor(const ParamBuffers& b, DType moment_dtype, int64_t i) {
  AdamWTensor t;
  t.param = b.param.data<float>();
  t.grad = b.grad.data<float>();
  t.exp_avg = b.exp_avg.raw_data();
  t.exp_avg_sq = b.exp_avg_sq.raw_data();
  t.n = b.param.numel();
  t.step.lr = 1e-4f;
  t.step.weight_decay = 0.1f;
  t.step.update = 1;
  t.moment_dtype = moment_dtype;
  t.rounding = {rounding_key(1, uint64_t(i)), 0};
  if (b.copy.defined()) t.copy = {b.copy.raw_data(), DType::bf16};
  return t;
}

struct Timing {
  double queued_ms = 0, graph_ms = 0;
};

// body queued from the host, then captured once and its graph replayed.
template <class F>
Timing time_both(F&& body, cudaStream_t stream) {
  Timing t;
  t.queued_ms = median_ms(body, stream);
  CudaGraphCapture graph(Device::cuda());
  graph.capture([&] {
    body();
    return std::vector<Tensor>{};
  });
  t.graph_ms = median_ms([&] { graph.replay(); }, stream);
  return t;
}

void run(const std::string& config, const std::string& config_path, const std::vector<std::string>& sets,
         DType moment_dtype, double copy_ceiling, cudaStream_t stream) {
  std::vector<ParamBuffers> bs = model_buffers(parameter_shapes(config_path, sets, false), moment_dtype);
  const int64_t num = int64_t(bs.size());
  Tensor slots = Tensor::zeros({num}, DType::f32, Device::cuda()),
         total = Tensor::zeros({1}, DType::f32, Device::cuda());
  Tensor partials = Tensor::zeros({int64_t(kTensorsPerLaunch) * kReduceMaxBlocks}, DType::f32, Device::cuda());
  const double moment_bytes = double(dtype_size(moment_dtype));
  std::vector<AdamWTensor> tensors;
  std::vector<SumSlice> slices;
  double bytes = 0, elements = 0;
  for (int64_t i = 0; i < num; ++i) {
    ParamBuffers& b = bs[size_t(i)];
    const int64_t n = b.param.numel();
    tensors.push_back(adamw_tensor(b, moment_dtype, i));
    slices.push_back({b.grad.data<float>(), n, slots.data<float>() + i});
    bytes += double(n) * (3 * 4 + 4 * moment_bytes + (b.copy.defined() ? 2 : 0) + 4);
    elements += double(n);
  }
  const SumSlice sum_of_slots{slots.data<float>(), num, total.data<float>()};
  auto per_tensor = [&] {
    for (const SumSlice& s : slices) sum_squares_cuda(s.x, s.n, s.out, partials.data<float>(), stream);
    sum_values_cuda(sum_of_slots.x, sum_of_slots.n, sum_of_slots.out, partials.data<float>(), stream);
    for (const AdamWTensor& t : tensors)
      adamw_cuda(t.param, t.grad, t.exp_avg, t.exp_avg_sq, t.n, t.step, stream, t.copy, t.moment_dtype, t.rounding);
  };
  auto multi = [&] {
    sum_squares_multi_cuda(slices.data(), num, partials.data<float>(), stream);
    sum_values_multi_cuda(&sum_of_slots, 1, partials.data<float>(), stream);
    adamw_multi_cuda(tensors.data(), num, nullptr, stream);
  };
  const Timing base = time_both(per_tensor, stream), fused = time_both(multi, stream);
  const int64_t launches_base = 3 * num + 2, chunks = (num + kTensorsPerLaunch - 1) / kTensorsPerLaunch;
  const int64_t launches_multi = 3 * chunks + 2;
  const char* moments = dtype_name(moment_dtype);
  std::printf("%-12s %s moments %5lld tensors %7.1fM elements %8.1f MB (%.2f bytes per parameter)\n", config.c_str(),
              moments, (long long)num, elements / 1e6, bytes / 1e6, bytes / elements);
  const struct {
    const char* name;
    double ms;
    double base_ms;
    int64_t launches;
  } rows[] = {{"queued", fused.queued_ms, base.queued_ms, launches_multi},
              {"graph", fused.graph_ms, base.graph_ms, launches_multi}};
  for (const auto& r : rows) {
    const double rate = gbps(bytes, r.ms);
    std::printf(
        "  %-7s multi %8.3f ms (%lld launches)  per-tensor %8.3f ms (%lld launches)  %7.1f GB/s  %.3f of copy  "
        "%.2fx\n",
        r.name, r.ms, (long long)r.launches, r.base_ms, (long long)launches_base, rate, rate / copy_ceiling,
        r.base_ms / r.ms);
    std::printf(
        "BENCH adamw %s %s moments %s: %.3f ms, %.2f bytes per parameter, %.1f GB/s (%.3f of copy), %.2fx the "
        "per-tensor launches (%.3f ms)\n",
        config.c_str(), moments, r.name, r.ms, bytes / elements, rate, rate / copy_ceiling, r.base_ms / r.ms,
        r.base_ms);
  }
}

// One FP8 weight's buffers beside its update's: its block copy (kernels/adamw_fp8.h), B = 1 for a matrix.
struct Fp8Buffers {
  Tensor q, scale_inv, q_t, scale_inv_t;
  Fp8BlockCopy copy;
};

Fp8Buffers fp8_buffers(const Shape& shape) {
  const int64_t B = shape.size() == 3 ? shape[0] : 1, N = shape[shape.size() - 2], K = shape.back();
  const int64_t nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K);
  Fp8Buffers f{Tensor::zeros({B, N, K}, DType::u8, Device::cuda()),
               Tensor::zeros({B, nbn, nbk}, DType::f32, Device::cuda()),
               Tensor::zeros({B, K, N}, DType::u8, Device::cuda()),
               Tensor::zeros({B, nbk, nbn}, DType::f32, Device::cuda()),
               {}};
  f.copy = {
      f.q.data<uint8_t>(), f.scale_inv.data<float>(), f.q_t.data<uint8_t>(), f.scale_inv_t.data<float>(), B, N, K};
  return f;
}

// The config's FP8 weights: the fused update writing their FP8 copies against the plain update of the same buffers
// writing a bf16 copy, alone and followed by the quantize of each copy, each replayed as a graph.
void run_fp8(const std::string& config, const std::string& config_path, const std::vector<std::string>& sets,
             DType moment_dtype, double copy_ceiling, cudaStream_t stream) {
  const std::vector<Shape> shapes = parameter_shapes(config_path, sets, true);
  if (shapes.empty()) {
    std::printf("%-12s %s moments: no FP8 weights under fp8_full\n", config.c_str(), dtype_name(moment_dtype));
    return;
  }
  std::vector<ParamBuffers> bs = model_buffers(shapes, moment_dtype);
  std::vector<Fp8Buffers> fs;
  std::vector<AdamWTensor> plain;
  std::vector<AdamWFp8Tensor> fused;
  double elements = 0;
  for (size_t i = 0; i < bs.size(); ++i) {
    AdamWTensor t = adamw_tensor(bs[i], moment_dtype, int64_t(i));
    fs.push_back(fp8_buffers(shapes[i]));
    plain.push_back(t);
    t.copy = {};  // the optimizer's: the forward reads the f32 weights' FP8 copy
    fused.push_back({t, fs.back().copy});
    elements += double(t.n);
  }
  const int64_t num = int64_t(plain.size());
  auto update = [&] { adamw_multi_cuda(plain.data(), num, nullptr, stream); };
  auto update_quantize = [&] {
    update();
    for (size_t i = 0; i < fs.size(); ++i) {
      const Fp8BlockCopy& c = fs[i].copy;
      quantize_block_cuda(DType::bf16, bs[i].copy.raw_data(), c.B, c.N, c.K, c.q, c.scale_inv, c.q_t, c.scale_inv_t,
                          stream);
    }
  };
  auto fused_update = [&] { adamw_fp8_cuda(fused.data(), num, nullptr, stream); };
  // Per parameter: param read and written, grad read, moments read and written; then the fused update writes q and
  // q_t, the plain one the bf16 copy, which the quantize reads to write q and q_t.
  const double update_bytes = 3 * 4 + 4 * double(dtype_size(moment_dtype));
  const struct {
    const char* name;
    double ms, bytes_per_param;
  } rows[] = {{"fused", time_both(fused_update, stream).graph_ms, update_bytes + 2},
              {"update", time_both(update, stream).graph_ms, update_bytes + 2},
              {"update+quantize", time_both(update_quantize, stream).graph_ms, update_bytes + 6}};
  const char* moments = dtype_name(moment_dtype);
  std::printf("%-12s %s moments %5lld FP8 weights %7.1fM elements (fp8_full, graph replays)\n", config.c_str(), moments,
              (long long)num, elements / 1e6);
  for (const auto& r : rows) {
    const double rate = gbps(r.bytes_per_param * elements, r.ms);
    std::printf("  %-16s %8.3f ms  %5.2f bytes per parameter  %7.1f GB/s  %.3f of copy  %.2fx the fused\n", r.name,
                r.ms, r.bytes_per_param, rate, rate / copy_ceiling, r.ms / rows[0].ms);
    std::printf(
        "BENCH adamw_fp8 %s %s moments %s: %.3f ms, %.2f bytes per parameter, %.1f GB/s (%.3f of copy), %.2fx the "
        "fused update\n",
        config.c_str(), moments, r.name, r.ms, r.bytes_per_param, rate, rate / copy_ceiling, r.ms / rows[0].ms);
  }
}

// The configs and moment dtypes named on the command line: a path ending in .yaml, f32 or bf16, each at most once
// (none: configs/gpu_small.yaml and configs/gpu_moe.yaml; both dtypes), and section.key=value overrides (e.g.
// model.intermediate_size=11008: fp8_full takes gpu_moe_wide's dense MLP at a multiple of 128).
struct Args {
  std::vector<std::string> configs;
  std::vector<DType> moments;
  std::vector<std::string> sets;
};

Args parse_args(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    DType t = DType::f32;
    const bool yaml = arg.size() > 5 && arg.compare(arg.size() - 5, 5, ".yaml") == 0;
    if (dtype_from_name(arg, &t) && (t == DType::f32 || t == DType::bf16) && a.moments.empty())
      a.moments = {t};
    else if (yaml && a.configs.empty())  // as given, else in the source tree (configs/gpu_moe_wide.yaml from a build)
      a.configs = {std::filesystem::path(arg).is_absolute() || std::filesystem::exists(arg)
                       ? arg
                       : std::string(FLOWMOE_SOURCE_DIR) + "/" + arg};
    else if (arg.find('=') != std::string::npos)
      a.sets.push_back(arg);
    else
      throw ConfigError("bad argument '" + arg +
                        "' (usage: bench_adamw [<config>.yaml] [f32|bf16] [section.key=value ...]: a config, the "
                        "moments' dtype (none: both), overrides of the config)");
  }
  if (a.configs.empty())
    for (const char* name : {"gpu_small", "gpu_moe"})
      a.configs.push_back(std::string(FLOWMOE_SOURCE_DIR) + "/configs/" + name + ".yaml");
  if (a.moments.empty()) a.moments = {DType::f32, DType::bf16};
  return a;
}

// A config's name in the table: its file name without .yaml.
std::string config_name(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string file = slash == std::string::npos ? path : path.substr(slash + 1);
  return file.substr(0, file.size() - 5);
}

}  // namespace

int main(int argc, char** argv) {
  return bench_main("bench_adamw", [&](const cudaDeviceProp& prop, cudaStream_t stream) {
    const Args args = parse_args(argc, argv);
    const double copy_ceiling = copy_gbps(stream).queued;
    std::printf("bench_adamw on %s: copy ceiling %.1f GB/s (read + written)\n", prop.name, copy_ceiling);
    for (DType moments : args.moments)
      for (const std::string& path : args.configs) {
        run(config_name(path), path, args.sets, moments, copy_ceiling, stream);
        run_fp8(config_name(path), path, args.sets, moments, copy_ceiling, stream);
      }
  });
}
