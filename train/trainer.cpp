// The training run: its set-up, the loop around train_step(), evaluation, checkpoints and the
// summary (see trainer.h).
#include "train/trainer.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "engine/allocator.h"
#include "engine/cast_stats.h"
#include "engine/host_threads.h"
#include "kernels/common/device_api.h"
#include "parallel/backends.h"
#include "parallel/distributed.h"
#include "train/checkpoint.h"
#include "train/data_parallel.h"
#include "train/expert_parallel.h"
#include "train/memory_estimate.h"
#include "train/progress.h"
#include "train/step_profile.h"
#include "train/train_step.h"

namespace flowmoe {

namespace fs = std::filesystem;

static std::atomic<bool> g_stop_requested{false};
void request_stop() { g_stop_requested = true; }

Device resolve_device(const Config& cfg) {
  const std::string& d = cfg.train.device;
  if (d == "cpu") return Device::cpu();
  if (d == "cuda") {
    if (!cuda_available())
      throw ConfigError(cfg.origin("train.device") + ": train.device: cuda was requested, but " +
                        (built_with_cuda() ? "no CUDA device is usable" : "this build has no CUDA backend") +
                        " (use auto or cpu)");
    return Device::cuda(0);
  }
  return cuda_available() ? Device::cuda(0) : Device::cpu();
}

DType compute_dtype_for(const Config& cfg, Device device) {
  // Every recipe computes in bf16 on the GPU outside the FP8 expert GEMMs (and fp32 on the CPU).
  (void)cfg;
  return device.is_cuda() ? DType::bf16 : DType::f32;
}

MoeOptions moe_options(const Config& cfg) {
  MoeOptions o(int(cfg.precision.align_size));
  o.recipe = moe_recipe_from_name(cfg.precision.recipe);
  o.recompute_expert = cfg.train.recomputes("moe_expert");
  o.ep_dispatch = ep_dispatch_from_name(cfg.parallel.ep_dispatch);
  return o;
}

MoeOptions moe_options(const Config& cfg, const ParallelState& ps) {
  MoeOptions o = moe_options(cfg);
  if (ps.expert_parallel_size > 1) o.expert_parallel = ps.expert_parallel;
  return o;
}

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
static void check_memory(const Config& cfg, Device device, DType compute, int world_size, Progress& progress) {
  Config per_rank = cfg;  // each rank runs its slice of every micro-batch
  per_rank.train.batch_size = cfg.train.batch_size / world_size;
  const MemoryEstimate need = estimate_memory(per_rank, device);
  progress.message("flowmoe: " + format_count(double(need.num_parameters)) + " parameters (" +
                   std::to_string(cfg.model.num_hidden_layers) + " layers, hidden " +
                   std::to_string(cfg.model.hidden_size) + ", vocab " + std::to_string(cfg.model.vocab_size) +
                   ") on " + device.str() + ", " + dtype_name(compute) + " compute; initial loss ~ ln(vocab) = " +
                   format_fixed(std::log(double(cfg.model.vocab_size)), 3));
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
  std::ofstream out(fs::path(dir) / "config.yaml");
  out << to_yaml(cfg);
  FLOWMOE_CHECK(out.good(), IoError, "cannot write '", (fs::path(dir) / "config.yaml").string(), "'");
  return dir;
}

// Rank 0 locks the run directory, and the checkpoint directory when it is not inside that one: a second
// run into either is refused (DirLock names its pid) before it writes or removes anything there.
static std::vector<std::unique_ptr<DirLock>> lock_run_dirs(const Config& cfg, bool is_root) {
  std::vector<std::unique_ptr<DirLock>> locks;
  if (!is_root) return locks;
  locks.push_back(std::make_unique<DirLock>(cfg.run_dir(), "the run directory"));
  std::error_code ec;
  const fs::path run = fs::weakly_canonical(cfg.run_dir(), ec), ckpt = fs::weakly_canonical(cfg.checkpoint_dir(), ec);
  const auto [end, ignored] = std::mismatch(run.begin(), run.end(), ckpt.begin(), ckpt.end());
  if (end != run.end()) locks.push_back(std::make_unique<DirLock>(cfg.checkpoint_dir(), "the checkpoint directory"));
  return locks;
}

// What comes before the first allocation: the memory check, the cleanup of a crash's leftovers and
// the run directory (rank 0 alone touches the files; the others wait until it has). The result
// starts with the run directory's path.
// Rank 0's folder locks go into `locks` once the memory check has passed: a refused run writes nothing.
static TrainResult prepare_run(const Config& cfg, Device device, DType compute, std::FILE* out, Progress& progress,
                               Communicator& world, std::vector<std::unique_ptr<DirLock>>& locks) {
  check_memory(cfg, device, compute, world.size(), progress);
  locks = lock_run_dirs(cfg, world.rank() == 0);
  if (world.rank() == 0) remove_unfinished_checkpoints(cfg, out);
  TrainResult res;
  res.out_dir = world.rank() == 0 ? make_run_dir(cfg) : cfg.run_dir();
  res.world_size = world.size();
  if (world.size() > 1) world.barrier();
  return res;
}

// train.batch_size is the global batch: it must split evenly over the ranks. Checked on every rank
// alike, so all of them stop together.
static int checked_world_size(const Config& cfg, const Communicator& world) {
  const int n = world.size();
  if (cfg.train.batch_size % n != 0)
    throw AllRanksConfigError(cfg.origin("train.batch_size") + ": train.batch_size: " +
                              std::to_string(cfg.train.batch_size) + " sequences do not split evenly over " +
                              std::to_string(n) + " processes (the batch is global: each rank reads batch_size / " +
                              "processes of it); use a multiple of " + std::to_string(n) +
                              ", or a number of processes that divides " + std::to_string(cfg.train.batch_size));
  return n;
}

static void check_router_lr_scale(const Config& cfg, const AdamW& opt) {
  FLOWMOE_CHECK(cfg.optimizer.router_lr_scale == 1.0 || opt.num_router_params() > 0, ConfigError,
                cfg.origin("optimizer.router_lr_scale"), ": optimizer.router_lr_scale is ",
                cfg.optimizer.router_lr_scale, " but the model has no MoE router (n_routed_experts is 0 or ",
                "first_k_dense_replace covers every layer)");
}

// Loads the weights, optimizer state, buffers and data position of run.resume_dir.
static void resume_from_checkpoint(TrainRun& run) {
  const Config& cfg = run.cfg;
  // Every rank reads the full tensors and keeps its rows of each expert shard.
  CheckpointMeta meta =
      load_checkpoint(run.resume_dir, run.model.parameters(), &run.opt.exp_avg(), &run.opt.exp_avg_sq(),
                      run.model.buffers(), run.model.parameter_shards(), checkpoint_load_options(cfg));
  FLOWMOE_CHECK(meta.data_seed == uint64_t(cfg.data.seed), ConfigError, cfg.origin("data.seed"),
                ": data.seed: ", cfg.data.seed, " differs from the checkpoint's ", meta.data_seed,
                " (a resumed run must keep its data order)");
  run.data.set_position(meta.data);
  run.step = meta.step;
  run.skipped = meta.skipped_steps;
  run.opt.set_num_updates(meta.num_updates);
  run.resume_note = "resumed from " + run.resume_dir + " at step " + std::to_string(run.step) +
                    partial_load_note(meta);
}

// The data line, the resume note and a capped evaluation, before the first step.
static void announce_data(TrainRun& run) {
  const Config& cfg = run.cfg;
  const TrainConfig& tc = cfg.train;
  const std::string source =
      cfg.data.source == "synthetic" ? "synthetic (" + cfg.data.synthetic_kind + ")" : cfg.data.source;
  run.progress.message("data: " + source + ", " + std::to_string(run.data.num_train_windows()) + " train / " +
                       std::to_string(run.data.num_val_windows()) + " val sequences of " +
                       std::to_string(cfg.data.seq_len) + " tokens; " + std::to_string(tc.steps) + " steps x " +
                       std::to_string(run.tokens_per_step) + " tokens; outputs in " + run.res.out_dir);
  if (run.world_size > 1) run.progress.message(describe_ranks(run.parallel, cfg));
  // OpenMPI binds each of 2 ranks to one core by default; the host work (the weights' draws, the
  // checkpoints) then runs on one thread, which made set-up 9x slower in a 2-GPU run.
  if (run.world_size > 1 && usable_cpu_count() == 1 && machine_cpu_count() > 1)
    run.progress.message("host: rank 0 may run on 1 of " + std::to_string(machine_cpu_count()) +
                         " CPUs (the launcher's binding), so set-up draws the weights on one thread; " +
                         "mpirun --bind-to none lets every rank use the machine");
  if (!run.resume_note.empty()) run.progress.message(run.resume_note);
  if (run.val.capped) run.progress.message("evaluation: " + run.val.cap_note("train.eval_batches = "));
}

// The constants of the optimizer step's scalars (kernels/step_control.h).
static StepSchedule run_step_schedule(const Config& c) {
  StepSchedule p = step_schedule(c.optimizer, c.train.steps);
  p.num_micro_batches = int32_t(c.train.grad_accum_steps);
  p.bias_follows_lr = c.model.bias_update_schedule == "lr";
  p.stop_on_nonfinite = c.train.nonfinite == "stop";
  return p;
}

TrainRun::TrainRun(const Config& c, const TrainOptions& o)
    : clock(o.started),
      cfg(c),
      opts(o),
      world(o.world ? o.world : make_none_communicator()),
      rank(world->rank()),
      world_size(checked_world_size(c, *world)),
      parallel(run_parallel_state(c, world)),
      is_root(rank == 0),
      device(o.device ? *o.device : resolve_device(c)),
      compute(compute_dtype_for(c, device)),
      resume_dir(resume_target(c, &resume_note)),
      progress(c.logging.progress, c.train.steps, c.logging.log_every, is_root ? o.out : nullptr),
      res(prepare_run(c, device, compute, is_root ? o.out : nullptr, progress, *world, dir_locks)),
      data(DataLoader::from_config(c)),
      model(c.model, device, compute, uint64_t(c.train.seed), moe_options(c, parallel)),
      opt(model.parameters(), c.optimizer),
      state(device, run_step_schedule(c)) {
  check_router_lr_scale(cfg, opt);
  if (world_size > 1)
    reducer = std::make_unique<GradientReducer>(parallel, model.parameters(), model.parameter_shards(),
                                                cfg.parallel.overlap_grad_reduce, kGradientBucketBytes,
                                                int(cfg.parallel.grad_reduce_sms));
  if (!resume_dir.empty()) {
    resume_from_checkpoint(*this);
    clock.lap("checkpoint load");
  }
  state.reset(step, opt.num_updates());
  res.first_step = step + 1;
  res.skipped_steps = skipped;
  res.metrics_file = (fs::path(res.out_dir) / ("metrics." + cfg.logging.metrics_format)).string();
  if (is_root) metrics.emplace(res.metrics_file, cfg.logging.metrics_format, resume_dir.empty() ? -1 : step);

  const TrainConfig& tc = cfg.train;
  tokens_per_step = tc.batch_size * cfg.data.seq_len * tc.grad_accum_steps;
  if (data.num_val_windows() > 0) val = whole_val_batches(data, tc.eval_batches, tc.batch_size);
  announce_data(*this);
  end = opts.stop_after >= 0 ? std::min(tc.steps, opts.stop_after) : tc.steps;
  // Casts are reported per MoE layer and micro-batch (what one forward + backward of a layer makes).
  cast_divisor = double(model.num_moe_layers() * tc.grad_accum_steps);
  clock.lap("rest");
}

// ---- evaluation, checkpoints, progress -----------------------------------------------------------

// Every `every` steps (0: never) and at the last step of the run.
static bool due(int64_t step, int64_t every, int64_t last_step) {
  return (every > 0 && step % every == 0) || step == last_step;
}

static void evaluate_if_due(TrainRun& run, StepMetrics& m) {
  if (run.val.num_batches == 0 || !due(m.step, run.cfg.train.eval_every, run.cfg.train.steps)) return;
  const RunClock::Clock::time_point t0 = RunClock::Clock::now();
  m.val_loss = evaluate(run.model, run.data, run.val.num_batches, run.val.batch_size, run.world.get());
  run.clock.evaluation_seconds += RunClock::seconds_since(t0);
  if (std::isnan(run.res.first_val_loss)) run.res.first_val_loss = m.val_loss;
  run.res.final_val_loss = m.val_loss;
  run.progress.message("step " + std::to_string(m.step) + ": val loss " + format_fixed(m.val_loss, 4) +
                       " (train loss " + format_fixed(m.loss, 4) + ")");
}

void save_run_checkpoint(TrainRun& run, int64_t at) {
  const RunClock::Clock::time_point t0 = RunClock::Clock::now();
  CheckpointMeta meta;
  meta.step = at;
  meta.num_updates = run.opt.num_updates();
  meta.skipped_steps = run.skipped;
  meta.data = run.data.position();
  meta.data_seed = uint64_t(run.cfg.data.seed);
  meta.init_seed = uint64_t(run.cfg.train.seed);
  meta.config_yaml = to_yaml(run.cfg);
  // Rank 0 writes what one process would: the expert shards gathered over its expert-parallel group
  // (the other groups hold copies of the same state), the rest as every rank holds it. The data
  // position counts global batches, so the files depend on neither the world nor the group size.
  const int64_t group_size = run.parallel.expert_parallel_size;
  FullState full;
  if (run.rank < group_size)
    full = gather_full_state(*run.parallel.expert_parallel, run.model.parameters(), run.model.parameter_shards(),
                             run.opt.exp_avg(), run.opt.exp_avg_sq(), run.is_root);
  if (run.is_root)
    run.res.last_checkpoint = save_checkpoint(run.cfg.checkpoint_dir(), meta, full.params, full.exp_avg,
                                              full.exp_avg_sq, run.cfg.checkpoint.keep_last, run.model.buffers());
  else
    run.res.last_checkpoint = checkpoint_path(run.cfg.checkpoint_dir(), at);
  if (run.world_size > 1) run.world->barrier();
  run.clock.checkpoint_seconds += RunClock::seconds_since(t0);
}

// Every checkpoint.every steps, and at train.steps unless checkpoint.final is false.
static bool checkpoint_due(const TrainRun& run, int64_t step) {
  const CheckpointConfig& c = run.cfg.checkpoint;
  return due(step, c.every, c.final ? run.cfg.train.steps : -1);
}

// `step` is the step just read back; a step due for a checkpoint is never run ahead of (may_run_ahead),
// so it is also the last one queued and the weights are its own.
static void save_if_due(TrainRun& run, int64_t step) {
  if (!checkpoint_due(run, step)) return;
  FLOWMOE_CHECK(step == run.step, Error, "checkpoint of step ", step, " while step ", run.step, " is queued");
  save_run_checkpoint(run, run.step);
  run.last_saved = run.step;
  run.progress.message("step " + std::to_string(run.step) + ": checkpoint " + run.res.last_checkpoint);
}

// A stop request ends the run after the current step, with a checkpoint to continue from.
static void stop_with_checkpoint(TrainRun& run) {
  if (run.last_saved != run.step) save_run_checkpoint(run, run.step);
  run.progress.message("interrupted at step " + std::to_string(run.step) + ": checkpoint " +
                       run.res.last_checkpoint + " (continue with --resume)");
  run.res.interrupted = true;
}

// The step's metrics row, and the progress display with the run's mean rate so far.
static void report_step(TrainRun& run, const StepMetrics& m) {
  if (run.metrics) run.metrics->write(m);  // rank 0's alone
  StepMetrics shown = m;
  shown.tokens_per_s = double(run.tokens_per_step * run.steps_done) / run.train_seconds;  // smoothed for display
  run.progress.update(shown, run.train_seconds / double(run.steps_done) * double(run.cfg.train.steps - run.step));
}

// ---- the loop -------------------------------------------------------------------------------------

// The peak memory and exchange time of the step as the most any rank used, and whether any rank was
// asked to stop (a launcher delivers a signal to the ranks at slightly different times): all of them
// stop after the same step.
static bool agree_after_step(TrainRun& run, StepMetrics& m) {
  const bool stop = g_stop_requested;
  if (run.world_size == 1) return stop;
  const bool exchanged = !std::isnan(m.exchange_ms);  // the same on every rank: an expert-parallel run
  const std::vector<double> most = all_reduce_values(
      *run.world, {double(m.peak_mem_bytes), stop ? 1.0 : 0.0, exchanged ? m.exchange_ms : 0.0}, ReduceOp::max);
  m.peak_mem_bytes = int64_t(most[0]);
  if (exchanged) m.exchange_ms = most[2];
  return most[1] > 0;
}

// After a step's metrics are read: its evaluation, metrics row and checkpoint. Returns whether the run
// must stop (a signal on any rank).
static bool finish_step(TrainRun& run, StepMetrics m) {
  const bool stop = agree_after_step(run, m);
  evaluate_if_due(run, m);
  report_step(run, m);
  save_if_due(run, m.step);
  run.step_clock = std::chrono::steady_clock::now();  // evaluation and checkpoints are not training time
  return stop;
}

// Whether the step just queued may stay unread while the next one is queued: only when its scalars are
// on the device, nothing reads the weights after it (evaluation, checkpoint, the run's end), the next
// step is not the profiled one, and a non-finite step need not stop the run exactly there.
static bool may_run_ahead(const TrainRun& run) {
  const TrainConfig& tc = run.cfg.train;
  return step_scalars_on_device(run) && run.step < run.end && run.step + 1 != run.opts.profile_step &&
         tc.nonfinite != "stop" && !due(run.step, tc.eval_every, tc.steps) &&
         !checkpoint_due(run, run.step);
}

TrainResult train(const Config& cfg, const TrainOptions& opts) {
  // A stop requested before this point (a signal during start-up) holds: it is cleared on return.
  struct ClearStopOnReturn {
    ~ClearStopOnReturn() { g_stop_requested = false; }
  } clear_stop;
  TrainRun run(cfg, opts);
  bool stop = false;
  while (run.step < run.end && !stop) {
    if (run.step + 1 == run.opts.profile_step) {
      stop = finish_step(run, profiled_train_step(run));
      continue;
    }
    issue_step(run);
    // On one GPU the host queues step N + 1 before it reads step N's loss: the GPU never waits for it.
    const int64_t keep = may_run_ahead(run) ? 1 : 0;
    while (run.state.num_pending() > keep && !stop) stop = finish_step(run, complete_step(run));
  }
  while (run.state.num_pending() > 0) finish_step(run, complete_step(run));  // a step queued before a stop
  if (stop && run.step < run.end) stop_with_checkpoint(run);
  return finish_run(run);
}

}  // namespace flowmoe
