// bench_moe_layer: the MoE block (layers/moe.cpp) forward + backward on one GPU, routed experts only
// (n_shared_experts = 0), in each recipe (bf16, fp8_blockwise, fp8_flow), with and without
// moe_expert recompute, on these MoE layer shapes:
//   (T=16384, H=2048, F=1408, E=64, k=6) and (T=8192, H=1024, F=512, E=32, k=4).
// Reports time, TFLOP/s of the expert GEMMs against the ceilings of DESIGN.md §6, the ratios to a dense baseline
// and to the bf16 recipe, host syncs and peak memory (each explained where main computes it; docs/PERF.md has
// the figures). Times: CUDA events, median of 10 after 3 warm-ups; random data.
#include <algorithm>
#include <cstdio>
#include <vector>

#include "bench/bench_util.h"
#include "engine/allocator.h"
#include "kernels/common/device_api.h"
#include "kernels/grouped_linear.h"
#include "layers/moe.h"
#include "layers/param.h"

using namespace flowmoe;

namespace {

struct Shape5 {
  int64_t T, H, F, E, k;
};

ModelConfig layer_config(const Shape5& s) {
  ModelConfig c;
  c.hidden_size = s.H;
  c.num_hidden_layers = 8;
  c.n_routed_experts = s.E;
  c.num_experts_per_tok = s.k;
  c.moe_intermediate_size = s.F;
  c.n_shared_experts = 0;
  c.n_group = 1;
  c.topk_group = 1;
  return c;
}

}  // namespace

int main() {
  return bench_main("bench_moe_layer", [](const cudaDeviceProp& prop, cudaStream_t stream) {
    const Device dev = Device::cuda(0);
    std::printf("bench_moe_layer on %s: MoE block fwd+bwd, routed experts only, median of 10\n", prop.name);
    std::printf("%-24s %-14s %4s %4s %9s %9s %8s %8s %8s %6s %9s %9s %8s %8s %9s %9s\n", "T,H,F,E,k", "recipe", "rcmp",
                "strm", "layer ms", "TFLOP/s", "of ceil", "vs bf16", "layer/dn", "syncs", "peak GiB", "peak/bf16",
                "act GiB", "act/bf16", "saved GiB", "saved/bf16");
    for (const Shape5& s : {Shape5{16384, 2048, 1408, 64, 6}, Shape5{8192, 1024, 512, 32, 4}}) {
      ModelConfig cfg = layer_config(s);
      Rng rng(2);
      Tensor x = rng.normal({s.T, s.H}, 0.0, 1.0, DType::bf16, dev);
      Tensor dy = rng.normal({s.T, s.H}, 0.0, 1.0, DType::bf16, dev);

      // Dense baseline with the same expert FLOPs: T·k rows through one bf16 H→2F→F→H SwiGLU MLP (linear → swiglu →
      // linear, forward + backward through autograd): the ratio layer/dense is the price of routing, permutation
      // and splitting by expert.
      double dense_ms = 0;
      {
        ParamFactory fd(3, dev);
        Variable w1 = fd.normal("w1", {2 * s.F, s.H}, 0.02), w2 = fd.normal("w2", {s.H, s.F}, 0.02);
        Tensor xr = rng.normal({s.T * s.k, s.H}, 0.0, 1.0, DType::bf16, dev);
        Tensor dyr = rng.normal({s.T * s.k, s.H}, 0.0, 1.0, DType::bf16, dev);
        Variable xrv(xr, true);
        Variable w1b(w1.data().to(DType::bf16), true), w2b(w2.data().to(DType::bf16), true);
        auto dense = [&] {
          w1b.zero_grad(), w2b.zero_grad(), xrv.zero_grad();
          linear(swiglu(linear(xrv, w1b)), w2b).backward(dyr);
        };
        dense_ms = median_ms(dense, stream, 3, 10);
      }

      struct Run {
        MoeRecipe recipe;
        bool recompute;
        int streams;
      };
      std::vector<Run> runs;
      for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow})
        for (bool recompute : {false, true}) runs.push_back({recipe, recompute, 1});
      // The expert GEMMs spread over 4 streams (set_grouped_linear_streams), every recipe alike.
      for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow})
        runs.push_back({recipe, false, 4});
      runs.push_back({MoeRecipe::fp8_flow, true, 4});
      double bf16_ms = 0, bf16_peak = 0, bf16_act = 0, bf16_saved = 0;
      for (const Run& run : runs) {
        const MoeRecipe recipe = run.recipe;
        const bool recompute = run.recompute;
        set_grouped_linear_streams(run.streams);
        MoeOptions opt(16);
        opt.recipe = recipe;
        opt.recompute_expert = recompute;
        ParamFactory f(1, dev);
        MoeLayer layer(f, cfg, "model.layers.1.mlp", opt, dev);
        Variable xv(x, true);
        uint64_t syncs0 = 0, syncs1 = 0;
        auto step = [&] {
          for (Variable p : f.params()) p.zero_grad();
          xv.zero_grad();
          syncs0 = num_host_syncs();
          layer.forward(xv, DType::bf16).backward(dy);
          syncs1 = num_host_syncs();
        };
        const double layer_ms = median_ms(step, stream, 3, 10);
        // Peak memory: the caching allocator's peak live bytes over one forward + backward from a start with
        // no gradients held, above what was live before it (weights, inputs); "act" is that peak less the
        // step's own gradient outputs (the f32 weight grads and d_x, the same in every recipe): the activations
        // and temporaries that the recipe and recompute change. "saved" is what stays live between forward and
        // backward, less the output: the activations one layer keeps for its backward, the memory that grows
        // with depth and that moe_expert recompute exists to cut.
        for (Variable p : f.params()) p.zero_grad();
        xv.zero_grad();
        cuda_synchronize(0);
        reset_peak_memory(dev);
        const size_t live0 = memory_stats(dev).live_bytes;
        double saved_gib = 0;
        {
          Variable y = layer.forward(xv, DType::bf16);
          cuda_synchronize(0);
          saved_gib = double(memory_stats(dev).live_bytes - live0 - y.data().nbytes()) / double(1ull << 30);
          y.backward(dy);
        }
        cuda_synchronize(0);
        size_t grad_bytes = xv.grad().nbytes();
        for (const Variable& p : f.params()) grad_bytes += p.grad().defined() ? p.grad().nbytes() : 0;
        const double peak_gib = double(memory_stats(dev).peak_bytes - live0) / double(1ull << 30);
        const double act_gib = peak_gib - double(grad_bytes) / double(1ull << 30);
        // The bf16 baseline of the same stream setting (measured first in each group): the speedup and the
        // memory ratios are against it.
        if (recipe == MoeRecipe::bf16 && !recompute)
          bf16_ms = layer_ms, bf16_peak = peak_gib, bf16_act = act_gib, bf16_saved = saved_gib;

        // FLOPs counted: the expert GEMMs, 3 passes (fwd, dgrad, wgrad) x 2·(T·k)·(H·2F + F·H); the router's
        // small GEMM and the data movement are not counted (so TFLOP/s is a lower bound of the work done).
        // Ceilings (DESIGN.md §6): the measured BF16 grouped GEMM; blockwise FP8 via cuBLASLt.
        const double flops = 3.0 * 2.0 * double(s.T * s.k) * double(s.H * 2 * s.F + s.F * s.H);
        const double tflops = flops / (layer_ms * 1e-3) / 1e12;
        const double ceiling = recipe == MoeRecipe::bf16 ? 679.0 : 1275.0;
        char name[64];
        std::snprintf(name, sizeof name, "%lld,%lld,%lld,%lld,%lld", (long long)s.T, (long long)s.H, (long long)s.F,
                      (long long)s.E, (long long)s.k);
        std::printf("%-24s %-14s %4s %4d %9.3f %9.1f %8.3f %8.2f %8.2f %6llu %9.2f %9.2f %8.2f %8.2f %9.3f %9.2f\n",
                    name, moe_recipe_name(recipe), recompute ? "yes" : "no", run.streams, layer_ms, tflops,
                    tflops / ceiling, bf16_ms / layer_ms, layer_ms / dense_ms, (unsigned long long)(syncs1 - syncs0),
                    peak_gib, peak_gib / bf16_peak, act_gib, act_gib / bf16_act, saved_gib, saved_gib / bf16_saved);
        std::printf(
            "BENCH moe_layer %s recompute=%s streams=%d T=%lld H=%lld F=%lld E=%lld k=%lld ms=%.3f tflops=%.1f "
            "frac_ceiling=%.3f speedup_vs_bf16=%.2f ratio_dense=%.2f host_syncs=%llu peak_gib=%.2f "
            "peak_vs_bf16=%.2f act_gib=%.2f act_vs_bf16=%.2f saved_gib=%.3f saved_vs_bf16=%.2f\n",
            moe_recipe_name(recipe), recompute ? "yes" : "no", run.streams, (long long)s.T, (long long)s.H,
            (long long)s.F, (long long)s.E, (long long)s.k, layer_ms, tflops, tflops / ceiling, bf16_ms / layer_ms,
            layer_ms / dense_ms, (unsigned long long)(syncs1 - syncs0), peak_gib, peak_gib / bf16_peak, act_gib,
            act_gib / bf16_act, saved_gib, saved_gib / bf16_saved);
      }
      set_grouped_linear_streams(1);
    }
  });
}
