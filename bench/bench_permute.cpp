// bench_permute: the fused MoE permute+pad (kernels/cuda/permute.cu) and unpermute+unpad
// (kernels/cuda/unpermute.cu) with a bf16 payload, align 16 and 128, on random top-k routing drawn
// per config (kConfigs; distinct experts per token, all experts local).
// GB/s counts the minimal traffic (Setup), as a fraction of the device's own D2D copy bandwidth measured in the
// same run. Both ops are timed whole; permute also GPU-only and as its two steps (bench), then with each row-move
// kernel (compare_impls). Each time is the median of kReps runs after kWarmup; docs/PERF.md has the figures.
// No GPU: prints a skip line and exits 0.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <random>
#include <thread>
#include <vector>

#include "bench/bench_routing.h"
#include "bench/bench_util.h"
#include "engine/rng.h"
#include "engine/stream.h"
#include "kernels/common/cuda_check.h"
#include "kernels/common/device_api.h"
#include "kernels/permute.h"
#include "kernels/unpermute.h"

using namespace flowmoe;

namespace {

constexpr int kWarmup = 5;
constexpr int kReps = 30;

// GPU time only (bench_util.h): `prelude` untimed, launch latency out of the measurement.
template <class P, class F>
double median_gpu_ms(P&& prelude, F&& run, cudaStream_t stream) {
  return flowmoe::median_gpu_ms(prelude, run, stream, true, kWarmup, kReps);
}

struct Config {
  int64_t tokens;
  int experts;
  int64_t hidden;
  int top_k;
};
const Config kConfigs[] = {{4096, 64, 7168, 8}, {8192, 128, 4096, 8}, {16384, 32, 2048, 4}, {4096, 8, 1024, 2}};
const int kAligns[] = {16, 128};

// One config's inputs and outputs on the device. Bytes are the minimal traffic: permute reads each token row once
// and writes each padded row once (pad rows count as written), plus topk_idx, topk_prob, row_map and the permuted
// probs; unpermute reads each routed row once (pad rows are not read), writes each token row once, plus row_map
// and topk_prob.
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
    const std::vector<int64_t> routing = random_topk_experts(gen, c.tokens, c.top_k, c.experts);
    idx = Tensor::from_ints(routing, {c.tokens, c.top_k}, DType::i32, dev);
    x = rng.uniform({c.tokens, c.hidden}, -1, 1, DType::bf16, dev);
    prob = rng.uniform({c.tokens, c.top_k}, 0, 1, DType::f32, dev);
    d.num_tokens = c.tokens, d.top_k = c.top_k, d.num_experts = c.experts, d.expert_offset = 0;
    d.num_local_experts = c.experts, d.align_size = align;
    d.num_rows = permute_worst_case_rows(c.tokens, c.top_k, c.experts, align);
    rows = Tensor::empty({d.num_rows, c.hidden}, DType::bf16, dev);
    probs = Tensor::empty({d.num_rows}, DType::f32, dev);
    row_map = Tensor::empty({c.tokens, c.top_k}, DType::i32, dev);
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
    FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<int64_t> host_counts = counts.to_ints();
    padded_rows = host_counts.back();
    for (int e = 0; e < c.experts; ++e) routed += host_counts[size_t(e)];
    exact = d;
    exact.num_rows = padded_rows;
    const double side_bytes =
        double(c.tokens * c.top_k) * 4 * 3 + double(padded_rows) * 4;  // idx, prob, row_map; probs
    permute_bytes = double(c.tokens + padded_rows) * double(c.hidden * esize) + side_bytes;
    unpermute_bytes = double(routed + c.tokens) * double(c.hidden * esize) + double(c.tokens * c.top_k) * 8;
  }
};

struct Result {
  Config c;
  int align;
  int64_t padded_rows, worst_rows;
  double permute_bytes, unpermute_bytes;
  double exact_ms, worst_ms, memset_ms, unpermute_ms;
  double gpu_ms, map_gpu_ms, rows_gpu_ms;  // exact size, GPU time only
  double same_copy_gbps;                   // a D2D copy of the permute's byte count, GPU time only
};

// permute is timed three ways, each the median of kReps event-timed runs after kWarmup: the buffer sized from
// counts the caller holds ("exact"), sized for the worst case ("worst": its tail rows are written too, but not
// counted), and the published recipe's cudaMemset of the whole worst-case buffer first ("memset+").
// GPU time only: the exact-size permute is also timed with a 256 MiB memset queued first, so every launch is
// submitted before the start event and host launch latency drops out ("gpu"), and so are its two steps apart:
// the routing map alone ("map", permute_map_cuda) and the row move alone ("rows", permute_rows_cuda, after an
// untimed map). Their fractions are of the copy's own GPU-only bandwidth. "same" is a D2D copy of the permute's
// own byte count (GPU time only), as a fraction of the 1 GiB copy: how much of the ceiling a plain copy of an op
// this short reaches.
Result bench(Setup& s, cudaStream_t stream) {
  const Config& c = s.c;
  Result r{c, s.align, s.padded_rows, s.d.num_rows, s.permute_bytes, s.unpermute_bytes, 0, 0, 0, 0, 0, 0, 0, 0};
  auto exact = [&] { permute_pad_cuda(s.exact, s.b, stream); };
  auto map = [&] { permute_map_cuda(s.exact, s.b, stream); };
  r.worst_ms = median_ms([&] { permute_pad_cuda(s.d, s.b, stream); }, stream);
  r.memset_ms = median_ms(
      [&] {
        FLOWMOE_CUDA_CHECK(cudaMemsetAsync(s.b.rows, 0, size_t(s.d.num_rows) * s.b.row_bytes, stream));
        permute_pad_cuda(s.d, s.b, stream);
      },
      stream);
  r.exact_ms = median_ms(exact, stream);
  r.gpu_ms = median_gpu_ms([] {}, exact, stream);
  r.map_gpu_ms = median_gpu_ms([] {}, map, stream);
  r.rows_gpu_ms = median_gpu_ms(
      map, [&] { permute_rows_cuda(s.exact, s.b, stream); }, stream);
  // What a plain copy of this many bytes reaches: the ceiling is a 1 GiB copy, and shorter ops pay more
  // of their launch, ramp-up and drain.
  r.same_copy_gbps = copy_gbps(stream, true, size_t(s.permute_bytes / 2)).gpu_only;
  r.unpermute_ms = median_ms(
      [&] {
        unpermute_cuda(DType::bf16, s.row_map.data<int32_t>(), c.tokens, c.top_k, c.hidden, s.rows.raw_data(),
                       s.prob.data<float>(), s.y.raw_data(), stream);
      },
      stream);
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return r;
}

void print_results(const std::vector<Result>& results, double copy, double copy_gpu) {
  std::printf("\n%-24s %5s %8s | %9s %8s %6s | %9s %8s | %9s | %8s %6s | %8s | %8s %6s | %6s | %9s %8s %6s\n",
              "tokens,experts,hidden,k", "align", "rows", "perm ms", "GB/s", "copy", "worst ms", "GB/s", "memset+ms",
              "gpu ms", "copy", "map ms", "rows ms", "copy", "same", "unperm ms", "GB/s", "copy");
  for (const Result& r : results) {
    char cfg[64];
    std::snprintf(cfg, sizeof(cfg), "%lld,%d,%lld,%d", (long long)r.c.tokens, r.c.experts, (long long)r.c.hidden,
                  r.c.top_k);
    const double pe = gbps(r.permute_bytes, r.exact_ms), pw = gbps(r.permute_bytes, r.worst_ms);
    const double pg = gbps(r.permute_bytes, r.gpu_ms), pr = gbps(r.permute_bytes, r.rows_gpu_ms);
    const double u = gbps(r.unpermute_bytes, r.unpermute_ms);
    std::printf(
        "%-24s %5d %8lld | %9.4f %8.0f %6.3f | %9.4f %8.0f | %9.4f | %8.4f %6.3f | %8.4f | %8.4f %6.3f | "
        "%6.3f | %9.4f %8.0f %6.3f\n",
        cfg, r.align, (long long)r.padded_rows, r.exact_ms, pe, pe / copy, r.worst_ms, pw, r.memset_ms, r.gpu_ms,
        pg / copy_gpu, r.map_gpu_ms, r.rows_gpu_ms, pr / copy_gpu, r.same_copy_gbps / copy_gpu, r.unpermute_ms, u,
        u / copy);
  }
  for (const Result& r : results) {
    const double pe = gbps(r.permute_bytes, r.exact_ms), pw = gbps(r.permute_bytes, r.worst_ms);
    const double pg = gbps(r.permute_bytes, r.gpu_ms), pr = gbps(r.permute_bytes, r.rows_gpu_ms);
    std::printf(
        "BENCH permute T=%lld E=%d H=%lld k=%d align=%d dtype=bf16 rows=%lld worst_rows=%lld ms=%.4f "
        "gbps=%.1f frac_copy=%.4f frac_h200=%.4f worst_ms=%.4f worst_gbps=%.1f worst_frac_copy=%.4f "
        "memset_first_ms=%.4f copy_gbps=%.1f gpu_ms=%.4f gpu_frac_copy=%.4f map_gpu_ms=%.4f "
        "rows_gpu_ms=%.4f rows_frac_copy=%.4f copy_gpu_gbps=%.1f same_bytes_copy_frac=%.4f\n",
        (long long)r.c.tokens, r.c.experts, (long long)r.c.hidden, r.c.top_k, r.align, (long long)r.padded_rows,
        (long long)r.worst_rows, r.exact_ms, pe, pe / copy, pe / kH200CopyGbps, r.worst_ms, pw, pw / copy, r.memset_ms,
        copy, r.gpu_ms, pg / copy_gpu, r.map_gpu_ms, r.rows_gpu_ms, pr / copy_gpu, copy_gpu,
        r.same_copy_gbps / copy_gpu);
  }
  for (const Result& r : results) {
    const double u = gbps(r.unpermute_bytes, r.unpermute_ms);
    std::printf(
        "BENCH unpermute T=%lld E=%d H=%lld k=%d align=%d dtype=bf16 ms=%.4f gbps=%.1f frac_copy=%.4f "
        "frac_h200=%.4f copy_gbps=%.1f\n",
        (long long)r.c.tokens, r.c.experts, (long long)r.c.hidden, r.c.top_k, r.align, r.unpermute_ms, u, u / copy,
        u / kH200CopyGbps, copy);
  }
  std::fflush(stdout);
}

// ---- classic vs TMA row move ---------------------------------------------------------------------

struct ImplTimes {
  double whole_ms = -1, gpu_ms = -1, rows_ms = -1;  // -1: not measured (the path failed)
};

ImplTimes time_impl(Setup& s, PermuteRowKernel row_kernel, cudaStream_t stream) {
  ImplTimes t;
  auto exact = [&] { permute_pad_cuda(s.exact, s.b, stream, row_kernel); };
  auto map = [&] { permute_map_cuda(s.exact, s.b, stream); };
  t.whole_ms = median_ms(exact, stream);
  t.gpu_ms = median_gpu_ms([] {}, exact, stream);
  t.rows_ms = median_gpu_ms(
      map, [&] { permute_rows_cuda(s.exact, s.b, stream, row_kernel); }, stream);
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return t;
}

// The exact-size rows and probs after one permute with `row_kernel`, the device buffers poisoned first.
std::vector<unsigned char> impl_output(Setup& s, PermuteRowKernel row_kernel, cudaStream_t stream) {
  const size_t row_bytes = size_t(s.padded_rows) * s.b.row_bytes, prob_bytes = size_t(s.padded_rows) * 4;
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(s.b.rows, 0xff, row_bytes, stream));
  FLOWMOE_CUDA_CHECK(cudaMemsetAsync(s.b.probs, 0xff, prob_bytes, stream));
  permute_pad_cuda(s.exact, s.b, stream, row_kernel);
  std::vector<unsigned char> out(row_bytes + prob_bytes);
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(out.data(), s.b.rows, row_bytes, cudaMemcpyDeviceToHost, stream));
  FLOWMOE_CUDA_CHECK(cudaMemcpyAsync(out.data() + row_bytes, s.b.probs, prob_bytes, cudaMemcpyDeviceToHost, stream));
  FLOWMOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return out;
}

// One permute with `row_kernel`, watched: a kernel that never finishes would otherwise stall the whole
// run, so after 20 s this says so and exits.
void run_watched(Setup& s, PermuteRowKernel row_kernel, cudaStream_t stream) {
  permute_pad_cuda(s.exact, s.b, stream, row_kernel);
  Event done;
  done.record(stream);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  cudaError_t st;
  while ((st = cudaEventQuery(done.get())) == cudaErrorNotReady) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::printf(
          "bench_permute: the permute with row kernel %s did not finish within 20 s (T=%lld H=%lld "
          "align=%d); exiting\n",
          row_kernel == PermuteRowKernel::tma ? "tma" : "classic", (long long)s.c.tokens, (long long)s.c.hidden,
          s.align);
      std::fflush(stdout);
      std::_Exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  FLOWMOE_CUDA_CHECK(st);
}

// Both row-move kernels (kernels/permute.h, PermuteRowKernel: classic and tma) on every config in the same run:
// whole op (event-timed), GPU-only whole op and the row move alone, as fractions of copy ("BENCH permute_impl"),
// and whether their outputs are bit-identical. The other lines use the engine's choice
// (PermuteRowKernel::automatic). A failing TMA path is reported, not fatal.
// Classic then TMA on one config; prints its BENCH permute_impl line. Returns false when the TMA path
// failed (the device may be unusable afterwards).
bool compare_impls(Setup& s, double copy, double copy_gpu, cudaStream_t stream) {
  const ImplTimes classic = time_impl(s, PermuteRowKernel::classic, stream);
  ImplTimes tma;
  int identical = -1;  // -1: not compared
  bool ok = true;
  try {
    run_watched(s, PermuteRowKernel::tma, stream);
    identical =
        impl_output(s, PermuteRowKernel::classic, stream) == impl_output(s, PermuteRowKernel::tma, stream) ? 1 : 0;
    tma = time_impl(s, PermuteRowKernel::tma, stream);
  } catch (const std::exception& e) {
    std::printf("bench_permute: the TMA row move failed on T=%lld H=%lld align=%d: %s\n", (long long)s.c.tokens,
                (long long)s.c.hidden, s.align, e.what());
    ok = false;
  }
  const bool eligible = s.b.row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(s.b.x) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(s.b.rows) % 16 == 0;
  auto frac = [&](double ms, double ceiling) { return ms > 0 ? gbps(s.permute_bytes, ms) / ceiling : -1.0; };
  std::printf(
      "BENCH permute_impl T=%lld E=%d H=%lld k=%d align=%d dtype=bf16 classic_whole=%.4f tma_whole=%.4f "
      "classic_gpu=%.4f tma_gpu=%.4f classic_rows=%.4f tma_rows=%.4f classic_ms=%.4f tma_ms=%.4f "
      "classic_rows_ms=%.4f tma_rows_ms=%.4f tma_eligible=%d identical=%d copy_gbps=%.1f copy_gpu_gbps=%.1f\n",
      (long long)s.c.tokens, s.c.experts, (long long)s.c.hidden, s.c.top_k, s.align, frac(classic.whole_ms, copy),
      frac(tma.whole_ms, copy), frac(classic.gpu_ms, copy_gpu), frac(tma.gpu_ms, copy_gpu),
      frac(classic.rows_ms, copy_gpu), frac(tma.rows_ms, copy_gpu), classic.whole_ms, tma.whole_ms, classic.rows_ms,
      tma.rows_ms, int(eligible), identical, copy, copy_gpu);
  std::fflush(stdout);
  return ok;
}

}  // namespace

// The ceiling is the device's own D2D cudaMemcpyAsync bandwidth (read + write) measured in the same run; the
// H200 copy figure of DESIGN.md §6 (kH200CopyGbps) is reported beside it.
int main() {
  return bench_main("bench_permute", [&](const cudaDeviceProp& prop, cudaStream_t stream) {
    std::printf("bench_permute on %s: bf16 payload, random top-k routing, median of %d reps\n", prop.name, kReps);
    const CopyGbps ceiling = copy_gbps(stream, true);
    const double copy = ceiling.queued, copy_gpu = ceiling.gpu_only;
    std::printf("  device D2D copy (read + write): %.0f GB/s (%.3f of the H200's %.0f); GPU time only: %.0f GB/s\n",
                copy, copy / kH200CopyGbps, kH200CopyGbps, copy_gpu);

    std::mt19937_64 gen(2026);
    Rng rng(2026);
    std::vector<Result> results;
    for (const Config& c : kConfigs)
      for (int align : kAligns) {
        Setup s(c, align, gen, rng, stream);
        results.push_back(bench(s, stream));
      }
    print_results(results, copy, copy_gpu);

    // The same configs again (same routing and payload), classic against TMA.
    std::mt19937_64 gen2(2026);
    Rng rng2(2026);
    bool tma_ok = true;
    for (const Config& c : kConfigs)
      for (int align : kAligns)
        if (tma_ok) {
          Setup s(c, align, gen2, rng2, stream);
          tma_ok = compare_impls(s, copy, copy_gpu, stream);
        }
    if (!tma_ok) std::printf("bench_permute: stopped comparing after the TMA row move failed\n");
    FLOWMOE_CUDA_CHECK(cudaDeviceSynchronize());
  });
}
