// The flowmoe command: train, eval, generate, prepare-data, plot, parity, fp8-error, export, import,
// walkthrough (and config-reference). Only main() catches: configuration and usage errors exit 2, other errors
// exit 1, a training run
// stopped by SIGINT or SIGTERM exits 128 + the signal number (130, 143) after saving a checkpoint, and
// one stopped by its stop file (train/stop_request.h) exits 0 after saving one.
// Under mpirun or srun, train and eval run data-parallel on every process (launch.h); rank 0 prints.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "dataset/data.h"
#include "examples/args.h"
#include "examples/fp8_error.h"
#include "examples/generate.h"
#include "examples/hf.h"
#include "examples/launch.h"
#include "examples/parity.h"
#include "examples/walkthrough.h"
#include "kernels/common/error.h"
#include "studies/plot.h"
#include "train/evaluation.h"
#include "train/memory_estimate.h"
#include "train/run_setup.h"
#include "train/trainer.h"

using namespace flowmoe;

namespace {

const char* kMainHelp = R"(usage: flowmoe <command> [options]

Trains DeepSeek-style decoder-only transformers described by a YAML config.

commands:
  train            train a model:          flowmoe train --config configs/tiny.yaml
  eval             validation loss of a checkpoint
  generate         text from a checkpoint: a prompt continued by sampling, with a K/V cache
  prepare-data     text files -> a token file (llm.c .bin format; byte-level or BPE tokens)
  plot             loss curves of one or several runs -> PNG
  parity           loss parity of precision recipes: one run each, a JSON report and a plot
  fp8-error        where FP8 error enters each expert GEMM, on a checkpoint's activations
  export           a checkpoint as a Hugging Face folder (--format hf: glm4_moe, or deepseek_v3 for MLA)
  import           a Hugging Face glm4_moe or deepseek_v3 folder as a config and a checkpoint to train from
  config-reference print every config key with its type, range and default (Markdown)
  walkthrough      one small fp8_flow MoE layer, forward and backward, step by step (docs/WALKTHROUGH.md)

Run `flowmoe <command> --help` for the options of a command.

--debug (anywhere on the line) or FLOWMOE_DEBUG=1 adds the source location to an error message.
)";

const char* kTrainHelp =
    R"(usage: flowmoe train --config FILE [--set section.key=value ...] [--resume [DIR]] [--print-config]
                     [--profile N]

Trains the model of the config. Outputs go to logging.out_dir (default runs/<config name>):
config.yaml (the resolved config), metrics.jsonl or metrics.csv, checkpoints/step_NNNNNNNN/.

options:
  --config FILE            the YAML config (see docs/TRAINING.md or `flowmoe config-reference`)
  --set section.key=value  override one key, validated like the file (repeatable),
                           e.g. --set train.steps=100 --set train.device=cpu
  --resume [DIR]           continue from the newest checkpoint in checkpoint.dir, or from DIR:
                           a checkpoint (checkpoints/step_NNNNNNNN) or a folder of them (its newest)
  --print-config           print the resolved config and exit
  --profile N              time step N op by op (forward, backward, optimizer) and print where the
                           step's time goes, by part, layer and op (also <out_dir>/profile.txt);
                           take a step after the first few, whose GEMM plans are still being made
  -h, --help               this text

Ctrl-C (SIGINT) or SIGTERM (timeout, Slurm, Kubernetes) stops the run with a checkpoint of the last
finished step and exits with status 130 or 143; --resume continues from it. One process drops the
step in progress at its next micro-batch; several finish it. A second signal stops at once, without
a checkpoint. `touch <logging.out_dir>/stop` does the same under any launcher (exit status 0; the
file is removed once honoured). Use it under mpirun, which passes a signal on to the ranks only to
kill them 1 s later, or give them time: OMPI_MCA_odls_base_sigkill_timeout=60 (docs/TRAINING.md).

Several processes (mpirun -np N or srun -n N in front of the command) train data-parallel:
train.batch_size is the global batch, split evenly over the processes; rank 0 prints and writes.
--set parallel.expert_parallel_size=E shares the routed experts out over groups of E processes.
)";

const char* kEvalHelp =
    R"(usage: flowmoe eval --config FILE --checkpoint DIR [--set section.key=value ...] [--batches N]

Prints the validation loss (and perplexity) of the weights in checkpoint DIR on the validation
split of the config's data. The model keys must match the checkpoint.

options:
  --config FILE            the YAML config of the run
  --checkpoint DIR         a checkpoint directory (e.g. runs/tiny/checkpoints/step_00000300)
  --set section.key=value  override one key (repeatable)
  --batches N              validation micro-batches (default: train.eval_batches), at most
                           the number of whole batches the validation split holds
  -h, --help               this text
)";

const char* kPrepareHelp = R"(usage: flowmoe prepare-data --output FILE [--bpe-vocab N | --tokenizer BPE]
                            [--exclude PATTERN ...] INPUT [INPUT ...]

Reads text files and writes their tokens as an llm.c-style token file: a 256 x int32 header (magic
20240520, version 1, token count), then uint16 tokens. By default a token is a byte (vocab 256);
--bpe-vocab trains a byte-level BPE tokenizer on the inputs and encodes them with it. A directory
is read recursively, its files in path order; binary files (a NUL byte in the first 8 KiB), the
output file and its tokenizer are skipped. Each file is encoded on its own. Train on the result
with data.source: tokens, data.path: FILE and model.vocab_size at least the vocab printed.

options:
  --output FILE        the token file to write (written to FILE.tmp, then renamed); refused
                       before any work when it is not a regular file, is an input, or lies in a
                       run or checkpoint folder
  --bpe-vocab N        train a BPE tokenizer of N tokens (257..65536: the 256 bytes, then one per
                       merge; fewer when no pair of tokens repeats) and save it beside the output
                       with the extension .bpe (data/books.bin -> data/books.bpe)
  --tokenizer BPE      encode with a tokenizer an earlier --bpe-vocab run saved
  --exclude PATTERN    skip the files below an input directory whose path relative to it, or one
                       of whose folders, matches the glob (* also matches /), e.g.
                       --exclude 'translations/*' (repeatable)
  -h, --help           this text
)";

const char* kPlotHelp = R"(usage: flowmoe plot RUN [RUN ...] [--output PNG] [--title TEXT]

Draws the training (and validation) loss of each run into one PNG. RUN is a run directory
(holding metrics.jsonl or metrics.csv) or a metrics file. Uses gnuplot, or Python's matplotlib.

options:
  --output PNG    the image to write (default loss.png); refused when it is not a regular file,
                  is a metrics file read, is a run folder's own file or lies in a checkpoint folder
  --title TEXT    the plot title (default "flowmoe loss")
  -h, --help      this text
)";

volatile std::sig_atomic_t g_stop_signal = 0;  // the signal that asked training to stop
bool g_quiet_signals = false;                  // a rank other than 0: rank 0 says it for all
bool g_several_ranks = false;                  // a launcher started more than one process

// SIGINT / SIGTERM: stop with a checkpoint (train() polls the request between micro-batches, or steps
// with several ranks). Either signal again ends the process at once, as the default action does: a
// checkpoint being written then stays a step_N.tmp, which a resume ignores.
void on_stop_signal(int sig) {
  g_stop_signal = sig;
  request_stop();
  std::signal(SIGINT, SIG_DFL);
  std::signal(SIGTERM, SIG_DFL);
  // With several ranks the checkpoint needs every rank to finish the step: a launcher also signals
  // the survivors when a rank dies, and then none is written, so the message does not promise one.
  const char one[] =
      "flowmoe: stopping at the next micro-batch and saving a checkpoint of the last finished step (signal again to "
      "stop at once)\n";
  const char several[] =
      "flowmoe: stopping after this step; its checkpoint is written once every rank has finished the step "
      "(none if a rank died: the last one stands; signal again to stop at once)\n";
  if (g_quiet_signals) return;
  const char* msg = g_several_ranks ? several : one;
  const size_t len = g_several_ranks ? sizeof several - 1 : sizeof one - 1;
  ssize_t ignored = ::write(STDERR_FILENO, msg, len);  // write() is async-signal-safe
  (void)ignored;
}

void install_stop_handlers() {
  g_quiet_signals = !is_root_rank();
  g_several_ranks = launch_world_size() > 1;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int cmd_train(int argc, char** argv) {
  Args args(argc, argv, 2, kTrainHelp);
  std::string config;
  std::vector<std::string> sets;
  std::string resume_set, resume_label;  // --resume becomes a --set; messages name it as typed
  bool print_only = false;
  int64_t profile_step = 0;
  while (!args.done()) {
    std::string a = args.next();
    if (a == "--config")
      config = args.value(a);
    else if (a == "--profile")
      profile_step = positive_integer("train", a, args.value(a), "a step number (1 or more)");
    else if (a == "--set")
      sets.push_back(args.value(a));
    else if (a == "--resume") {
      std::string dir;
      if (args.has_optional_value()) {
        dir = args.value(a);
        if (dir.empty()) throw UsageError("train: --resume= needs a directory (or give --resume alone)");
      }
      resume_set = "checkpoint.resume=" + (dir.empty() ? "true" : dir);
      resume_label = dir.empty() ? "--resume" : "--resume " + dir;
      sets.push_back(resume_set);
    } else if (a == "--print-config")
      print_only = true;
    else
      throw UsageError("train: unknown argument '" + a + "' (see flowmoe train --help)");
  }
  if (config.empty()) throw UsageError("train: --config FILE is required (try --config configs/tiny.yaml)");
  Config cfg = load_config(config, sets);
  if (!resume_set.empty() && cfg.origin("checkpoint.resume") == "--set " + resume_set)
    cfg.origins["checkpoint.resume"] = resume_label;  // unless a later --set replaced it
  if (print_only) {
    if (is_root_rank()) std::fputs(to_yaml(cfg).c_str(), stdout);
    return 0;
  }
  if (profile_step > cfg.train.steps)
    throw UsageError("train: --profile " + std::to_string(profile_step) +
                     " is past the run's last step (train.steps = " + std::to_string(cfg.train.steps) + ")");
  install_stop_handlers();
  const auto started = std::chrono::steady_clock::now();  // the summary's time line counts the ranks' start
  const DistributedRuntime ranks = start_ranks(cfg, "train");
  TrainOptions opts;
  opts.started = started;
  opts.world = ranks.world;
  opts.device = ranks.device;
  opts.profile_step = profile_step;
  TrainResult r = train(cfg, opts);
  if (!r.interrupted || r.last_step >= cfg.train.steps || g_stop_signal == 0) return 0;
  if (g_quiet_signals) return 128 + int(g_stop_signal);
  std::fprintf(stderr, "flowmoe: stopped by %s; exit status %d\n", g_stop_signal == SIGTERM ? "SIGTERM" : "SIGINT",
               128 + int(g_stop_signal));
  return 128 + int(g_stop_signal);
}

int cmd_eval(int argc, char** argv) {
  Args args(argc, argv, 2, kEvalHelp);
  CheckpointArgs run;
  int64_t batches = -1;
  std::string batches_label = "--batches ";  // where the count came from, for the cap message
  while (!args.done()) {
    const std::string a = args.next();
    if (run.take(args, a)) continue;
    if (a == "--batches")
      batches = positive_integer("eval", a, args.value(a));
    else
      throw UsageError("eval: unknown argument '" + a + "' (see flowmoe eval --help)");
  }
  run.require("eval");
  Config cfg = load_config(run.config, run.sets);
  if (batches < 0) {
    batches = cfg.train.eval_batches;
    batches_label = "train.eval_batches = ";
  }
  const DistributedRuntime ranks = start_ranks(cfg, "eval");
  const bool root = ranks.world->rank() == 0;
  // An expert-parallel run's checkpoint is evaluated under the same launch: the ranks share the experts
  // out again. It holds whole expert tensors, so any other number of processes evaluates it with every
  // rank holding all experts (a run's own config.yaml, evaluated in one process).
  const int64_t ep = cfg.parallel.expert_parallel_size;
  if (ep > 1 && ranks.world->size() % ep != 0) {
    if (root)
      std::printf(
          "eval: parallel.expert_parallel_size = %lld does not divide the %d rank%s; evaluating with "
          "expert_parallel_size 1 (the checkpoint holds whole expert tensors)\n",
          static_cast<long long>(ep), ranks.world->size(), ranks.world->size() == 1 ? "" : "s");
    cfg.parallel.expert_parallel_size = 1;
  }
  RunSetup setup(cfg, ranks.world, ranks.device);
  const DataLoader& data = setup.read_data();
  if (data.num_val_windows() == 0)
    throw UsageError("eval: the config holds out no validation data (data.val_fraction is 0)");
  const ValBatches val = whole_val_batches(data, batches, cfg.train.batch_size);
  if (val.capped && root) std::printf("eval: %s\n", val.cap_note(batches_label).c_str());
  batches = val.num_batches;
  const int64_t batch_size = val.batch_size;
  setup.check_fits(MemoryUse::eval);
  const Transformer& model = setup.build_model();
  const CheckpointMeta meta = setup.load_weights(run.checkpoint);
  if (root && !meta.unused_tensors.empty()) std::printf("eval: %s\n", partial_load_note(meta).substr(2).c_str());
  double loss = evaluate(model, data, batches, batch_size, ranks.world.get());
  if (!root) return 0;
  std::printf("checkpoint %s (step %lld) on %s: val loss %.4f | perplexity %.3f | %lld sequences of %lld tokens\n",
              run.checkpoint.c_str(), static_cast<long long>(meta.step), setup.device.str().c_str(), loss,
              std::exp(loss), static_cast<long long>(batches * batch_size), static_cast<long long>(cfg.data.seq_len));
  return 0;
}

// --bpe-vocab's value: a whole number from 257 to 65536 (0 must not pass for "no BPE").
int64_t parse_bpe_vocab(const std::string& v) {
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || errno == ERANGE || n <= 256 || n > 65536)
    throw UsageError(
        "prepare-data: --bpe-vocab needs a whole number from 257 to 65536 (the 256 bytes, then one "
        "token per merge; token files hold uint16 tokens), got '" +
        v + "'");
  return n;
}

int cmd_prepare(int argc, char** argv) {
  Args args(argc, argv, 2, kPrepareHelp);
  std::string output;
  std::vector<std::string> inputs;
  PrepareOptions opts;
  while (!args.done()) {
    std::string a = args.next();
    if (a == "--output" || a == "-o")
      output = args.value(a);
    else if (a == "--bpe-vocab")
      opts.bpe_vocab = parse_bpe_vocab(args.value(a));
    else if (a == "--tokenizer")
      opts.tokenizer = args.value(a);
    else if (a == "--exclude")
      opts.exclude.push_back(args.value(a));
    else if (a.rfind("-", 0) == 0)
      throw UsageError("prepare-data: unknown option '" + a + "' (see flowmoe prepare-data --help)");
    else
      inputs.push_back(a);
  }
  if (output.empty() || inputs.empty())
    throw UsageError("prepare-data: --output FILE and at least one input are required");
  const auto start = std::chrono::steady_clock::now();
  PreparedInputs read;
  int64_t n = prepare_token_file(inputs, output, &read, opts);
  std::printf("%s\n", read.summary().c_str());
  if (read.tokenizer.empty()) {
    std::printf("wrote %lld tokens (byte-level, vocab 256) to %s\n", static_cast<long long>(n), output.c_str());
    return 0;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (opts.bpe_vocab > 0)
    std::printf("trained a BPE tokenizer of vocab %lld%s on %lld words (%lld unique); wrote %s\n",
                static_cast<long long>(read.vocab_size),
                read.vocab_size < opts.bpe_vocab ? " (fewer than asked: no pair of tokens repeats)" : "",
                static_cast<long long>(read.num_words), static_cast<long long>(read.num_unique_words),
                read.tokenizer.c_str());
  std::printf(
      "wrote %lld tokens (BPE, vocab %lld, %.2f bytes per token) to %s in %.1f s; train with "
      "model.vocab_size >= %lld\n",
      static_cast<long long>(n), static_cast<long long>(read.vocab_size), n ? double(read.bytes()) / double(n) : 0.0,
      output.c_str(), seconds, static_cast<long long>(read.vocab_size));
  return 0;
}

int cmd_plot(int argc, char** argv) {
  Args args(argc, argv, 2, kPlotHelp);
  std::string output = "loss.png", title = "flowmoe loss";
  std::vector<std::string> runs;
  while (!args.done()) {
    std::string a = args.next();
    if (a == "--output" || a == "-o")
      output = args.value(a);
    else if (a == "--title")
      title = args.value(a);
    else if (a.rfind("-", 0) == 0)
      throw UsageError("plot: unknown option '" + a + "' (see flowmoe plot --help)");
    else
      runs.push_back(a);
  }
  if (runs.empty()) throw UsageError("plot: give at least one run directory or metrics file");
  plot_runs(runs, output, title);
  std::printf("wrote %s\n", output.c_str());
  return 0;
}

// --debug (anywhere on the command line) or FLOWMOE_DEBUG set to anything but "" or "0": error
// messages end with the source location that raised them.
bool debug_requested(std::vector<char*>& args) {
  const char* env = std::getenv("FLOWMOE_DEBUG");
  bool debug = env && *env && std::strcmp(env, "0") != 0;
  const auto flag = [](const char* a) { return std::strcmp(a, "--debug") == 0; };
  if (std::find_if(args.begin(), args.end(), flag) != args.end()) debug = true;
  args.erase(std::remove_if(args.begin(), args.end(), flag), args.end());
  return debug;
}

// "flowmoe: error: <message>" on one line, plus " (at file:line)" in debug mode; "[rank R] " before
// it on a rank other than 0 of a multi-process run.
void print_error(const std::exception& e, bool debug) {
  std::string line = detail::one_line(e.what());
  if (const auto* fe = dynamic_cast<const Error*>(&e); debug && fe && fe->file())
    line += " (at " + fe->location() + ")";
  const int rank = launch_rank();
  const std::string prefix = rank == 0 ? "" : "[rank " + std::to_string(rank) + "] ";
  std::fprintf(stderr, "%sflowmoe: error: %s\n", prefix.c_str(), line.c_str());
  std::fflush(stderr);
}

// The error's exit status; with several processes the others are ended too, so none waits forever.
int fail(const std::exception& e, bool debug, int status) {
  print_error(e, debug);
  end_other_ranks_after(e, status);
  return status;
}

int run(int argc, char** argv) {
  if (argc < 2) {
    std::fputs(kMainHelp, stderr);
    return 2;
  }
  std::string cmd = argv[1];
  if (cmd == "-h" || cmd == "--help" || cmd == "help") {
    std::fputs(kMainHelp, stdout);
    return 0;
  }
  if (cmd == "train") return cmd_train(argc, argv);
  if (cmd == "eval") return cmd_eval(argc, argv);
  if (cmd == "prepare-data") return cmd_prepare(argc, argv);
  if (cmd == "plot") return cmd_plot(argc, argv);
  if (cmd == "parity") {
    install_stop_handlers();  // a run stops with a checkpoint, as under `flowmoe train`
    const int status = cmd_parity(argc, argv);
    if (status != kParityInterrupted) return status;
    return g_stop_signal == 0 ? 0 : 128 + int(g_stop_signal);  // no signal: the run's stop file
  }
  if (cmd == "fp8-error") return cmd_fp8_error(argc, argv);
  if (cmd == "generate") return cmd_generate(argc, argv);
  if (cmd == "export") return cmd_export(argc, argv);
  if (cmd == "import") return cmd_import(argc, argv);
  if (cmd == "walkthrough") return cmd_walkthrough(argc, argv);
  if (cmd == "config-reference") {
    if (argc > 2) {
      std::fputs("usage: flowmoe config-reference\n\nPrints every config key as Markdown tables.\n", stdout);
      return std::strcmp(argv[2], "--help") == 0 || std::strcmp(argv[2], "-h") == 0 ? 0 : 2;
    }
    std::fputs(config_reference_markdown().c_str(), stdout);
    return 0;
  }
  throw UsageError("unknown command '" + cmd +
                   "' (commands: train, eval, generate, prepare-data, plot, parity, fp8-error, export, import, "
                   "config-reference, "
                   "walkthrough)");
}

// Runs the command; one that ended without starting the ranks meets its peers under a launcher
// (leave_together), named by how it ended: "train --print-config", "plot --help", "prepare-data".
int run_and_leave_together(int argc, char** argv) {
  std::string what = argc > 1 ? argv[1] : "";
  int status = 0;
  try {
    status = run(argc, argv);
    for (int i = 2; i < argc; ++i)
      if (std::strcmp(argv[i], "--print-config") == 0) what += " --print-config";
  } catch (const HelpShown&) {
    what += " --help";
  }
  leave_together(what);
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  // Several processes: CUDA loads every kernel when the process starts, not at its first launch. A lazy
  // load waits for the GPU's queue to drain, so a kernel first launched (a cuBLASLt GEMM for a new
  // shape, say) while an NCCL kernel waits for a peer would wait for that peer, and the peer may be
  // waiting for this process's next collective: a hang. A value the user set is kept.
  if (launch_world_size() > 1) setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  std::vector<char*> args(argv, argv + argc);
  const bool debug = debug_requested(args);
  args.push_back(nullptr);  // argv's terminator
  try {
    return run_and_leave_together(int(args.size()) - 1, args.data());
  } catch (const ConfigError& e) {
    return fail(e, debug, 2);
  } catch (const std::exception& e) {
    return fail(e, debug, 1);
  }
}
