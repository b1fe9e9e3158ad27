// The library in one page: a DeepSeek-style MoE layer (layers/moe.h) trained for a few steps on a tiny regression
// task, once per precision recipe, printing the loss and the FP8 casts of each step. Read this before the
// `flowmoe` command (flowmoe.cpp), which does the same for a whole transformer from a YAML config.
//   build/flowmoe_example_moe                  on the CPU (f32 compute; the FP8 recipes round as on the GPU)
//   build/flowmoe_example_moe --device cuda    on the GPU (bf16 compute), in a CUDA build
//   build/flowmoe_example_moe --steps 20
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "engine/cast_stats.h"
#include "engine/ops/ops.h"
#include "engine/rng.h"
#include "kernels/common/device_api.h"
#include "layers/model_config.h"
#include "layers/moe.h"
#include "layers/param.h"
#include "train/train_options.h"

using namespace flowmoe;

namespace {

// The layer's shape. FP8 blocks are 128 wide, so the FP8 recipes need H and F to be multiples of 128.
constexpr int64_t kTokens = 256, kHidden = 128, kExpertWidth = 128;
// Large for SGD because the loss is a mean over all T·H output elements, which makes each gradient small.
constexpr double kLearningRate = 20;

// One recipe from the same seed: the same weights, the same data, so the recipes differ only in how they round.
void train_one_recipe(MoeRecipe recipe, Device device, int num_steps) {
  // ---- set-up ----------------------------------------------------------------------------------
  // The HF/DeepSeek-V3 config keys the layer reads: 4 routed experts of which each token takes 2, one shared
  // expert that every token goes through. initializer_range: the weights' standard deviation.
  ModelConfig cfg;
  cfg.hidden_size = kHidden;
  cfg.n_routed_experts = 4;
  cfg.num_experts_per_tok = 2;
  cfg.moe_intermediate_size = kExpertWidth;
  cfg.n_shared_experts = 1;
  cfg.initializer_range = 0.1;
  MoeOptions options;
  options.recipe = recipe;
  // The factory draws every parameter from one seeded Rng on the host, so a seed gives the same weights on the
  // CPU and the GPU; it keeps the list of parameters that the update below walks.
  ParamFactory params(/*seed=*/1, device);
  MoeLayer layer(params, cfg, "mlp", options, device);
  // The dtype outside the FP8 GEMMs, as the trainer picks it: bf16 on the GPU, f32 on the CPU. The FP8 recipes
  // quantize the same way on either: the CPU's quantize matches the GPU's bit for bit.
  const DType compute = compute_dtype_for(device);

  // The task: learn y = (x·W)² for a fixed random W, on one batch of tokens. A smooth teacher that the experts'
  // SwiGLU can fit keeps the example about the layer, not about the data; one fixed batch makes the loss fall
  // in a handful of steps.
  Rng data_rng(/*seed=*/7);
  const Tensor x = data_rng.uniform({kTokens, kHidden}, -1.0, 1.0, DType::f32, device);
  Variable teacher(data_rng.normal({kHidden, kHidden}, 0.0, 1.0 / std::sqrt(double(kHidden)), DType::f32, device));
  Tensor target;
  {
    NoGradGuard no_graph;  // the target is data: nothing learns through it
    Variable z = matmul(Variable(x), teacher);
    target = mul(z, z).data();
  }
  const Variable minus_target(tensor_scale(target, -1.0));

  std::printf("%s\n", moe_recipe_name(recipe));
  for (int step = 1; step <= num_steps; ++step) {
    // Counted per step: the layer notes each quantize and dequantize it makes (engine/cast_stats.h).
    reset_cast_counts();

    // ---- forward ---------------------------------------------------------------------------------
    // x is data: no gradient. In a model it would be the previous block's output and ask for one.
    Variable input(x.to(compute), /*requires_grad=*/false);
    Variable y = layer.forward(input, compute);  // router → dispatch → experts → combine → + shared expert

    // ---- loss: mean squared error, in f32 whatever the compute dtype --------------------------------
    Variable diff = add(cast(y, DType::f32), minus_target);
    Variable loss = mean(mul(diff, diff));

    // ---- backward --------------------------------------------------------------------------------
    // Fills .grad() of every parameter; the FP8 recipes run their backward GEMMs in FP8 too.
    loss.backward();

    // ---- update: plain SGD on the f32 master weights ----------------------------------------------
    // set_data bumps the weight's version, which is how the FP8 recipes know to quantize it again
    // (engine/fp8_weight.h): once per update, not once per use.
    for (Variable& p : params.params()) {
      if (!p.grad().defined()) continue;  // a parameter this step's backward did not reach
      p.set_data(tensor_add(p.data(), tensor_scale(p.grad().to(DType::f32), -kLearningRate)));
      p.zero_grad();
    }
    // The trainer would also move each expert's routing bias toward an even load here (aux-loss-free
    // balancing, MoeLayer::update_bias, driven by its step scalars); the example keeps the routing as it is.

    // ---- print -----------------------------------------------------------------------------------
    // Activation casts are the quantizes and dequantizes of activations and gradients: fp8_flow makes 2 (x
    // before dispatch, dy before the gradient's dispatch) where fp8_blockwise makes 10 (each GEMM casts its own
    // operands); fp8_full adds its shared expert's casts, its linears in FP8 too. Weight quantizes are counted
    // apart: the two expert weights (and fp8_full's three shared-expert weights), once per update.
    const CastCounts casts = cast_counts();
    std::printf("  step %d  loss %.6f  activation casts %lld  weight quantizes %lld\n", step,
                loss.data().to_doubles()[0], static_cast<long long>(casts.activation_casts()),
                static_cast<long long>(casts.weight_quantize));
  }
}

}  // namespace

int main(int argc, char** argv) {
  Device device = Device::cpu();
  int num_steps = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--device" && i + 1 < argc && std::strcmp(argv[i + 1], "cuda") == 0) {
      device = Device::cuda();
      ++i;
    } else if (arg == "--device" && i + 1 < argc && std::strcmp(argv[i + 1], "cpu") == 0) {
      ++i;
    } else if (arg == "--steps" && i + 1 < argc && std::atoi(argv[i + 1]) > 0) {
      num_steps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--device cpu|cuda] [--steps N]\n", argv[0]);
      return 2;
    }
  }
  if (device.is_cuda() && !cuda_available()) {
    std::fprintf(stderr, "--device cuda: no CUDA device (or a CPU-only build)\n");
    return 2;
  }
  try {
    for (MoeRecipe recipe : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow, MoeRecipe::fp8_full})
      train_one_recipe(recipe, device, num_steps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
