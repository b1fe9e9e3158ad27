// A training run's set-up (TrainRun's constructor: the resume target, the memory check, the folders and their
// locks, then through RunSetup the data, the model, the gradient reducer and the optimizer) and its summary (see
// run.h); its checkpoints are run_checkpoint.cpp's.
#include "train/run.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "checkpoint/checkpoint.h"
#include "checkpoint/hf_export.h"
#include "engine/allocator.h"
#include "engine/cast_stats.h"
#include "engine/host_threads.h"
#include "kernels/common/device_api.h"
#include "parallel/distributed.h"
#include "parallel/expert_parallel.h"
#include "train/memory_estimate.h"
#include "train/progress.h"

namespace flowmoe {

namespace fs = std::filesystem;

// ---- set-up -------------------------------------------------------------------------------------

// Where checkpoint.resume was given, for messages: "--resume DIR" as the user typed it (the
// command line records that origin), else "<file:line or --set>: checkpoint.resume".
static std::string resume_origin(const Config& cfg) {
  const std::string o = cfg.origin("checkpoint.resume");
  return o.rfind("--resume", 0) == 0 ? o : o + ": checkpoint.resume";
}

// The checkpoint to resume from: "" for a fresh start. A path is a checkpoint directory or a folder
// of them (a run's checkpoints/), whose newest complete one is taken. Problems are configuration errors.
static std::string resume_target(const Config& cfg, std::string* note) {
  const std::string& r = cfg.checkpoint.resume;
  if (r == "false") return "";
  if (r == "true") {
    std::string latest = latest_checkpoint(cfg.checkpoint_dir());
    if (latest.empty()) *note = "no checkpoint in " + cfg.checkpoint_dir() + " yet: starting from step 0";
    return latest;
  }
  std::error_code ec;
  if (fs::exists(fs::path(r) / "meta.json", ec)) return r;
  if (!fs::exists(r, ec)) throw ConfigError(resume_origin(cfg) + ": '" + r + "' does not exist");
  if (!fs::is_directory(r, ec))
    throw ConfigError(resume_origin(cfg) + ": '" + r + "' is not a checkpoint directory (it has no meta.json)");
  std::string latest = latest_checkpoint(r);
  if (latest.empty())
    throw ConfigError(resume_origin(cfg) + ": '" + r + "' holds no complete checkpoint (no step_N/meta.json)");
  return latest;  // train() reports "resumed from <it>"
}

// Removes the unfinished step_N.tmp directories a crash left in the checkpoint directory, saying so.
static void remove_unfinished_checkpoints(const Config& cfg, std::FILE* out) {
  const std::vector<std::string> removed = remove_stale_checkpoint_tmp(cfg.checkpoint_dir());
  if (removed.empty() || !out) return;
  std::string names;
  for (const std::string& n : removed) names += (names.empty() ? "" : ", ") + n;
  std::fprintf(out, "removed %zu unfinished checkpoint director%s from a previous run: %s\n", removed.size(),
               removed.size() == 1 ? "y" : "ies", names.c_str());
  std::fflush(out);
}

// ---- set-up --------------------------------------------------------------------------------------

// The opening line (parameters, device, the expected initial loss) and the memory estimate. Counted
// and sized from the config before anything is allocated, so a model that cannot fit is refused at
// once instead of allocating until the system kills the process.
static void check_memory(const RunSetup& setup, const ModelFlops& flops, Progress& progress) {
  const Config& cfg = setup.cfg;
  const Device device = setup.device;
  const int world_size = setup.world_size;
  Config per_rank = cfg;  // each rank runs its slice of every micro-batch
  per_rank.train.batch_size = cfg.train.batch_size / world_size;
  OptimizerShards shards;
  if (cfg.parallel.shard_optimizer) shards = {world_size, world_size / cfg.parallel.expert_parallel_size};
  const MemoryEstimate need = estimate_memory(per_rank, device, MemoryUse::train, shards);
  progress.message("flowmoe: " + format_count(double(need.num_parameters)) + " parameters (" +
                   std::to_string(cfg.model.num_hidden_layers) + " layers, hidden " +
                   std::to_string(cfg.model.hidden_size) + ", vocab " + std::to_string(cfg.model.vocab_size) + "), " +
                   format_flops(flops.flops_per_token) + " per token (forward + backward) on " + device.str() + ", " +
                   dtype_name(setup.compute) +
                   " compute; initial loss ~ ln(vocab) = " + format_fixed(std::log(double(cfg.model.vocab_size)), 3));
  if (!flops.peak_note().empty()) progress.message(flops.peak_note());
  const double available = available_memory_bytes(device);
  progress.message("memory: " + need.summary() + " of " + format_bytes(available) + " available on " + device.str() +
                   (world_size > 1 ? " (per rank)" : ""));
  check_fits(need, available, device.str());
}

// The run directory, with the resolved config written into it.
static std::string make_run_dir(const Config& cfg) {
  const std::string dir = cfg.run_dir();
  std::error_code ec;
  fs::create_directories(dir, ec);
  FLOWMOE_CHECK(!ec, IoError, "cannot create the run directory '", dir, "': ", ec.message());
  std::ofstream out(fs::path(dir) / kRunConfigFile);
  out << to_yaml(cfg);
  FLOWMOE_CHECK(out.good(), IoError, os_error("write", (fs::path(dir) / kRunConfigFile).string(), errno));
  return dir;
}

// Rank 0 locks the run directory and the checkpoint directory, wherever that lies: a second run into either
// is refused (DirLock names its pid) before it writes or removes anything there, also one whose own run
// directory differs but whose checkpoint.dir is this run's checkpoints/. The locks also prove both folders
// writable. A checkpoint directory that is the run directory itself is locked once: a second lock on the
// same file from this process would be refused by the first.
static std::vector<std::unique_ptr<DirLock>> lock_run_dirs(const Config& cfg, bool is_root) {
  std::vector<std::unique_ptr<DirLock>> locks;
  if (!is_root) return locks;
  locks.push_back(std::make_unique<DirLock>(cfg.run_dir(), "the run directory"));
  std::error_code ec;  // a checkpoint directory that does not exist yet is not the run directory, which does
  if (!fs::equivalent(cfg.checkpoint_dir(), cfg.run_dir(), ec))
    locks.push_back(std::make_unique<DirLock>(cfg.checkpoint_dir(), "the checkpoint directory", "checkpoint.dir"));
  return locks;
}

// What comes before the first allocation: the memory check, the cleanup of a crash's leftovers and
// the run directory (rank 0 alone touches the files; the others wait until it has). The result
// starts with the run directory's path.
// Rank 0's folder locks go into `locks` once the memory check has passed: a refused run writes nothing.
static TrainResult prepare_run(const RunSetup& setup, const ModelFlops& flops, std::FILE* out, Progress& progress,
                               std::vector<std::unique_ptr<DirLock>>& locks) {
  const Config& cfg = setup.cfg;
  check_memory(setup, flops, progress);
  locks = lock_run_dirs(cfg, setup.is_root);
  if (setup.is_root) remove_unfinished_checkpoints(cfg, out);
  TrainResult res;
  res.out_dir = setup.is_root ? make_run_dir(cfg) : cfg.run_dir();
  res.world_size = setup.world_size;
  if (setup.world_size > 1) setup.world->barrier();
  return res;
}

// train.batch_size is the global batch: it must split evenly over the ranks of `world` (null: this process
// alone). Checked on every rank alike, so all of them stop together, before the groups are split.
static std::shared_ptr<Communicator> checked_world(const Config& cfg, std::shared_ptr<Communicator> world) {
  const int n = world ? world->size() : 1;
  if (cfg.train.batch_size % n != 0)
    throw AllRanksConfigError(
        cfg.origin("train.batch_size") + ": train.batch_size: " + std::to_string(cfg.train.batch_size) +
        " sequences do not split evenly over " + std::to_string(n) +
        " processes (the batch is global: each rank reads batch_size / " + "processes of it); use a multiple of " +
        std::to_string(n) + ", or a number of processes that divides " + std::to_string(cfg.train.batch_size));
  return world;
}

// The data line, the resume note and a capped evaluation, before the first step.
static void announce_data(TrainRun& run, const std::string& init_note) {
  const Config& cfg = run.cfg;
  const TrainConfig& tc = cfg.train;
  const std::string source =
      cfg.data.source == DataSource::synthetic
          ? std::string("synthetic (") + enum_name(kSyntheticKindNames, cfg.data.synthetic_kind) + ")"
          : enum_name(kDataSourceNames, cfg.data.source);
  run.progress.message("data: " + source + ", " + std::to_string(run.setup.data().num_train_windows()) + " train / " +
                       std::to_string(run.setup.data().num_val_windows()) + " val sequences of " +
                       std::to_string(cfg.data.seq_len) + " tokens; " + std::to_string(tc.steps) + " steps x " +
                       std::to_string(run.tokens_per_step) + " tokens; outputs in " + run.res.out_dir);
  if (run.setup.world_size > 1) run.progress.message(describe_ranks(run.setup.parallel, cfg.train.batch_size));
  // OpenMPI binds each of 2 ranks to one core by default; the host work (the weights' draws, the
  // checkpoints) then runs on one thread, which made set-up 9x slower in a 2-GPU run.
  if (run.setup.world_size > 1 && usable_cpu_count() == 1 && machine_cpu_count() > 1)
    run.progress.message("host: rank 0 may run on 1 of " + std::to_string(machine_cpu_count()) +
                         " CPUs (the launcher's binding), so set-up draws the weights on one thread; " +
                         "mpirun --bind-to none lets every rank use the machine");
  if (!run.resume_note.empty()) run.progress.message(run.resume_note);
  if (!init_note.empty()) run.progress.message(init_note);
  if (run.metrics && !run.metrics->note().empty()) run.progress.message(run.metrics->note());
  if (run.val.capped) run.progress.message("evaluation: " + run.val.cap_note("train.eval_batches = "));
}

// The constants of the optimizer step's scalars (kernels/step_control.h).
static StepSchedule run_step_schedule(const Config& c) {
  StepSchedule p = step_schedule(c.optimizer, c.train.steps);
  p.num_micro_batches = int32_t(c.train.grad_accum_steps);
  p.bias_follows_lr = c.model.bias_update_schedule == BiasUpdateSchedule::lr;
  p.stop_on_nonfinite = c.train.nonfinite == NonfinitePolicy::stop;
  return p;
}

// checkpoint.init_from: a fresh run's weights from a Hugging Face folder (checkpoint/hf_export.h); a resumed run's
// come from its checkpoint. Returns the start-up line.
static std::string init_weights(const Config& c, Transformer& model, const std::string& resume_dir) {
  const std::string& from = c.checkpoint.init_from;
  if (from.empty()) return "";
  const std::string dir = from.substr(std::string(kInitFromHfPrefix).size());
  if (!resume_dir.empty())
    return "checkpoint.init_from " + from + " passed over: the resumed checkpoint holds the weights";
  std::string line = "weights from " + dir + " (checkpoint.init_from)";
  for (const std::string& note :
       load_hf_weights(dir, c.model, model.parameters(), model.parameter_shards(), model.buffers()))
    line += "; " + note;
  return line;
}

TrainRun::TrainRun(const Config& c, const TrainOptions& o)
    : clock(o.started),
      cfg(c),
      opts(o),
      setup(c, checked_world(c, o.world), o.device),
      flops(run_model_flops(c.model, c.data.seq_len, setup.device, setup.world_size)),
      resume_dir(resume_target(c, &resume_note)),
      progress(c.logging.progress, c.train.steps, c.logging.log_every, setup.is_root ? o.out : nullptr),
      res(prepare_run(setup, flops, setup.is_root ? o.out : nullptr, progress, dir_locks)),
      loop(setup.device, run_step_schedule(c)),
      tokens_per_step(c.train.batch_size * c.data.seq_len * c.train.grad_accum_steps),
      end(o.stop_after >= 0 ? std::min(c.train.steps, o.stop_after) : c.train.steps) {
  setup.read_data();
  clock.lap("data");
  Transformer& model = setup.build_model();
  clock.lap("model");
  // checkpoint.init_from's weights are loaded before the reducer and the optimizer take their copies of them.
  const std::string init_note = init_weights(c, model, resume_dir);
  setup.build_optimizer();
  clock.lap("optimizer");
  model.set_recompute_attention(c.train.recomputes("attention"));
  model.set_mtp_loss_weight(c.train.mtp_loss_weight);
  if (c.parallel.dual_microbatch) {
    const int64_t per_rank = c.train.batch_size / setup.world_size;
    if (per_rank % 2 != 0)
      throw ConfigError(c.origin("parallel.dual_microbatch") + ": parallel.dual_microbatch: each rank's batch (" +
                        std::to_string(per_rank) + " sequences: train.batch_size " +
                        std::to_string(c.train.batch_size) + " over " + std::to_string(setup.world_size) +
                        " processes) must be even to split into two halves");
    model.set_dual_microbatch(true);
  }
  // Zero-sync receive buffers of a capacity, not the worst case: a step that needs more is void and runs again
  // with larger ones (complete_step).
  const int64_t ep = setup.parallel.expert_parallel_size;
  if (c.parallel.ep_capacity_factor > 0 && ep > 1) {
    const std::string e =
        capacity_factor_error(c.parallel.ep_capacity_factor, !model.exchanges_zero_sync(),
                              "parallel.ep_dispatch " + std::string(ep_dispatch_name(c.parallel.ep_dispatch)) +
                                  " at expert-parallel size " + std::to_string(ep));
    if (!e.empty()) throw ConfigError(c.origin("parallel.ep_capacity_factor") + ": parallel.ep_capacity_factor: " + e);
    loop.exchange_overflow = Tensor::zeros({1}, DType::i32, setup.device);
    model.set_exchange_buffers(c.parallel.ep_capacity_factor, 0, loop.exchange_overflow);
  }
  // Process-wide, as the streams are: the grouped GEMMs leave these SMs to the exchange kernels beside them.
  if (setup.device.is_cuda() && model.overlaps_exchanges()) cuda_set_comm_sms(int(c.parallel.exchange_sms));
  if (GradientReducer* reducer = setup.reducer(); reducer && reducer->sharded()) {
    reducer->set_stages(model.parameter_stages());
    model.set_stage_hook([reducer](int64_t stage) { reducer->wait_stage(stage); });
  }
  if (!resume_dir.empty()) {
    const CheckpointMeta meta = resume_from_checkpoint(setup, resume_dir);
    loop.step = meta.step;
    loop.skipped = meta.skipped_steps;
    resume_note = "resumed from " + resume_dir + " at step " + std::to_string(meta.step) + partial_load_note(meta);
    clock.lap("checkpoint load");
  }
  loop.step_state.reset(loop.step, setup.optimizer().num_updates());
  res.first_step = loop.step + 1;
  res.skipped_steps = loop.skipped;
  res.metrics_file =
      (fs::path(res.out_dir) / (std::string("metrics.") + enum_name(kMetricsFormatNames, cfg.logging.metrics_format)))
          .string();
  if (setup.is_root) metrics.emplace(res.metrics_file, cfg.logging.metrics_format, resume_dir.empty() ? -1 : loop.step);

  const TrainConfig& tc = cfg.train;
  if (setup.data().num_val_windows() > 0) val = whole_val_batches(setup.data(), tc.eval_batches, tc.batch_size);
  announce_data(*this, init_note);
  // Casts are reported per MoE layer and micro-batch (what one forward + backward of a layer makes).
  cast_divisor = double(model.num_moe_layers() * tc.grad_accum_steps);
  clock.lap("rest");
}

// ---- the summary -------------------------------------------------------------------------------

// Where each explicit cast of the last step happened (DESIGN.md §1: the published flow has 2).
static void print_cast_summary(TrainRun& run) {
  const CastCounts& casts = run.loop.last_casts;
  std::string line = "casts per MoE layer per micro-batch (" + std::string(moe_recipe_name(run.cfg.precision.recipe)) +
                     "): " + format_fixed(double(casts.activation_casts()) / run.cast_divisor, 1);
  for (const auto& [site, n] : casts.by_site)
    if (site.rfind("weight_quantize", 0) != 0)
      line += " | " + site + " x" + format_fixed(double(n) / run.cast_divisor, 1);
  run.progress.message(line);
}

// "time: 41.3 s in all: set-up 12.1 s (start-up 3.2, model 8.4, ...), training 3.0 s, evaluation 0.4 s,
// checkpoints 25.7 s, other 0.2 s", set-up parts of 0.05 s or more named. Set-up, evaluation and
// checkpoints are what tokens/s leaves out; "other" is the loop's own time and the summary's collectives.
static void print_times(TrainRun& run) {
  const RunClock& c = run.clock;
  const double total = c.whole.running();
  double setup = 0;
  std::string parts;
  for (const auto& [name, seconds] : c.setup) {
    setup += seconds;
    if (seconds >= 0.05) parts += (parts.empty() ? "" : ", ") + name + " " + format_fixed(seconds, 1);
  }
  const double other = total - setup - run.loop.time.seconds() - c.evaluation.seconds() - c.checkpoints.seconds();
  run.progress.message(
      "time: " + format_fixed(total, 1) + " s in all: set-up " + format_fixed(setup, 1) + " s" +
      (parts.empty() ? "" : " (" + parts + ")") + ", training " + format_fixed(run.loop.time.seconds(), 1) +
      " s, evaluation " + format_fixed(c.evaluation.seconds(), 1) + " s, checkpoints " +
      format_fixed(c.checkpoints.seconds(), 1) + " s, other " + format_fixed(std::max(other, 0.0), 1) + " s");
}

static void print_summary(TrainRun& run, double peak_mem_bytes) {
  const TrainResult& res = run.res;
  std::string line = "done: step " + std::to_string(run.loop.step) + "/" + std::to_string(run.cfg.train.steps) +
                     " in " + format_duration(run.loop.time.seconds()) + " | loss " +
                     format_fixed(res.losses.front(), 4) + " -> " + format_fixed(res.losses.back(), 4);
  if (!std::isnan(res.final_val_loss)) line += " | val loss " + format_fixed(res.final_val_loss, 4);
  line += " | " + format_rate(res.tokens_per_s) + " tok/s" +
          model_flops_fields(run.flops.tflops(res.tokens_per_s), run.flops.mfu(res.tokens_per_s)) + " | peak mem " +
          format_fixed(peak_mem_bytes / (1 << 20), 1) + " MiB";
  if (run.setup.world_size > 1) line += " (max over ranks) | " + std::to_string(run.setup.world_size) + " ranks";
  run.progress.message(line);
  if (run.cast_divisor > 0) print_cast_summary(run);
  run.progress.message("metrics: " + res.metrics_file +
                       (res.last_checkpoint.empty() ? "" : " | checkpoint: " + res.last_checkpoint));
}

TrainResult finish_run(TrainRun& run) {
  run.progress.finish();
  TrainResult& res = run.res;
  const bool stopped = res.interrupted;  // by a stop request (trainer.cpp said so), maybe before any step
  res.last_step = run.loop.step;
  res.skipped_steps = run.loop.skipped;
  res.interrupted = res.interrupted || run.loop.step < run.cfg.train.steps;
  res.tokens_per_s =
      run.loop.time.seconds() > 0 ? double(run.tokens_per_step * run.loop.steps_done) / run.loop.time.seconds() : 0;
  const double peak =
      all_reduce_values(*run.setup.world, {double(memory_stats(run.setup.device).peak_bytes)}, ReduceOp::max)[0];
  if (run.loop.steps_done > 0)
    print_summary(run, peak);
  else if (!stopped)
    run.progress.message("nothing to do: the run is already at step " + std::to_string(run.loop.step) + " of " +
                         std::to_string(run.cfg.train.steps));
  print_times(run);
  return std::move(res);
}

}  // namespace flowmoe
