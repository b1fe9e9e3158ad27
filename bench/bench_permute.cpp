// bench_permute: the fused MoE permute+pad (kernels/cuda/permute.cu) and unpermute+unpad
// (kernels/cuda/unpermute.cu) with a bf16 payload, align 16 and 128, on random top-k routing drawn
// per config (distinct experts per token, all experts local).
// Bytes are the minimal traffic: permute reads each token row once and writes each padded row once
// (pad rows count as written), plus topk_idx, topk_prob, row_map and the permuted probs; unpermute
// reads each routed row once (pad rows are not read), writes each token row once, plus row_map and
// topk_prob. permute is timed three ways: the buffer sized from counts the caller holds ("exact"),
// sized for the worst case ("worst": its tail rows are written too, but not counted), and the
// published recipe's cudaMemset of the whole worst-case buffer first ("memset+"). The ceiling is the
// device's own D2D cudaMemcpyAsync bandwidth (read + write) measured in the same run; the H200 figure
// of DESIGN.md §6 (4249 GB/s) is reported too. Each time is the median of kReps event-timed runs
// after kWarmup. FLOWMOE_PERMUTE_VARIANT picks the variant of the BENCH permute lines (default base).
//
// Variants (kernels/permute.h): each of permute_candidate_variants() runs in a child process (this
// binary with --variant=NAME: a variant that traps cannot take the others down) on the same inputs
// (same seeds), exact-size buffer, timed four ways: "ms" as above (the GPU idles from the start event
// until the host has submitted the first kernel, so host launch latency counts); "gpu" with a 256 MiB
// memset queued first, so every launch is submitted before the start event and only GPU time counts;
// "map" (the routing kernels alone) and "rows" (the row move alone, after an untimed map), both
// timed like "gpu". Each child hashes every output byte; a variant whose hash differs from base's is
// marked and never chosen. No GPU: prints a skip line and exits 0.
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/cuda_check.h"
#include "engine/cuda_api.h"
#include "engine/rng.h"
#include "engine/stream.h"
#include "kernels/permute.h"
#include "kernels/unpermute.h"

using namespace flowmoe;

namespace {

constexpr int kWarmup = 5;
constexpr int kReps = 30;
constexpr double kH200CopyGbps = 4249.0;
constexpr size_t kCopyBytes = size_t(1) << 30;
constexpr int kLargeConfigs = 3;  // the first three configs are the targets; the last is small
constexpr double kTarget = 0.85;  // of the copy bandwidth, whole op

template <class F>
double median_ms(F&& run, cudaStream_t stream) {
  for (int i = 0; i < kWarmup; ++i) run();
  Event start(true), stop(true);
  std::vector<float> times;
  for (int i = 0; i < kReps; ++i) {
    start.record(stream);
    run();
    stop.record(stream);
    stop.synchronize();
    times.push_back(start.elapsed_ms(stop));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// GPU time only: a memset of kBusyBytes keeps the GPU busy while the host submits `prelude` (untimed),
// the start event, `run` and the stop event, so launch latency drops out of the measurement.
constexpr size_t kBusyBytes = size_t(256) << 20;
void* g_busy = nullptr;  // kBusyBytes of device memory, allocated in main

template <class P, class F>
double median_gpu_ms(P&& prelude, F&& run, cudaStream_t stream) {
  for (int i = 0; i < kWarmup; ++i) {
    prelude();
    run();
  }
  Event start(true), stop(true);
  std::vector<float> times;
  for (int i = 0; i < kReps; ++i) {
    MOE_CUDA_CHECK(cudaMemsetAsync(g_busy, 0, kBusyBytes, stream));
    prelude();
    start.record(stream);
    run();
    stop.record(stream);
    stop.synchronize();
    times.push_back(start.elapsed_ms(stop));
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

double gbps(double bytes, double ms) { return bytes / (ms * 1e-3) / 1e9; }

// Device-to-device copy of 1 GiB, counting bytes read + written: timed as median_ms and as median_gpu_ms.
std::pair<double, double> copy_gbps(cudaStream_t stream) {
  void* src = cuda_malloc_raw(kCopyBytes, 0);
  void* dst = cuda_malloc_raw(kCopyBytes, 0);
  MOE_CUDA_CHECK(cudaMemsetAsync(src, 1, kCopyBytes, stream));
  auto copy = [&] { MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, kCopyBytes, cudaMemcpyDeviceToDevice, stream)); };
  const double ms = median_ms(copy, stream), gpu_ms = median_gpu_ms([] {}, copy, stream);
  cuda_free_raw(src, 0);
  cuda_free_raw(dst, 0);
  return {gbps(2.0 * double(kCopyBytes), ms), gbps(2.0 * double(kCopyBytes), gpu_ms)};
}

struct Config {
  int64_t tokens;
  int experts;
  int64_t hidden;
  int topk;
};
const Config kConfigs[] = {{4096, 64, 7168, 8}, {8192, 128, 4096, 8}, {16384, 32, 2048, 4}, {4096, 8, 1024, 2}};
const int kAligns[] = {16, 128};

// Distinct experts per token, uniform: what a balanced router produces.
std::vector<int64_t> random_routing(std::mt19937_64& gen, const Config& c) {
  std::vector<int64_t> idx;
  idx.reserve(size_t(c.tokens * c.topk));
  std::vector<int> pool(size_t(c.experts));
  for (int64_t t = 0; t < c.tokens; ++t) {
    std::iota(pool.begin(), pool.end(), 0);
    for (int j = 0; j < c.topk; ++j) {
      std::uniform_int_distribution<size_t> pick(size_t(j), pool.size() - 1);
      std::swap(pool[size_t(j)], pool[pick(gen)]);
      idx.push_back(pool[size_t(j)]);
    }
  }
  return idx;
}

// One config's inputs and outputs on the device. Built in the same order from the same seeds, the
// parent and every child see the same inputs.
struct Setup {
  Config c;
  int align;
  Tensor idx, x, prob, rows, probs, row_map, counts, workspace, y;
  RoutingDims d, exact;  // worst-case and exact-size buffer
  PermuteBuffers b;
  int64_t padded_rows = 0, routed = 0;
  double permute_bytes = 0, unpermute_bytes = 0;

  Setup(const Config& cfg, int al, std::mt19937_64& gen, Rng& rng, cudaStream_t stream) : c(cfg), align(al) {
    const Device dev = Device::cuda(0);
    const int64_t esize = 2;  // bf16
    idx = Tensor::from_ints(random_routing(gen, c), {c.tokens, c.topk}, DType::i32, dev);
    x = rng.uniform({c.tokens, c.hidden}, -1, 1, DType::bf16, dev);
    prob = rng.uniform({c.tokens, c.topk}, 0, 1, DType::f32, dev);
    d.num_tokens = c.tokens, d.topk = c.topk, d.num_experts = c.experts, d.expert_offset = 0;
    d.num_local_experts = c.experts, d.align_size = align;
    d.num_rows = permute_worst_case_rows(c.tokens, c.topk, c.experts, align);
    rows = Tensor::empty({d.num_rows, c.hidden}, DType::bf16, dev);
    probs = Tensor::empty({d.num_rows}, DType::f32, dev);
    row_map = Tensor::empty({c.tokens, c.topk}, DType::i32, dev);
    counts = Tensor::empty({3 * int64_t(c.experts) + 1}, DType::i32, dev);  // tokens, padded, starts
    workspace = Tensor::empty({int64_t(permute_workspace_bytes(d))}, DType::u8, dev);
    y = Tensor::empty({c.tokens, c.hidden}, DType::bf16, dev);
    b.topk_idx = idx.data<int32_t>(), b.x = x.raw_data(), b.row_bytes = size_t(c.hidden * esize);
    b.topk_prob = prob.data<float>(), b.rows = rows.raw_data(), b.probs = probs.data<float>();
    b.row_map = row_map.data<int32_t>(), b.tokens_per_expert = counts.data<int32_t>();
    b.padded_tokens_per_expert = b.tokens_per_expert + c.experts;
    b.segment_starts = b.tokens_per_expert + 2 * c.experts;
    b.workspace = workspace.raw_data();

    // The host reads the counts once, outside the timing, as a layer that sizes its buffers would.
    permute_pad_cuda(d, b, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<int64_t> host_counts = counts.to_ints();
    padded_rows = host_counts.back();
    for (int e = 0; e < c.experts; ++e) routed += host_counts[size_t(e)];
    exact = d;
    exact.num_rows = padded_rows;
    const double side_bytes = double(c.tokens * c.topk) * 4 * 3 + double(padded_rows) * 4;  // idx, prob, row_map; probs
    permute_bytes = double(c.tokens + padded_rows) * double(c.hidden * esize) + side_bytes;
    unpermute_bytes = double(routed + c.tokens) * double(c.hidden * esize) + double(c.tokens * c.topk) * 8;
  }
};

// ---- the default variant: the original table and BENCH permute / unpermute lines ----------------

struct Result {
  Config c;
  int align;
  int64_t padded_rows, worst_rows;
  double permute_bytes, unpermute_bytes;
  double exact_ms, worst_ms, memset_ms, unpermute_ms;
};

Result bench_default(Setup& s, cudaStream_t stream) {
  const Config& c = s.c;
  Result r{c, s.align, s.padded_rows, s.d.num_rows, s.permute_bytes, s.unpermute_bytes, 0, 0, 0, 0};
  r.worst_ms = median_ms([&] { permute_pad_cuda(s.d, s.b, stream); }, stream);
  r.memset_ms = median_ms(
      [&] {
        MOE_CUDA_CHECK(cudaMemsetAsync(s.b.rows, 0, size_t(s.d.num_rows) * s.b.row_bytes, stream));
        permute_pad_cuda(s.d, s.b, stream);
      },
      stream);
  r.exact_ms = median_ms([&] { permute_pad_cuda(s.exact, s.b, stream); }, stream);
  r.unpermute_ms = median_ms(
      [&] {
        unpermute_cuda(DType::bf16, s.row_map.data<int32_t>(), c.tokens, c.topk, c.hidden, s.rows.raw_data(),
                       s.prob.data<float>(), s.y.raw_data(), stream);
      },
      stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return r;
}

void print_default(const std::vector<Result>& results, double copy) {
  std::printf("\n%-24s %5s %8s | %9s %8s %6s | %9s %8s | %9s | %9s %8s %6s\n", "tokens,experts,hidden,k", "align",
              "rows", "perm ms", "GB/s", "copy", "worst ms", "GB/s", "memset+ms", "unperm ms", "GB/s", "copy");
  for (const Result& r : results) {
    char cfg[64];
    std::snprintf(cfg, sizeof(cfg), "%lld,%d,%lld,%d", (long long)r.c.tokens, r.c.experts, (long long)r.c.hidden,
                  r.c.topk);
    const double pe = gbps(r.permute_bytes, r.exact_ms), pw = gbps(r.permute_bytes, r.worst_ms);
    const double u = gbps(r.unpermute_bytes, r.unpermute_ms);
    std::printf("%-24s %5d %8lld | %9.4f %8.0f %6.3f | %9.4f %8.0f | %9.4f | %9.4f %8.0f %6.3f\n", cfg, r.align,
                (long long)r.padded_rows, r.exact_ms, pe, pe / copy, r.worst_ms, pw, r.memset_ms, r.unpermute_ms, u,
                u / copy);
  }
  for (const Result& r : results) {
    const double pe = gbps(r.permute_bytes, r.exact_ms), pw = gbps(r.permute_bytes, r.worst_ms);
    std::printf("BENCH permute T=%lld E=%d H=%lld k=%d align=%d dtype=bf16 rows=%lld worst_rows=%lld ms=%.4f "
                "gbps=%.1f frac_copy=%.4f frac_h200=%.4f worst_ms=%.4f worst_gbps=%.1f worst_frac_copy=%.4f "
                "memset_first_ms=%.4f copy_gbps=%.1f\n",
                (long long)r.c.tokens, r.c.experts, (long long)r.c.hidden, r.c.topk, r.align,
                (long long)r.padded_rows, (long long)r.worst_rows, r.exact_ms, pe, pe / copy, pe / kH200CopyGbps,
                r.worst_ms, pw, pw / copy, r.memset_ms, copy);
  }
  for (const Result& r : results) {
    const double u = gbps(r.unpermute_bytes, r.unpermute_ms);
    std::printf("BENCH unpermute T=%lld E=%d H=%lld k=%d align=%d dtype=bf16 ms=%.4f gbps=%.1f frac_copy=%.4f "
                "frac_h200=%.4f copy_gbps=%.1f\n",
                (long long)r.c.tokens, r.c.experts, (long long)r.c.hidden, r.c.topk, r.align, r.unpermute_ms, u,
                u / copy, u / kH200CopyGbps, copy);
  }
  std::fflush(stdout);
}

// ---- one variant (child process) --------------------------------------------------------------

// 64-bit hash of every output byte of the exact-size permute: rows, probs, row_map, counts.
uint64_t output_hash(const Setup& s) {
  auto fetch = [](const void* p, size_t bytes) {
    std::vector<uint64_t> h((bytes + 7) / 8, 0);
    MOE_CUDA_CHECK(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
    return h;
  };
  uint64_t hash = 1469598103934665603ull;
  auto mix = [&](const std::vector<uint64_t>& words) {
    for (uint64_t w : words) hash = (hash ^ w) * 1099511628211ull + (hash >> 29);
  };
  mix(fetch(s.b.rows, size_t(s.exact.num_rows) * s.b.row_bytes));
  mix(fetch(s.b.probs, size_t(s.exact.num_rows) * 4));
  mix(fetch(s.b.row_map, size_t(s.c.tokens * s.c.topk) * 4));
  mix(fetch(s.b.tokens_per_expert, size_t(3 * s.c.experts + 1) * 4));
  return hash;
}

// Prints one "VARIANT_ROW config align ms gpu_ms map_ms rows_ms hash" line per config for the parent.
int run_variant_child(const std::string& name, cudaStream_t stream) {
  set_permute_variant(parse_permute_variant(name));
  std::mt19937_64 gen(2026);
  Rng rng(2026);
  for (int ci = 0; ci < int(std::size(kConfigs)); ++ci)
    for (int align : kAligns) {
      Setup s(kConfigs[ci], align, gen, rng, stream);
      auto whole = [&] { permute_pad_cuda(s.exact, s.b, stream); };
      auto map = [&] { permute_map_cuda(s.exact, s.b, stream); };
      const double ms = median_ms(whole, stream);
      const double gpu_ms = median_gpu_ms([] {}, whole, stream);
      const double map_ms = median_gpu_ms([] {}, map, stream);
      const double rows_ms = median_gpu_ms(map, [&] { permute_rows_cuda(s.exact, s.b, stream); }, stream);
      MOE_CUDA_CHECK(cudaMemsetAsync(s.b.rows, 0xff, size_t(s.exact.num_rows) * s.b.row_bytes, stream));
      MOE_CUDA_CHECK(cudaMemsetAsync(s.b.probs, 0xff, size_t(s.exact.num_rows) * 4, stream));
      whole();  // every byte the hash reads is written by this call
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::printf("VARIANT_ROW %d %d %.6f %.6f %.6f %.6f %016" PRIx64 "\n", ci, align, ms, gpu_ms, map_ms, rows_ms,
                  output_hash(s));
      std::fflush(stdout);
    }
  return 0;
}

// ---- the sweep (parent) -----------------------------------------------------------------------

struct Row {
  double ms = 0, gpu_ms = 0, map_ms = 0, rows_ms = 0;
  uint64_t hash = 0;
};
struct VariantRun {
  unsigned variant;
  std::map<std::pair<int, int>, Row> rows;  // (config, align)
  int status = 0;
};

VariantRun run_variant(unsigned variant, const std::string& self) {
  VariantRun run{variant, {}, 0};
  const std::string name = permute_variant_name(variant);
  const std::string cmd = "'" + self + "' --variant=" + name + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) {
    run.status = -1;
    return run;
  }
  char line[4096];
  while (std::fgets(line, sizeof(line), pipe)) {
    int ci = 0, align = 0;
    Row r;
    if (std::sscanf(line, "VARIANT_ROW %d %d %lf %lf %lf %lf %" SCNx64, &ci, &align, &r.ms, &r.gpu_ms, &r.map_ms,
                    &r.rows_ms, &r.hash) == 7)
      run.rows[{ci, align}] = r;
    else
      std::printf("  [%s] %s", name.c_str(), line);  // the child's own messages (errors, traps)
  }
  run.status = pclose(pipe);
  return run;
}

// The table, BENCH permute_variant lines, per-variant summaries over the large configs (worst
// fraction of copy) and BENCH permute_best: the complete, identical variant whose worst fraction is
// highest, host-serialised timing (as the BENCH permute lines); permute_best_gpu: the same by GPU time.
void print_variants(const std::vector<VariantRun>& runs, const std::vector<Setup*>& setups, double copy,
                    double copy_gpu) {
  const VariantRun& base = runs.front();
  auto bytes_of = [&](int ci, int align) {
    for (const Setup* s : setups)
      if (s->c.tokens == kConfigs[ci].tokens && s->c.hidden == kConfigs[ci].hidden && s->align == align)
        return s->permute_bytes;
    return 0.0;
  };
  auto identical = [&](int ci, int align, const Row& r) {
    auto it = base.rows.find({ci, align});
    return it != base.rows.end() && it->second.hash == r.hash;
  };
  std::printf("\nvariants, exact-size buffer (gpu, map, rows: GPU time only; unhidden = gpu - rows: the routing\n"
              "map's cost on the critical path; gap = ms - gpu: host launch latency in the host-serialised ms)\n");
  std::printf("%-34s %-18s %5s | %8s %6s | %8s %6s | %8s | %8s %6s | %8s %8s | %s\n", "variant", "T,E,H,k", "align",
              "ms", "copy", "gpu ms", "copy", "map ms", "rows ms", "copy", "unhidden", "gap", "same");
  for (const VariantRun& run : runs)
    for (const auto& [key, r] : run.rows) {
      const Config& c = kConfigs[key.first];
      const double bytes = bytes_of(key.first, key.second);
      char cfg[64];
      std::snprintf(cfg, sizeof(cfg), "%lld,%d,%lld,%d", (long long)c.tokens, c.experts, (long long)c.hidden, c.topk);
      std::printf("%-34s %-18s %5d | %8.4f %6.3f | %8.4f %6.3f | %8.4f | %8.4f %6.3f | %8.4f %8.4f | %s\n",
                  permute_variant_name(run.variant).c_str(), cfg, key.second, r.ms, gbps(bytes, r.ms) / copy, r.gpu_ms,
                  gbps(bytes, r.gpu_ms) / copy_gpu, r.map_ms, r.rows_ms, gbps(bytes, r.rows_ms) / copy_gpu,
                  r.gpu_ms - r.rows_ms, r.ms - r.gpu_ms, identical(key.first, key.second, r) ? "yes" : "NO");
    }
  for (const VariantRun& run : runs)
    for (const auto& [key, r] : run.rows) {
      const Config& c = kConfigs[key.first];
      const double bytes = bytes_of(key.first, key.second);
      std::printf("BENCH permute_variant variant=%s T=%lld E=%d H=%lld k=%d align=%d ms=%.4f frac_copy=%.4f "
                  "gpu_ms=%.4f gpu_frac_copy=%.4f map_gpu_ms=%.4f rows_gpu_ms=%.4f rows_frac_copy=%.4f "
                  "unhidden_map_ms=%.4f launch_gap_ms=%.4f identical=%d\n",
                  permute_variant_name(run.variant).c_str(), (long long)c.tokens, c.experts, (long long)c.hidden,
                  c.topk, key.second, r.ms, gbps(bytes, r.ms) / copy, r.gpu_ms, gbps(bytes, r.gpu_ms) / copy_gpu,
                  r.map_ms, r.rows_ms, gbps(bytes, r.rows_ms) / copy_gpu, r.gpu_ms - r.rows_ms, r.ms - r.gpu_ms,
                  int(identical(key.first, key.second, r)));
    }

  struct Summary {
    unsigned variant;
    double worst = 1e9, worst_gpu = 1e9, worst_rows = 1e9;
    bool complete = true, same = true;
  };
  std::vector<Summary> summaries;
  for (const VariantRun& run : runs) {
    Summary s{run.variant};
    for (int ci = 0; ci < kLargeConfigs; ++ci)
      for (int align : kAligns) {
        auto it = run.rows.find({ci, align});
        if (it == run.rows.end()) {
          s.complete = false;
          continue;
        }
        const Row& r = it->second;
        const double bytes = bytes_of(ci, align);
        s.worst = std::min(s.worst, gbps(bytes, r.ms) / copy);
        s.worst_gpu = std::min(s.worst_gpu, gbps(bytes, r.gpu_ms) / copy_gpu);
        s.worst_rows = std::min(s.worst_rows, gbps(bytes, r.rows_ms) / copy_gpu);
        s.same = s.same && identical(ci, align, r);
      }
    s.complete = s.complete && run.rows.size() == std::size(kConfigs) * std::size(kAligns) && run.status == 0;
    if (!s.complete)
      std::printf("BENCH permute_variant_failed variant=%s status=%d rows=%zu\n",
                  permute_variant_name(run.variant).c_str(), run.status, run.rows.size());
    else
      std::printf("BENCH permute_variant_summary variant=%s worst_frac_copy=%.4f worst_gpu_frac_copy=%.4f "
                  "worst_rows_frac_copy=%.4f identical=%d\n",
                  permute_variant_name(s.variant).c_str(), s.worst, s.worst_gpu, s.worst_rows, int(s.same));
    summaries.push_back(s);
  }
  auto best_by = [&](double Summary::*field) -> const Summary* {
    const Summary* best = nullptr;
    for (const Summary& s : summaries)
      if (s.complete && s.same && (!best || s.*field > best->*field)) best = &s;
    return best;
  };
  const Summary &b0 = summaries.front();
  if (const Summary* best = best_by(&Summary::worst))
    std::printf("BENCH permute_best variant=%s worst_frac_copy=%.4f base_worst_frac_copy=%.4f gain=%.4f "
                "worst_gpu_frac_copy=%.4f target=%.2f met=%s\n",
                permute_variant_name(best->variant).c_str(), best->worst, b0.worst, best->worst / b0.worst,
                best->worst_gpu, kTarget, best->worst >= kTarget ? "yes" : "no");
  else
    std::printf("BENCH permute_best variant=none (no complete variant matched base)\n");
  if (const Summary* best = best_by(&Summary::worst_gpu))
    std::printf("BENCH permute_best_gpu variant=%s worst_gpu_frac_copy=%.4f base_worst_gpu_frac_copy=%.4f "
                "gain=%.4f worst_frac_copy=%.4f\n",
                permute_variant_name(best->variant).c_str(), best->worst_gpu, b0.worst_gpu,
                best->worst_gpu / b0.worst_gpu, best->worst);
}

std::string self_path() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, size_t(n)) : std::string();
}

}  // namespace

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::printf("bench_permute: no CUDA device, skipped\n");
    return 0;
  }
  try {
    cuda_set_device(0);
    cudaStream_t stream = current_stream(0);
    g_busy = cuda_malloc_raw(kBusyBytes, 0);
    for (int i = 1; i < argc; ++i)
      if (std::strncmp(argv[i], "--variant=", 10) == 0) return run_variant_child(argv[i] + 10, stream);

    cudaDeviceProp prop{};
    MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("bench_permute on %s: bf16 payload, random top-k routing, median of %d reps\n", prop.name, kReps);
    const auto [copy, copy_gpu] = copy_gbps(stream);
    std::printf("  device D2D copy (read + write): %.0f GB/s (%.3f of the H200's %.0f); GPU time only: %.0f GB/s\n",
                copy, copy / kH200CopyGbps, kH200CopyGbps, copy_gpu);
    std::printf("  default permute variant: %s\n", permute_variant_name(permute_variant()).c_str());

    std::mt19937_64 gen(2026);
    Rng rng(2026);
    std::vector<Result> results;
    std::vector<Setup*> setups;  // sizes only, for the variant table; the device buffers are released
    std::vector<std::unique_ptr<Setup>> keep;
    for (const Config& c : kConfigs)
      for (int align : kAligns) {
        auto s = std::make_unique<Setup>(c, align, gen, rng, stream);
        results.push_back(bench_default(*s, stream));
        s->idx = s->x = s->prob = s->rows = s->probs = s->row_map = s->counts = s->workspace = s->y = Tensor();
        setups.push_back(s.get());
        keep.push_back(std::move(s));
      }
    print_default(results, copy);

    std::vector<VariantRun> runs;
    const std::string self = self_path();
    for (unsigned v : permute_candidate_variants()) {
      runs.push_back(run_variant(v, self));
      std::printf("  variant %s: %zu of %zu configs, exit status %d\n", permute_variant_name(v).c_str(),
                  runs.back().rows.size(), std::size(kConfigs) * std::size(kAligns), runs.back().status);
      std::fflush(stdout);
    }
    print_variants(runs, setups, copy, copy_gpu);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    cuda_free_raw(g_busy, 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_permute failed: %s\n", e.what());
    return 1;
  }
  return 0;
}
