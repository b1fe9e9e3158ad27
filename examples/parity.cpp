// `flowmoe parity` (see parity.h): the runs, one after another in this process, then the report.
#include "examples/parity.h"

#include <sys/stat.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/output_check.h"
#include "examples/args.h"
#include "examples/launch.h"
#include "io/file_io.h"
#include "parallel/collectives.h"
#include "studies/parity.h"
#include "train/trainer.h"

namespace flowmoe {

namespace fs = std::filesystem;

namespace {

const char* kParityHelp =
    R"(usage: flowmoe parity --config FILE --out DIR [--recipes bf16,fp8_blockwise,fp8_flow] [--steps N]
                      [--set section.key=value ...] [--candidate NAME:section.key=value ...]
                      [--controls N] [--control data|seed|eps]
                      [--layout-control] [--threshold 0.0025] [--margin 0.25] [--warmup-steps W]
                      [--ema-alpha 0.9] [--resume]

Trains the config once per precision recipe, on the same data, seed and config otherwise, and
compares each candidate's loss curve (an EMA, alpha 0.9 unless --ema-alpha) with the reference's, the
first recipe.
Two verdicts per candidate:
  against the bar   its largest relative EMA error after warmup is at most the threshold and no
                    step had a non-finite loss;
  against the noise with controls: its mean EMA error after warmup is at most (1 + margin) times the
                    largest of the controls' mean errors (the controls train the reference's recipe
                    perturbed, so their errors are the noise of the study; docs/TRAINING.md).
It also gives each run's final validation loss relative to the reference's, beside the controls'.
Writes DIR/<run>/ (each run), DIR/parity.json (the report) and DIR/parity.png (the curves and the
errors over the shaded noise band, when gnuplot or matplotlib is installed).
Exit status, with fewer than 2 controls: 0 every candidate passed the bar, 1 one failed. With 2 or more: 0
every candidate is within the noise and passed the bar; 1 one is outside the noise; 4 all are
within the noise but one failed the bar (the study's noise exceeds the threshold). 2: a usage or
config error.

options:
  --config FILE            the YAML config
  --out DIR                where the runs and the report go
  --recipes LIST           comma-separated precision.recipe values (bf16, fp8_blockwise, fp8_flow,
                           fp8_full), the reference first (default bf16,fp8_blockwise,fp8_flow)
  --steps N                train.steps of every run (default: the config's)
  --set section.key=value  override one key of every run (repeatable)
  --candidate NAME:section.key=value
                           one more candidate, DIR/NAME: the reference's recipe with this key
                           overridden (repeat the NAME to override several keys), judged like the
                           recipes; e.g. bf16_moments:optimizer.moment_dtype=bf16 (a setting, not
                           a recipe, against the same controls)
  --controls N             N runs of the reference recipe, each perturbed (--control), into
                           DIR/control1 .. DIR/controlN (DIR/control for one): the noise band,
                           reported like candidates but not judged; the noise verdict needs 2 or more
  --control data|seed|eps  the controls' perturbation, control k of N: data.seed + k (data: another
                           batch order, the same initialization), train.seed + k (seed: another
                           initialization), optimizer.eps x (1 + k) (eps); default data. Given
                           without --controls: one control
  --layout-control         with parallel.expert_parallel_size E above 1: one more control, the
                           reference's recipe at expert-parallel size 1 on the same processes (data
                           parallelism over the same global batch), into DIR/control_ep1: what
                           expert parallelism itself moves the loss by
  --threshold X            the largest relative EMA error that passes (default 0.0025, 0.25%)
  --margin X               the noise verdict's margin over the largest control (default 0.25)
  --warmup-steps W         compare steps after W only (default: optimizer.warmup_steps); W must be
                           below the steps
  --ema-alpha A            the loss curves' EMA, ema = A * ema + (1 - A) * loss, A in [0, 1) (default
                           0.9; 0 compares the raw losses): how the verdicts depend on the smoothing
  --resume                 keep the runs of DIR that finished (metrics up to the last step and its
                           checkpoint); continue an interrupted one from its newest checkpoint.
                           Refused when a run's config.yaml differs from the config it would get
                           now (another --set, --steps or config file), naming the first key
  -h, --help               this text

Under mpirun or srun every run trains on all the processes, as `flowmoe train` does; rank 0 writes
the report. Ctrl-C (SIGINT) or SIGTERM stops the current run after its step with a checkpoint and
exits with status 130 or 143; --resume continues it.
)";

constexpr const char* kParityJson = "parity.json";
constexpr const char* kParityPng = "parity.png";

struct ParityOptions {
  std::string config, out, control;
  int64_t num_controls = 0;
  double margin = 0.25;
  std::vector<std::string> recipes = {"bf16", "fp8_blockwise", "fp8_flow"};
  std::vector<std::string> sets;
  // --candidate: each named candidate's overrides, in the order first named.
  std::vector<std::pair<std::string, std::vector<std::string>>> candidates;
  int64_t steps = -1, warmup_steps = -1;
  double threshold = 0.0025;
  double ema_alpha = kParityEmaAlpha;
  bool resume = false;
  bool layout_control = false;
};

// One run of the study: its name (the directory under --out) and its --set list.
struct PlannedRun {
  std::string name;
  bool control = false;
  std::vector<std::string> sets;
  Config cfg;
};

double parse_number(const std::string& opt, const std::string& v, bool integer) {
  return non_negative_number("parity", opt, v, integer);
}

std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

// --candidate NAME:section.key=value: NAME a folder name of its own (letters, digits, '_', '-', '.'), not a
// recipe's or a control's (those folders are the study's too).
void add_candidate(ParityOptions& o, const std::string& v) {
  const size_t colon = v.find(':');
  const std::string name = colon == std::string::npos ? "" : v.substr(0, colon);
  const std::string set = colon == std::string::npos ? "" : v.substr(colon + 1);
  const bool plain = !name.empty() && name.find_first_not_of(
                                          "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                          "0123456789_-.") == std::string::npos;
  if (!plain || name == "." || name == ".." || set.find('=') == std::string::npos)
    throw UsageError(
        "parity: --candidate takes NAME:section.key=value with NAME of letters, digits, '_', '-' or "
        "'.', got '" +
        v + "'");
  if (name.rfind("control", 0) == 0)
    throw UsageError("parity: --candidate " + name + ": names starting with 'control' are the controls' folders");
  for (auto& c : o.candidates)
    if (c.first == name) {
      c.second.push_back(set);
      return;
    }
  o.candidates.push_back({name, {set}});
}

std::string format_g(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

ParityOptions parse(int argc, char** argv) {
  Args args(argc, argv, 2, kParityHelp);
  ParityOptions o;
  while (!args.done()) {
    const std::string a = args.next();
    if (a == "--config")
      o.config = args.value(a);
    else if (a == "--out")
      o.out = args.value(a);
    else if (a == "--recipes")
      o.recipes = split_list(args.value(a));
    else if (a == "--steps")
      o.steps = int64_t(parse_number(a, args.value(a), true));
    else if (a == "--set")
      o.sets.push_back(args.value(a));
    else if (a == "--candidate")
      add_candidate(o, args.value(a));
    else if (a == "--control")
      o.control = args.value(a);
    else if (a == "--controls")
      o.num_controls = int64_t(parse_number(a, args.value(a), true));
    else if (a == "--margin")
      o.margin = parse_number(a, args.value(a), false);
    else if (a == "--threshold")
      o.threshold = parse_number(a, args.value(a), false);
    else if (a == "--warmup-steps")
      o.warmup_steps = int64_t(parse_number(a, args.value(a), true));
    else if (a == "--ema-alpha")
      o.ema_alpha = parse_number(a, args.value(a), false);
    else if (a == "--resume")
      o.resume = true;
    else if (a == "--layout-control")
      o.layout_control = true;
    else
      throw UsageError("parity: unknown argument '" + a + "' (see flowmoe parity --help)");
  }
  if (o.config.empty() || o.out.empty()) throw UsageError("parity: --config FILE and --out DIR are required");
  if (o.recipes.size() < 2) throw UsageError("parity: --recipes needs the reference and at least one candidate");
  if (std::set<std::string>(o.recipes.begin(), o.recipes.end()).size() != o.recipes.size())
    throw UsageError("parity: --recipes names a recipe twice");
  for (const auto& c : o.candidates)
    if (std::find(o.recipes.begin(), o.recipes.end(), c.first) != o.recipes.end())
      throw UsageError("parity: --candidate " + c.first + " has a recipe's name, whose run folder it would share");
  if (!o.control.empty() && o.control != "eps" && o.control != "seed" && o.control != "data")
    throw UsageError("parity: --control is data, seed or eps, got '" + o.control + "'");
  if (o.num_controls > 64) throw UsageError("parity: --controls is at most 64, got " + std::to_string(o.num_controls));
  if (!o.control.empty() && o.num_controls == 0) o.num_controls = 1;
  if (o.control.empty()) o.control = "data";
  if (o.steps == 0) throw UsageError("parity: --steps needs at least 1");
  if (o.ema_alpha >= 1) throw UsageError("parity: --ema-alpha needs a number in [0, 1), got " + format_g(o.ema_alpha));
  return o;
}

// The runs, each config loaded (and so validated) before any trains.
std::vector<PlannedRun> plan_runs(const ParityOptions& o) {
  std::vector<std::string> common = o.sets;
  if (o.steps > 0) common.push_back("train.steps=" + std::to_string(o.steps));
  std::vector<PlannedRun> plan;
  auto add = [&](const std::string& name, const std::string& recipe, bool control, std::vector<std::string> extra) {
    PlannedRun p{name, control, common, {}};
    const std::string dir = (fs::path(o.out) / name).string();
    p.sets.push_back("precision.recipe=" + recipe);
    p.sets.push_back("logging.out_dir=" + dir);
    p.sets.push_back("checkpoint.dir=" + (fs::path(dir) / "checkpoints").string());
    p.sets.insert(p.sets.end(), extra.begin(), extra.end());
    p.cfg = load_config(o.config, p.sets);
    plan.push_back(std::move(p));
  };
  for (const std::string& r : o.recipes) add(r, r, false, {});
  for (const auto& [name, sets] : o.candidates) {
    add(name, o.recipes.front(), false, sets);  // an override may name another recipe
  }
  const Config ref = plan.front().cfg;  // a copy: the adds below grow `plan`, which may move its elements
  for (int64_t k = 1; k <= o.num_controls; ++k) {
    const std::string name = o.num_controls == 1 ? "control" : "control" + std::to_string(k);
    if (o.control == "eps")
      add(name, o.recipes.front(), true, {"optimizer.eps=" + format_g(double(1 + k) * ref.optimizer.eps)});
    else if (o.control == "seed")
      add(name, o.recipes.front(), true, {"train.seed=" + std::to_string(ref.train.seed + k)});
    else
      add(name, o.recipes.front(), true, {"data.seed=" + std::to_string(ref.data.seed + k)});
  }
  if (o.layout_control) {
    if (ref.parallel.expert_parallel_size <= 1)
      throw UsageError("parity: --layout-control compares expert parallelism with data parallelism, but " +
                       ref.origin("parallel.expert_parallel_size") + " sets parallel.expert_parallel_size " +
                       std::to_string(ref.parallel.expert_parallel_size));
    add("control_ep1", o.recipes.front(), true, {"parallel.expert_parallel_size=1"});
  }
  return plan;
}

// The verdicts compare the steps after this one: --warmup-steps, else the config's optimizer.warmup_steps.
int64_t compared_after(const ParityOptions& o, const Config& ref) {
  return o.warmup_steps >= 0 ? o.warmup_steps : ref.optimizer.warmup_steps;
}

// A warmup that covers every step leaves the verdicts nothing to compare: refused before any run trains,
// not after all of them.
void check_warmup(const ParityOptions& o, const Config& ref) {
  const int64_t warmup = compared_after(o, ref), steps = ref.train.steps;
  if (warmup < steps) return;
  const std::string w = o.warmup_steps >= 0 ? "--warmup-steps " + std::to_string(warmup)
                                            : "optimizer.warmup_steps " + std::to_string(warmup) + " (" +
                                                  ref.origin("optimizer.warmup_steps") + ")";
  const std::string n = o.steps > 0 ? "--steps " + std::to_string(steps)
                                    : "train.steps " + std::to_string(steps) + " (" + ref.origin("train.steps") + ")";
  throw UsageError("parity: " + w + " leaves no step to compare: the verdicts read the steps after the warmup, so " +
                   "it must be below " + n + "; give a smaller --warmup-steps or more --steps");
}

// A run directory that holds a finished run: metrics up to the last step and that step's checkpoint.
bool finished(const Config& cfg) {
  std::error_code ec;
  if (!fs::is_directory(cfg.run_dir(), ec)) return false;
  try {
    const std::vector<StepMetrics> rows = read_metrics(find_metrics_file(cfg.run_dir()));
    if (rows.empty() || rows.back().step != cfg.train.steps) return false;
  } catch (const IoError&) {
    return false;
  }
  return fs::exists(fs::path(checkpoint_path(cfg.checkpoint_dir(), cfg.train.steps)) / "meta.json", ec);
}

// The keys that place a run rather than shape it: parity sets them itself, and --resume adds checkpoint.resume.
// The earlier run's folder is found through them, so a moved or differently spelled --out is the same study.
const std::vector<std::string> kPlacementKeys = {"logging.out_dir", "checkpoint.dir", "checkpoint.resume"};

// Under --resume, a run in DIR made with another config (another --set, --steps or config file) would
// be kept or continued and judged as if it were this study's: refused, naming the first key that differs.
// Every run writes its resolved config.yaml before its first step, so a finished and an interrupted run
// both have one; a folder without it holds no steps to reuse.
void check_earlier_config(const PlannedRun& p) {
  const fs::path file = fs::path(p.cfg.run_dir()) / kRunConfigFile;
  std::error_code ec;
  if (!fs::exists(file, ec)) return;
  std::string diff;
  try {
    diff =
        first_changed_key(read_file(file.string(), kMaxConfigFileBytes, "config file"), to_yaml(p.cfg), kPlacementKeys);
  } catch (const ConfigError& e) {
    FLOWMOE_THROW(ConfigError, "parity: --resume: ", file.string(), ": ", e.what());
  }
  FLOWMOE_CHECK(diff.empty(), ConfigError, "parity: --resume: the ", p.name, " run in ", p.cfg.run_dir(),
                " was made with another config (", diff, "); give a new --out folder, or run without --resume to ",
                "train every run again");
}

// --out, created when missing, must be a folder; the report's files in it are checked before any run
// trains (with the config's files as the inputs), so a refusal never comes after hours of training.
void prepare_out_folder(const ParityOptions& o, const Config& cfg) {
  struct stat st {};
  if (::stat(o.out.c_str(), &st) == 0)
    FLOWMOE_CHECK(S_ISDIR(st.st_mode), ConfigError, "parity: --out '", o.out, "' is ", file_type_name(st),
                  ", not a folder; name a folder for the runs and the report");
  std::error_code ec;
  fs::create_directories(o.out, ec);
  FLOWMOE_CHECK(!ec, IoError, "parity: --out: ", os_error("create the folder", o.out, ec));
  for (const char* name : {kParityJson, kParityPng}) {
    const std::string path = (fs::path(o.out) / name).string();
    check_output_file("parity: the report '" + path + "' (in --out)", path, config_inputs(cfg));
  }
}

// The run's report entry from its metrics file, and from its TrainResult when it trained from step 1 now.
ParityRun collect(const PlannedRun& p, const TrainResult* trained) {
  ParityRun run;
  run.name = p.name;
  run.recipe = moe_recipe_name(p.cfg.precision.recipe);
  run.control = p.control;
  run.rows = read_metrics(find_metrics_file(p.cfg.run_dir()));
  char hash[32];
  std::snprintf(hash, sizeof hash, "%016" PRIx64, config_hash(to_yaml(p.cfg)));
  run.config_hash = hash;
  for (const StepMetrics& m : run.rows)
    if (std::isfinite(m.val_loss)) run.final_val_loss = m.val_loss;
  if (trained && trained->first_step == 1) {
    run.tokens_per_s = trained->tokens_per_s;
  } else {
    // The mean of the rows' rates: the run was kept or resumed, so no single TrainResult covers it.
    double sum = 0;
    for (const StepMetrics& m : run.rows) sum += m.tokens_per_s;
    run.tokens_per_s = run.rows.empty() ? 0 : sum / double(run.rows.size());
  }
  return run;
}

}  // namespace

int cmd_parity(int argc, char** argv) {
  const ParityOptions o = parse(argc, argv);
  std::vector<PlannedRun> plan = plan_runs(o);
  check_warmup(o, plan.front().cfg);
  const DistributedRuntime ranks = start_ranks(plan.front().cfg, "parity");
  const bool root = ranks.world->rank() == 0;
  const int world_size = ranks.world->size();
  if (root) prepare_out_folder(o, plan.front().cfg);
  // Before any run trains: a refusal after the first recipes would leave the study half redone.
  // An error on rank 0 ends the other ranks (main's error path).
  if (root && o.resume)
    for (const PlannedRun& p : plan) check_earlier_config(p);
  std::vector<ParityRun> runs;
  for (PlannedRun& p : plan) {
    // Rank 0 looks at the files; every rank must take the same decision, or one would train alone.
    double keep = o.resume && root && finished(p.cfg) ? 1 : 0;
    if (world_size > 1) keep = all_reduce_values(*ranks.world, {keep}, ReduceOp::max)[0];
    TrainResult result;
    if (keep > 0) {
      if (root) std::printf("parity: %s: kept the finished run in %s\n", p.name.c_str(), p.cfg.run_dir().c_str());
    } else {
      if (root) std::printf("parity: %s: training %s\n", p.name.c_str(), p.cfg.run_dir().c_str());
      std::fflush(stdout);
      // p.cfg stays the planned config: the report's hash then names the same config whether the run
      // was trained now, continued or kept.
      Config cfg = p.cfg;
      if (o.resume) {
        std::vector<std::string> sets = p.sets;
        sets.push_back("checkpoint.resume=true");
        cfg = load_config(o.config, sets);
      }
      TrainOptions opts;
      opts.world = ranks.world;
      opts.device = ranks.device;
      result = train(cfg, opts);
      if (result.interrupted) {  // every rank stops after the same step
        if (root)
          std::printf("parity: the %s run stopped at step %lld; the same command with --resume continues it\n",
                      p.name.c_str(), static_cast<long long>(result.last_step));
        return kParityInterrupted;
      }
    }
    if (root) runs.push_back(collect(p, keep > 0 ? nullptr : &result));
  }
  int status = 0;
  if (root) {
    ParityReport report =
        make_parity_report(std::move(runs), o.threshold, compared_after(o, plan.front().cfg), o.margin, o.ema_alpha);
    report.config = o.config;
    report.world_size = world_size;
    report.expert_parallel_size = int(plan.front().cfg.parallel.expert_parallel_size);
    const std::string json_path = (fs::path(o.out) / kParityJson).string();
    const std::string json = parity_json(report);
    write_file_synced(json_path, {&json});
    const std::string png = (fs::path(o.out) / kParityPng).string();
    std::error_code ec;
    fs::remove(png, ec);  // an earlier report's image would not match this one where no plotter draws it
    if (plot_parity(report, png))
      std::printf("parity: wrote %s and %s\n", json_path.c_str(), png.c_str());
    else
      std::printf("parity: wrote %s (no parity.png: neither gnuplot nor matplotlib is installed)\n", json_path.c_str());
    for (const ParityCandidate& c : report.candidates) std::printf("%s\n", parity_summary_line(report, c).c_str());
    status = report.exit_status();
  }
  if (world_size > 1) status = int(all_reduce_values(*ranks.world, {double(status)}, ReduceOp::max)[0]);
  return status;
}

}  // namespace flowmoe
