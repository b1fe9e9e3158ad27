// bench_grouped_linear: BF16 GroupedLinear forward + backward, i.e. three GEMM groups (fp32 compute):
//   fprop  y_e  = x_e · w_eᵀ     (bf16 out)      dgrad  dx_e = dy_e · w_e   (bf16 out)
//   wgrad  dw_e = dy_eᵀ · x_e    (fp32 out, the master-gradient precision)
// through the launchers of kernels/grouped_linear.h, beside a dense baseline, autograd, fresh per-expert counts
// and 4 streams (bench_case lists the measurements). Times are medians of kReps event-timed runs after kWarmup;
// data random. FLOPs = 3 · 2 · M_total·N·K, as a fraction of the BF16 grouped GEMM ceiling of DESIGN.md §6
// (docs/PERF.md has the figures). No GPU: skip, exit 0.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "bench/bench_util.h"
#include "engine/ops/grouped_linear.h"
#include "engine/rng.h"
#include "engine/stream.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/grouped_linear.h"
#include "kernels/linear.h"

using namespace flowmoe;

namespace {

constexpr int kWarmup = 5;
constexpr int kReps = 30;
constexpr int kFreshSteps = 20;
// The measured BF16 grouped GEMM ceiling of DESIGN.md §6; TFLOP/s are reported as fractions of it.
constexpr double kCeilingTflops = 679.0;

struct Timing {
  double gpu_ms = 0, host_ms = 0;  // medians: event-timed GPU span, wall time to issue
};

template <class F>
Timing median_timing(F&& run, cudaStream_t stream, int warmup = kWarmup, int reps = kReps) {
  for (int i = 0; i < warmup; ++i) run(i);
  Event start(true), stop(true);
  std::vector<double> gpu, host;
  for (int i = 0; i < reps; ++i) {
    start.record(stream);
    auto t0 = std::chrono::steady_clock::now();
    run(warmup + i);
    auto t1 = std::chrono::steady_clock::now();
    stop.record(stream);
    stop.synchronize();
    gpu.push_back(start.elapsed_ms(stop));
    host.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::sort(gpu.begin(), gpu.end());
  std::sort(host.begin(), host.end());
  return {gpu[gpu.size() / 2], host[host.size() / 2]};
}

// Random values without drawing every element on the host: a random chunk tiled over the tensor
// (random data, not zeros: data-dependent power draw changes GEMM clocks).
Tensor random_device(Rng& rng, const Shape& shape, DType dtype, cudaStream_t stream) {
  const Device dev = Device::cuda(0);
  Tensor out = Tensor::empty(shape, dtype, dev);
  const int64_t n = out.numel(), chunk = std::min<int64_t>(n, int64_t(1) << 22);
  if (n == 0) return out;
  Tensor src = rng.uniform({chunk}, -1.0, 1.0, DType::f32).to(dtype).to(dev);
  const size_t es = dtype_size(dtype);
  for (int64_t off = 0; off < n; off += chunk)
    FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(out.raw_data()) + size_t(off) * es, src.raw_data(),
                                       size_t(std::min(chunk, n - off)) * es, cudaMemcpyDeviceToDevice, stream));
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

// Counts of `align`-row chunks, each expert's count drawn around the mean (x0.5..x1.5), then fixed
// up chunk by chunk so they sum to exactly total.
std::vector<int64_t> fresh_counts(std::mt19937_64& gen, int64_t num_experts, int64_t total, int64_t align) {
  const int64_t chunks = total / align, mean = chunks / num_experts;
  std::uniform_int_distribution<int64_t> around(mean / 2, mean + mean / 2);
  std::uniform_int_distribution<int64_t> pick(0, num_experts - 1);
  std::vector<int64_t> c(static_cast<size_t>(num_experts));
  int64_t sum = 0;
  for (auto& v : c) sum += (v = around(gen));
  while (sum != chunks) {
    int64_t& v = c[size_t(pick(gen))];
    int64_t step = sum < chunks ? 1 : (v > 0 ? -1 : 0);
    v += step;
    sum += step;
  }
  for (auto& v : c) v *= align;
  return c;
}

struct Case {
  const char* name;
  int64_t num_experts, padded_tokens_per_expert, k, n;
};

struct Result {
  Case c;
  double fwd_ms, dgrad_ms, wgrad_ms, grouped_ms, host_ms, dense_ms, op_ms, fresh_first_ms, fresh_median_ms;
  size_t distinct_m;
  double host_us_per_gemm, fresh_first_host_ms, streams4_ms, streams4_host_ms;
  GemmPlanStats fresh_stats;  // counters accumulated over the fresh-M steps
};

// "grouped": the launchers of kernels/grouped_linear.h (one cached cuBLASLt call per expert);
// "dense": the same run's baseline, one GEMM per pass over all M_total rows through gemm_cuda (same
//   FLOPs, one weight); grouped/dense is the price of splitting by expert;
// "op": grouped_linear() + backward() through autograd (adds the f32 -> bf16 weight cast, allocation
//   and the leaf-gradient copy of the f32 [E,N,K] gradient);
// "fresh M": the grouped launchers when every step brings new per-expert counts (same total): each
//   M not seen before builds a gemm_cuda plan (an AlgoCheck of its bucket's algorithm; a heuristic
//   query only for a new bucket or a refused algorithm). First step (GPU span and host issue time),
//   median, and the plan-cache counters over all fresh steps.
// "host": wall time to issue one grouped step (no sync); near the GPU time means launch-bound.
//   "us/gemm" divides it by the GEMMs issued (3 per expert).
// "4 streams": the same step with set_grouped_linear_streams(4) (small GEMMs overlap); "x" = 1-stream
//   step / 4-stream step.
Result bench_case(const Case& c, Rng& rng) {
  const Device dev = Device::cuda(0);
  cudaStream_t stream = current_stream(0);
  const int64_t e = c.num_experts, m = e * c.padded_tokens_per_expert, n = c.n, k = c.k;
  std::vector<int64_t> rows(size_t(e), c.padded_tokens_per_expert);
  Tensor x = random_device(rng, {m, k}, DType::bf16, stream), dy = random_device(rng, {m, n}, DType::bf16, stream);
  Tensor w32 = random_device(rng, {e, n, k}, DType::f32, stream), w = w32.to(DType::bf16);
  Tensor y = Tensor::empty({m, n}, DType::bf16, dev), dx = Tensor::empty({m, k}, DType::bf16, dev);
  Tensor dw = Tensor::empty({e, n, k}, DType::f32, dev);

  auto fwd = [&](const std::vector<int64_t>& r) {
    grouped_linear_forward_cuda(DType::bf16, x.raw_data(), w.raw_data(), y.raw_data(), r.data(), e, m, n, k, stream);
  };
  auto dgrad = [&](const std::vector<int64_t>& r) {
    grouped_linear_dgrad_cuda(DType::bf16, dy.raw_data(), w.raw_data(), dx.raw_data(), r.data(), e, m, n, k, stream);
  };
  auto wgrad = [&](const std::vector<int64_t>& r) {
    grouped_linear_wgrad_cuda(DType::bf16, x.raw_data(), dy.raw_data(), dw.data<float>(), r.data(), e, m, n, k, false,
                              stream);
  };
  Result res{};
  res.c = c;
  res.fwd_ms = median_timing([&](int) { fwd(rows); }, stream).gpu_ms;
  res.dgrad_ms = median_timing([&](int) { dgrad(rows); }, stream).gpu_ms;
  res.wgrad_ms = median_timing([&](int) { wgrad(rows); }, stream).gpu_ms;
  Timing step = median_timing(
      [&](int) {
        fwd(rows);
        dgrad(rows);
        wgrad(rows);
      },
      stream);
  res.grouped_ms = step.gpu_ms;
  res.host_ms = step.host_ms;
  res.host_us_per_gemm = step.host_ms * 1e3 / double(3 * e);
  {  // the same step over 4 streams
    const int saved = grouped_linear_streams();
    set_grouped_linear_streams(4);
    Timing fan = median_timing(
        [&](int) {
          fwd(rows);
          dgrad(rows);
          wgrad(rows);
        },
        stream);
    set_grouped_linear_streams(saved);
    res.streams4_ms = fan.gpu_ms;
    res.streams4_host_ms = fan.host_ms;
  }

  {  // dense baseline: the same FLOPs as one GEMM per pass (weight = expert 0's)
    Tensor dw_dense = Tensor::empty({n, k}, DType::f32, dev);
    res.dense_ms = median_timing(
                       [&](int) {
                         gemm_cuda(false, true, m, n, k, DType::bf16, x.raw_data(), k, w.raw_data(), k, DType::bf16,
                                   y.raw_data(), n, nullptr, false, stream);
                         gemm_cuda(false, false, m, k, n, DType::bf16, dy.raw_data(), n, w.raw_data(), k, DType::bf16,
                                   dx.raw_data(), k, nullptr, false, stream);
                         gemm_cuda(true, false, n, k, m, DType::bf16, dy.raw_data(), n, x.raw_data(), k, DType::f32,
                                   dw_dense.raw_data(), k, nullptr, false, stream);
                       },
                       stream)
                       .gpu_ms;
  }
  {  // through autograd, with the f32 master weight
    Variable vx(x, true), vw(w32, true);
    res.op_ms = median_timing(
                    [&](int) {
                      vx.zero_grad();
                      vw.zero_grad();
                      grouped_linear(vx, vw, rows).backward(dy);
                    },
                    stream)
                    .gpu_ms;
  }
  {  // new counts every step: the plan cache meets M values it has not seen
    std::mt19937_64 gen(uint64_t(e * 1000003 + k));
    std::vector<std::vector<int64_t>> steps;
    std::set<int64_t> distinct;
    for (int i = 0; i < kFreshSteps; ++i) {
      steps.push_back(fresh_counts(gen, e, m, 16));
      distinct.insert(steps.back().begin(), steps.back().end());
    }
    Event start(true), stop(true);
    std::vector<double> times;
    const GemmPlanStats before = gemm_cuda_plan_stats();
    for (const auto& r : steps) {
      start.record(stream);
      auto t0 = std::chrono::steady_clock::now();
      fwd(r);
      dgrad(r);
      wgrad(r);
      auto t1 = std::chrono::steady_clock::now();
      stop.record(stream);
      stop.synchronize();
      times.push_back(start.elapsed_ms(stop));
      if (times.size() == 1) res.fresh_first_host_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    }
    const GemmPlanStats after = gemm_cuda_plan_stats();
    res.fresh_stats = {after.heuristic_queries - before.heuristic_queries, after.plans_built - before.plans_built,
                       after.bucket_rejects - before.bucket_rejects};
    res.fresh_first_ms = times.front();
    std::sort(times.begin(), times.end());
    res.fresh_median_ms = times[times.size() / 2];
    res.distinct_m = distinct.size();
  }
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return res;
}

double tflops(const Result& r, double ms) {
  const Case& c = r.c;
  return 6.0 * double(c.num_experts * c.padded_tokens_per_expert) * double(c.n) * double(c.k) / (ms * 1e-3) / 1e12;
}

}  // namespace

int main() {
  return bench_main("bench_grouped_linear", [&](const cudaDeviceProp& prop, cudaStream_t /*stream*/) {
    std::printf(
        "bench_grouped_linear on %s: bf16 GroupedLinear fwd + bwd (fprop, dgrad, wgrad fp32 out), "
        "median of %d reps\n",
        prop.name, kReps);
    Rng rng(2026);
    // The DESIGN §6 shape, then the MoE layer benchmark's fc1/fc2 (T·top_k/E rows per expert).
    const Case cases[] = {
        {"dsv3_32x1024", 32, 1024, 7168, 4096},      {"fc1_E64", 64, 16384 * 6 / 64, 2048, 2 * 1408},
        {"fc2_E64", 64, 16384 * 6 / 64, 1408, 2048}, {"fc1_E32", 32, 8192 * 4 / 32, 1024, 2 * 512},
        {"fc2_E32", 32, 8192 * 4 / 32, 512, 1024},
    };
    std::vector<Result> results;
    for (const Case& c : cases) {
      std::printf("  %-13s E %3lld  rows/expert %5lld  K %5lld  N %5lld ...\n", c.name, (long long)c.num_experts,
                  (long long)c.padded_tokens_per_expert, (long long)c.k, (long long)c.n);
      std::fflush(stdout);
      results.push_back(bench_case(c, rng));
    }

    std::printf("\n%-13s %8s %8s %8s %9s %8s %8s %9s %8s %8s %8s %9s %9s %6s\n", "case", "fwd ms", "dgrad", "wgrad",
                "step ms", "TF/s", "of 679", "dense ms", "grp/dns", "op ms", "host ms", "fresh1 ms", "freshmed",
                "new M");
    for (const Result& r : results) {
      double tf = tflops(r, r.grouped_ms);
      std::printf("%-13s %8.3f %8.3f %8.3f %9.3f %8.1f %8.3f %9.3f %8.3f %8.3f %8.3f %9.3f %9.3f %6zu\n", r.c.name,
                  r.fwd_ms, r.dgrad_ms, r.wgrad_ms, r.grouped_ms, tf, tf / kCeilingTflops, r.dense_ms,
                  r.grouped_ms / r.dense_ms, r.op_ms, r.host_ms, r.fresh_first_ms, r.fresh_median_ms, r.distinct_m);
    }
    for (const Result& r : results) {
      double tf = tflops(r, r.grouped_ms);
      std::printf(
          "BENCH grouped_linear case=%s dtype=bf16 E=%lld padded_tokens_per_expert=%lld K=%lld N=%lld "
          "fwd_ms=%.4f dgrad_ms=%.4f wgrad_ms=%.4f grouped_ms=%.4f grouped_tflops=%.1f "
          "frac_679_ceiling=%.4f dense_ms=%.4f dense_tflops=%.1f ratio_grouped_dense=%.4f op_ms=%.4f "
          "host_issue_ms=%.4f fresh_first_ms=%.4f fresh_median_ms=%.4f\n",
          r.c.name, (long long)r.c.num_experts, (long long)r.c.padded_tokens_per_expert, (long long)r.c.k,
          (long long)r.c.n, r.fwd_ms, r.dgrad_ms, r.wgrad_ms, r.grouped_ms, tf, tf / kCeilingTflops, r.dense_ms,
          tflops(r, r.dense_ms), r.grouped_ms / r.dense_ms, r.op_ms, r.host_ms, r.fresh_first_ms, r.fresh_median_ms);
    }
    std::printf("\n%-13s %8s %10s %11s %8s %8s %8s %10s %10s %6s\n", "case", "us/gemm", "fresh1 hst", "fresh plans",
                "queries", "rejects", "new M", "4str ms", "4str host", "x");
    for (const Result& r : results)
      std::printf("%-13s %8.2f %10.3f %11llu %8llu %8llu %8zu %10.3f %10.3f %6.2f\n", r.c.name, r.host_us_per_gemm,
                  r.fresh_first_host_ms, (unsigned long long)r.fresh_stats.plans_built,
                  (unsigned long long)r.fresh_stats.heuristic_queries, (unsigned long long)r.fresh_stats.bucket_rejects,
                  r.distinct_m, r.streams4_ms, r.streams4_host_ms, r.grouped_ms / r.streams4_ms);
    for (const Result& r : results) {
      double tf4 = tflops(r, r.streams4_ms);
      std::printf(
          "BENCH grouped_linear_host case=%s dtype=bf16 E=%lld gemms_per_step=%lld host_issue_ms=%.4f "
          "host_issue_us_per_gemm=%.3f fresh_first_ms=%.4f fresh_first_host_ms=%.4f fresh_plans_built=%llu "
          "fresh_heuristic_queries=%llu fresh_bucket_rejects=%llu fresh_distinct_m=%zu "
          "streams4_grouped_ms=%.4f streams4_tflops=%.1f streams4_frac_679_ceiling=%.4f "
          "streams4_host_issue_ms=%.4f ratio_1stream_4stream=%.4f\n",
          r.c.name, (long long)r.c.num_experts, (long long)(3 * r.c.num_experts), r.host_ms, r.host_us_per_gemm,
          r.fresh_first_ms, r.fresh_first_host_ms, (unsigned long long)r.fresh_stats.plans_built,
          (unsigned long long)r.fresh_stats.heuristic_queries, (unsigned long long)r.fresh_stats.bucket_rejects,
          r.distinct_m, r.streams4_ms, tf4, tf4 / kCeilingTflops, r.streams4_host_ms, r.grouped_ms / r.streams4_ms);
    }
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
