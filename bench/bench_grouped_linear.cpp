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

// One figure of a result, named once for both outputs: its table column (header, width, precision; no
// header: the BENCH line only) and its BENCH key (with its precision; no key: the table only).
struct Field {
  const char* header;
  int width, table_precision;
  const char* key;
  int bench_precision;
  double value;
};

// A table, a row per result, then a "BENCH <bench_name> case=... dtype=bf16 E=... key=value..." line per
// result, both from fields(result).
template <class Fields>
void print_results(const std::vector<Result>& results, const char* bench_name, Fields&& fields) {
  if (results.empty()) return;
  std::printf("\n%-13s", "case");
  for (const Field& f : fields(results.front()))
    if (f.header) std::printf(" %*s", f.width, f.header);
  std::printf("\n");
  for (const Result& r : results) {
    std::printf("%-13s", r.c.name);
    for (const Field& f : fields(r))
      if (f.header) std::printf(" %*.*f", f.width, f.table_precision, f.value);
    std::printf("\n");
  }
  for (const Result& r : results) {
    std::printf("BENCH %s case=%s dtype=bf16 E=%lld", bench_name, r.c.name, (long long)r.c.num_experts);
    for (const Field& f : fields(r))
      if (f.key) std::printf(" %s=%.*f", f.key, f.bench_precision, f.value);
    std::printf("\n");
  }
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

    // Counts are printed as whole numbers (precision 0).
    print_results(results, "grouped_linear", [](const Result& r) {
      const double tf = tflops(r, r.grouped_ms);
      return std::vector<Field>{
          {nullptr, 0, 0, "padded_tokens_per_expert", 0, double(r.c.padded_tokens_per_expert)},
          {nullptr, 0, 0, "K", 0, double(r.c.k)},
          {nullptr, 0, 0, "N", 0, double(r.c.n)},
          {"fwd ms", 8, 3, "fwd_ms", 4, r.fwd_ms},
          {"dgrad", 8, 3, "dgrad_ms", 4, r.dgrad_ms},
          {"wgrad", 8, 3, "wgrad_ms", 4, r.wgrad_ms},
          {"step ms", 9, 3, "grouped_ms", 4, r.grouped_ms},
          {"TF/s", 8, 1, "grouped_tflops", 1, tf},
          {"of 679", 8, 3, "frac_679_ceiling", 4, tf / kCeilingTflops},
          {"dense ms", 9, 3, "dense_ms", 4, r.dense_ms},
          {nullptr, 0, 0, "dense_tflops", 1, tflops(r, r.dense_ms)},
          {"grp/dns", 8, 3, "ratio_grouped_dense", 4, r.grouped_ms / r.dense_ms},
          {"op ms", 8, 3, "op_ms", 4, r.op_ms},
          {"host ms", 8, 3, "host_issue_ms", 4, r.host_ms},
          {"fresh1 ms", 9, 3, "fresh_first_ms", 4, r.fresh_first_ms},
          {"freshmed", 9, 3, "fresh_median_ms", 4, r.fresh_median_ms},
          {"new M", 6, 0, nullptr, 0, double(r.distinct_m)},
      };
    });
    print_results(results, "grouped_linear_host", [](const Result& r) {
      const double tf4 = tflops(r, r.streams4_ms);
      const GemmPlanStats& st = r.fresh_stats;
      return std::vector<Field>{
          {nullptr, 0, 0, "gemms_per_step", 0, double(3 * r.c.num_experts)},
          {nullptr, 0, 0, "host_issue_ms", 4, r.host_ms},
          {"us/gemm", 8, 2, "host_issue_us_per_gemm", 3, r.host_us_per_gemm},
          {nullptr, 0, 0, "fresh_first_ms", 4, r.fresh_first_ms},
          {"fresh1 hst", 10, 3, "fresh_first_host_ms", 4, r.fresh_first_host_ms},
          {"fresh plans", 11, 0, "fresh_plans_built", 0, double(st.plans_built)},
          {"queries", 8, 0, "fresh_heuristic_queries", 0, double(st.heuristic_queries)},
          {"rejects", 8, 0, "fresh_bucket_rejects", 0, double(st.bucket_rejects)},
          {"new M", 8, 0, "fresh_distinct_m", 0, double(r.distinct_m)},
          {"4str ms", 10, 3, "streams4_grouped_ms", 4, r.streams4_ms},
          {nullptr, 0, 0, "streams4_tflops", 1, tf4},
          {nullptr, 0, 0, "streams4_frac_679_ceiling", 4, tf4 / kCeilingTflops},
          {"4str host", 10, 3, "streams4_host_issue_ms", 4, r.streams4_host_ms},
          {"x", 6, 2, "ratio_1stream_4stream", 4, r.grouped_ms / r.streams4_ms},
      };
    });
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
