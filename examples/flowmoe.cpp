// The flowmoe command: train, eval, prepare-data, plot (and config-reference).
// Only main() catches: configuration and usage errors exit 2, other errors exit 1, an interrupted
// training run exits 130 after saving a checkpoint.
#include <csignal>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine/error.h"
#include "engine/train/checkpoint.h"
#include "engine/train/config.h"
#include "engine/train/data.h"
#include "engine/train/metrics.h"
#include "engine/train/trainer.h"

using namespace flowmoe;

namespace {

class UsageError : public ConfigError {
  using ConfigError::ConfigError;
};
struct HelpShown {};  // --help: the text is printed, exit 0

const char* kMainHelp = R"(usage: flowmoe <command> [options]

Trains DeepSeek-style decoder-only transformers described by a YAML config.

commands:
  train            train a model:          flowmoe train --config configs/tiny.yaml
  eval             validation loss of a checkpoint
  prepare-data     text files -> a token file (llm.c .bin format, byte-level tokens)
  plot             loss curves of one or several runs -> PNG
  config-reference print every config key with its type, range and default (Markdown)

Run `flowmoe <command> --help` for the options of a command.
)";

const char* kTrainHelp = R"(usage: flowmoe train --config FILE [--set section.key=value ...] [--resume [DIR]] [--print-config]

Trains the model of the config. Outputs go to logging.out_dir (default runs/<config name>):
config.yaml (the resolved config), metrics.jsonl or metrics.csv, checkpoints/step_NNNNNNNN/.

options:
  --config FILE            the YAML config (see docs/TRAINING.md or `flowmoe config-reference`)
  --set section.key=value  override one key, validated like the file (repeatable),
                           e.g. --set train.steps=100 --set train.device=cpu
  --resume [DIR]           continue from the newest checkpoint in checkpoint.dir, or from DIR
  --print-config           print the resolved config and exit
  -h, --help               this text

Ctrl-C finishes the current step, saves a checkpoint and exits; --resume continues from it.
)";

const char* kEvalHelp = R"(usage: flowmoe eval --config FILE --checkpoint DIR [--set section.key=value ...] [--batches N]

Prints the validation loss (and perplexity) of the weights in checkpoint DIR on the validation
split of the config's data. The model keys must match the checkpoint.

options:
  --config FILE            the YAML config of the run
  --checkpoint DIR         a checkpoint directory (e.g. runs/tiny/checkpoints/step_00000300)
  --set section.key=value  override one key (repeatable)
  --batches N              validation micro-batches (default: train.eval_batches)
  -h, --help               this text
)";

const char* kPrepareHelp = R"(usage: flowmoe prepare-data --output FILE INPUT [INPUT ...]

Reads text files (or every file of a directory, sorted by name) as bytes and writes them, one
token per byte, as an llm.c-style token file: a 256 x int32 header (magic 20240520, version 1,
token count), then uint16 tokens. Train on it with data.source: tokens, data.path: FILE.

options:
  --output FILE   the token file to write (written to FILE.tmp, then renamed)
  -h, --help      this text
)";

const char* kPlotHelp = R"(usage: flowmoe plot RUN [RUN ...] [--output PNG] [--title TEXT]

Draws the training (and validation) loss of each run into one PNG. RUN is a run directory
(holding metrics.jsonl or metrics.csv) or a metrics file. Uses gnuplot, or Python's matplotlib.

options:
  --output PNG    the image to write (default loss.png)
  --title TEXT    the plot title (default "flowmoe loss")
  -h, --help      this text
)";

// A tiny argument reader: --opt VALUE, --opt=VALUE, flags and positionals.
class Args {
 public:
  Args(int argc, char** argv, int first, const char* help) : help_(help) {
    for (int i = first; i < argc; ++i) items_.push_back(argv[i]);
  }
  bool done() const { return pos_ >= items_.size(); }
  // The next item; a "--x=y" item is split so that value() returns y.
  std::string next() {
    std::string a = items_[pos_++];
    pending_.clear();
    has_pending_ = false;
    size_t eq = a.find('=');
    if (a.rfind("--", 0) == 0 && eq != std::string::npos) {
      pending_ = a.substr(eq + 1);
      has_pending_ = true;
      a = a.substr(0, eq);
    }
    if (a == "-h" || a == "--help") {
      std::fputs(help_, stdout);
      throw HelpShown{};
    }
    return a;
  }
  std::string value(const std::string& opt) {
    if (has_pending_) {
      has_pending_ = false;
      return pending_;
    }
    if (done()) throw UsageError(opt + " needs a value");
    return items_[pos_++];
  }
  // An optional value: the next item unless it is another option.
  bool has_optional_value() const { return has_pending_ || (!done() && items_[pos_].rfind("-", 0) != 0); }

 private:
  const char* help_;
  std::vector<std::string> items_;
  size_t pos_ = 0;
  std::string pending_;
  bool has_pending_ = false;
};

void on_sigint(int) {
  request_stop();
  std::signal(SIGINT, SIG_DFL);  // a second Ctrl-C ends the process at once
}

int cmd_train(int argc, char** argv) {
  Args args(argc, argv, 2, kTrainHelp);
  std::string config;
  std::vector<std::string> sets;
  bool print_only = false;
  while (!args.done()) {
    std::string a = args.next();
    if (a == "--config") config = args.value(a);
    else if (a == "--set") sets.push_back(args.value(a));
    else if (a == "--resume") sets.push_back("checkpoint.resume=" + (args.has_optional_value() ? args.value(a) : "true"));
    else if (a == "--print-config") print_only = true;
    else throw UsageError("train: unknown argument '" + a + "' (see flowmoe train --help)");
  }
  if (config.empty()) throw UsageError("train: --config FILE is required (try --config configs/tiny.yaml)");
  Config cfg = load_config(config, sets);
  if (print_only) {
    std::fputs(to_yaml(cfg).c_str(), stdout);
    return 0;
  }
  std::signal(SIGINT, on_sigint);
  TrainResult r = train(cfg);
  return r.interrupted && r.last_step < cfg.train.steps ? 130 : 0;
}

int cmd_eval(int argc, char** argv) {
  Args args(argc, argv, 2, kEvalHelp);
  std::string config, checkpoint;
  std::vector<std::string> sets;
  int64_t batches = -1;
  while (!args.done()) {
    std::string a = args.next();
    if (a == "--config") config = args.value(a);
    else if (a == "--checkpoint") checkpoint = args.value(a);
    else if (a == "--set") sets.push_back(args.value(a));
    else if (a == "--batches") {
      std::string v = args.value(a);
      char* end = nullptr;
      batches = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || batches < 1) throw UsageError("eval: --batches needs a positive integer, got '" + v + "'");
    } else {
      throw UsageError("eval: unknown argument '" + a + "' (see flowmoe eval --help)");
    }
  }
  if (config.empty() || checkpoint.empty()) throw UsageError("eval: --config FILE and --checkpoint DIR are required");
  Config cfg = load_config(config, sets);
  if (batches < 0) batches = cfg.train.eval_batches;
  Device device = resolve_device(cfg);
  DataLoader data = DataLoader::from_config(cfg);
  if (data.num_val_windows() == 0) throw UsageError("eval: the config holds out no validation data (data.val_fraction is 0)");
  Transformer model(cfg.model, device, compute_dtype_for(cfg, device), uint64_t(cfg.train.seed),
                    moe_options(cfg));
  CheckpointMeta meta = load_checkpoint(checkpoint, model.parameters(), nullptr, nullptr, model.buffers());
  double loss = evaluate(model, data, batches, cfg.train.batch_size);
  std::printf("checkpoint %s (step %lld) on %s: val loss %.4f | perplexity %.3f | %lld sequences of %lld tokens\n",
              checkpoint.c_str(), static_cast<long long>(meta.step), device.str().c_str(), loss, std::exp(loss),
              static_cast<long long>(batches * cfg.train.batch_size), static_cast<long long>(cfg.data.seq_len));
  return 0;
}

int cmd_prepare(int argc, char** argv) {
  Args args(argc, argv, 2, kPrepareHelp);
  std::string output;
  std::vector<std::string> inputs;
  while (!args.done()) {
    std::string a = args.next();
    if (a == "--output" || a == "-o") output = args.value(a);
    else if (a.rfind("-", 0) == 0) throw UsageError("prepare-data: unknown option '" + a + "' (see flowmoe prepare-data --help)");
    else inputs.push_back(a);
  }
  if (output.empty() || inputs.empty()) throw UsageError("prepare-data: --output FILE and at least one input are required");
  int64_t n = prepare_token_file(inputs, output);
  std::printf("wrote %lld tokens (byte-level, vocab 256) to %s\n", static_cast<long long>(n), output.c_str());
  return 0;
}

int cmd_plot(int argc, char** argv) {
  Args args(argc, argv, 2, kPlotHelp);
  std::string output = "loss.png", title = "flowmoe loss";
  std::vector<std::string> runs;
  while (!args.done()) {
    std::string a = args.next();
    if (a == "--output" || a == "-o") output = args.value(a);
    else if (a == "--title") title = args.value(a);
    else if (a.rfind("-", 0) == 0) throw UsageError("plot: unknown option '" + a + "' (see flowmoe plot --help)");
    else runs.push_back(a);
  }
  if (runs.empty()) throw UsageError("plot: give at least one run directory or metrics file");
  plot_runs(runs, output, title);
  std::printf("wrote %s\n", output.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
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
    if (cmd == "config-reference") {
      if (argc > 2) {
        std::fputs("usage: flowmoe config-reference\n\nPrints every config key as Markdown tables.\n", stdout);
        return std::strcmp(argv[2], "--help") == 0 || std::strcmp(argv[2], "-h") == 0 ? 0 : 2;
      }
      std::fputs(config_reference_markdown().c_str(), stdout);
      return 0;
    }
    throw UsageError("unknown command '" + cmd + "' (commands: train, eval, prepare-data, plot, config-reference)");
  } catch (const HelpShown&) {
    return 0;
  } catch (const ConfigError& e) {
    std::fprintf(stderr, "flowmoe: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "flowmoe: error: %s\n", e.what());
    return 1;
  }
}
