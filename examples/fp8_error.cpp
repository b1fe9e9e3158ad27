// `flowmoe fp8-error` (see fp8_error.h): options, the study, its table and JSON file.
#include "examples/fp8_error.h"

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "config/output_check.h"
#include "examples/args.h"
#include "io/file_io.h"
#include "io/run_files.h"
#include "studies/fp8_error.h"

namespace flowmoe {

namespace {

const char* kFp8ErrorHelp =
    R"(usage: flowmoe fp8-error --config FILE --checkpoint DIR [--batches N | --train-step S]
                        [--set section.key=value ...] [--json FILE]

Measures where FP8 error enters every routed expert GEMM, y[e] = x[e]·W[e]ᵀ, on the activations and
gradients of a trained model. Runs N batches (the validation split, else the first training windows)
forward and backward through the checkpoint's weights in bf16, takes each expert GEMM's x and dy as
they enter its weight gradient, and compares FP8 products with f64 ones (relative Frobenius error):
fprop and dgrad (dx[e] = dy[e]·W[e]) from rowwise 1x128 x and dy and 128x128 blocks of W, and the
weight gradient dW[e] = dy[e]ᵀ·x[e] from three colwise FP8 versions of x and dy:
  transpose   rowwise 1x128 quantize, then the scaling-aware transpose (the fp8_flow recipe)
  requantize  rowwise quantize, dequantize, colwise quantize (double quantization, fp8_blockwise)
  colwise     one colwise quantize of the bf16 operands (a floor: no recipe can skip the rowwise copy)
The table also gives x's and dy's rowwise quantization errors and the ratio requantize/transpose.
Last, the LM loss of the same batches through the same weights in each recipe (fp8_full where the
config's widths and data.seq_len take it): a loss gap between two runs that this does not show came
from their weights drifting apart, not from one step's arithmetic. One process; the device is
train.device.

options:
  --config FILE            the YAML config of the run
  --checkpoint DIR         a checkpoint directory (e.g. runs/x/checkpoints/step_00002000)
  --batches N              batches to run (default 1)
  --train-step S           instead, the batch the run trained on at step S (its data order), e.g. a
                           step where a parity study saw a loss spike; with the checkpoint of step
                           S - 1 it is that step as it ran
  --set section.key=value  override one key (repeatable), e.g. --set train.batch_size=4
  --json FILE              also write the figures as JSON; refused before the study when it is
                           not a regular file, is a file read, or lies in a run or checkpoint folder
  -h, --help               this text
)";

}  // namespace

int cmd_fp8_error(int argc, char** argv) {
  Args args(argc, argv, 2, kFp8ErrorHelp);
  CheckpointArgs run;
  std::string json;
  int64_t batches = 1, train_step = 0;
  while (!args.done()) {
    const std::string a = args.next();
    if (run.take(args, a)) continue;
    if (a == "--json")
      json = args.value(a);
    else if (a == "--batches")
      batches = positive_integer("fp8-error", a, args.value(a));
    else if (a == "--train-step")
      train_step = positive_integer("fp8-error", a, args.value(a));
    else
      throw UsageError("fp8-error: unknown argument '" + a + "' (see flowmoe fp8-error --help)");
  }
  run.require("fp8-error");
  const Config cfg = load_config(run.config, run.sets);
  if (!json.empty()) {  // before the study, which may take a while: a refusal after it would waste it
    std::vector<InputFile> inputs = config_inputs(cfg);
    for (const char* file : {kCheckpointModelFile, kCheckpointMetaFile})
      inputs.push_back({"checkpoint file", (std::filesystem::path(run.checkpoint) / file).string()});
    check_output_file("fp8-error: --json '" + json + "'", json, inputs, "fp8_error.json");
  }
  // The study runs in one process; a checkpoint holds whole expert tensors, so any run's config serves.
  if (cfg.parallel.expert_parallel_size > 1)
    std::printf("fp8-error: parallel.expert_parallel_size = %lld taken as 1: the study runs in one process\n",
                static_cast<long long>(cfg.parallel.expert_parallel_size));
  const Fp8ErrorStudy s = fp8_error_study(cfg, run.checkpoint, batches, train_step);
  const std::string n = std::to_string(s.num_batches);
  const std::string batches_read = s.split.rfind("step ", 0) == 0
                                       ? s.split + " batch" + (s.num_batches > 1 ? " (" + n + " micro-batches)" : "")
                                       : n + " " + s.split + (s.num_batches > 1 ? " batches" : " batch");
  std::printf("fp8-error: checkpoint %s (step %lld), %s, %lld tokens; errors relative to f64\n", s.checkpoint.c_str(),
              static_cast<long long>(s.step), batches_read.c_str(), static_cast<long long>(s.num_tokens));
  std::fputs(fp8_error_table(s).c_str(), stdout);
  if (!json.empty()) {
    const std::string text = fp8_error_json(s);
    write_file_synced(json, {&text});
    std::printf("wrote %s\n", json.c_str());
  }
  return 0;
}

}  // namespace flowmoe
