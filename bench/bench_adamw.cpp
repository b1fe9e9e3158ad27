// bench_adamw: the optimizer's update over a real model's parameter list (configs/gpu_small.yaml,
// configs/gpu_moe.yaml): the gradient norm's sums and AdamW with bf16 copies of the matrices (as
// precision.param_dtype auto writes them), one multi-tensor launch per kTensorsPerLaunch tensors
// (kernels/adamw.h) against the baseline in the same run, one launch per tensor (two for its norm), both
// queued from the host and replayed as a CUDA graph (the trainer's step); with f32 moments and with bf16
// moments (optimizer.moment_dtype, stochastically rounded), or the one named: `bench_adamw [f32|bf16]`.
// Bytes = the update's f32 param and grad read, param written, moments read and written (4 x 4 bytes per
// parameter in f32, 4 x 2 in bf16), the bf16 copies written, and the norm's gradient read; the table gives
// them per parameter too. Ceiling: the device's D2D cudaMemcpyAsync bandwidth (read + written) measured in the
// same run. Times are medians of event-timed runs. No GPU: prints a skip line and exits 0.
#include <cstdio>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "config/config.h"
#include "engine/cuda_graph.h"
#include "engine/tensor.h"
#include "kernels/adamw.h"
#include "kernels/common/error.h"
#include "layers/transformer.h"

using namespace flowmoe;

namespace {

// One parameter's buffers: f32 weights and gradient, moments of the benchmark's dtype, a bf16 copy for a matrix.
struct ParamBuffers {
  Tensor param, grad, exp_avg, exp_avg_sq, copy;
};

std::vector<ParamBuffers> model_buffers(const std::string& config, DType moment_dtype) {
  const Config cfg = load_config(std::string(FLOWMOE_SOURCE_DIR) + "/configs/" + config + ".yaml");
  std::vector<Shape> shapes;
  {
    const Transformer model(cfg.model, Device::cuda(), DType::bf16, 1);
    for (const Variable& p : model.parameters()) shapes.push_back(p.shape());
  }
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

void run(const std::string& config, DType moment_dtype, double copy_ceiling, cudaStream_t stream) {
  std::vector<ParamBuffers> bs = model_buffers(config, moment_dtype);
  const int64_t num = int64_t(bs.size());
  Tensor slots = Tensor::zeros({num}, DType::f32, Device::cuda()),
         total = Tensor::zeros({1}, DType::f32, Device::cuda());
  Tensor partials = Tensor::zeros({int64_t(kTensorsPerLaunch) * kReduceMaxBlocks}, DType::f32, Device::cuda());
  AdamWStep step;
  step.lr = 1e-4f;
  step.weight_decay = 0.1f;
  step.update = 1;
  const double moment_bytes = double(dtype_size(moment_dtype));
  std::vector<AdamWTensor> tensors;
  std::vector<SumSlice> slices;
  double bytes = 0, elements = 0;
  for (int64_t i = 0; i < num; ++i) {
    ParamBuffers& b = bs[size_t(i)];
    const int64_t n = b.param.numel();
    AdamWTensor t;
    t.param = b.param.data<float>();
    t.grad = b.grad.data<float>();
    t.exp_avg = b.exp_avg.raw_data();
    t.exp_avg_sq = b.exp_avg_sq.raw_data();
    t.n = n;
    t.step = step;
    t.moment_dtype = moment_dtype;
    t.rounding = {rounding_key(1, uint64_t(i)), 0};
    if (b.copy.defined()) t.copy = {b.copy.raw_data(), DType::bf16};
    tensors.push_back(t);
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

// The moment dtypes named on the command line (none: both).
std::vector<DType> moment_dtypes(int argc, char** argv) {
  if (argc < 2) return {DType::f32, DType::bf16};
  DType t = DType::f32;
  FLOWMOE_CHECK(argc == 2 && dtype_from_name(argv[1], &t) && (t == DType::f32 || t == DType::bf16), ConfigError,
                "usage: bench_adamw [f32|bf16] (the moments' dtype; none: both)");
  return {t};
}

}  // namespace

int main(int argc, char** argv) {
  return bench_main("bench_adamw", [&](const cudaDeviceProp& prop, cudaStream_t stream) {
    const std::vector<DType> dtypes = moment_dtypes(argc, argv);
    const double copy_ceiling = copy_gbps(stream).queued;
    std::printf("bench_adamw on %s: copy ceiling %.1f GB/s (read + written)\n", prop.name, copy_ceiling);
    for (DType moments : dtypes)
      for (const char* config : {"gpu_small", "gpu_moe"}) run(config, moments, copy_ceiling, stream);
  });
}
