// The training loop (see trainer.h).
#include "engine/train/trainer.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "engine/allocator.h"
#include "engine/cast_stats.h"
#include "engine/cuda_api.h"
#include "engine/train/checkpoint.h"
#include "engine/train/memory_estimate.h"
#include "engine/train/metrics.h"
#include "engine/train/optimizer.h"

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

double evaluate(const Transformer& model, const DataLoader& data, int64_t num_batches, int64_t batch_size) {
  NoGradGuard no_grad;
  double total = 0;
  for (int64_t i = 0; i < num_batches; ++i) {
    Batch b = data.val_batch(i, batch_size);
    total += double(model.losses(b.inputs, b.targets).lm.data().to_floats()[0]);  // the LM loss alone
  }
  return total / double(num_batches);
}

ValBatches whole_val_batches(const DataLoader& data, int64_t num_batches, int64_t batch_size) {
  const int64_t num_windows = data.num_val_windows();
  FLOWMOE_CHECK(num_windows > 0, Error, "the data holds out no validation sequences (data.val_fraction is 0)");
  ValBatches v;
  v.batch_size = std::min(batch_size, num_windows);
  v.num_windows = num_windows;
  const int64_t whole = num_windows / v.batch_size;
  v.capped = num_batches > whole;
  v.num_batches = std::min(num_batches, whole);
  return v;
}

std::string ValBatches::describe() const {
  return "the validation split holds (" + std::to_string(num_windows / batch_size) + " batches of " +
         std::to_string(batch_size) + ")";
}

static std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
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

TrainResult train(const Config& cfg, const TrainOptions& opts) {
  // A stop requested before this point (a signal during start-up) holds: it is cleared on return.
  struct ClearStopOnReturn {
    ~ClearStopOnReturn() { g_stop_requested = false; }
  } clear_stop;
  const Device device = resolve_device(cfg);
  const DType compute = compute_dtype_for(cfg, device);
  std::string resume_note;
  const std::string resume_dir = resume_target(cfg, &resume_note);
  remove_unfinished_checkpoints(cfg, opts.out);
  const TrainConfig& tc = cfg.train;
  Progress progress(cfg.logging.progress, tc.steps, cfg.logging.log_every, opts.out);

  // Counted and sized from the config before anything is allocated, so a model that cannot fit is
  // refused at once instead of allocating until the system kills the process.
  const MemoryEstimate need = estimate_memory(cfg, device);
  progress.message("flowmoe: " + format_count(double(need.num_parameters)) + " parameters (" +
                   std::to_string(cfg.model.num_hidden_layers) + " layers, hidden " +
                   std::to_string(cfg.model.hidden_size) + ", vocab " + std::to_string(cfg.model.vocab_size) +
                   ") on " + device.str() + ", " + dtype_name(compute) + " compute; initial loss ~ ln(vocab) = " +
                   fixed(std::log(double(cfg.model.vocab_size)), 3));
  const double available = available_memory_bytes(device);
  progress.message("memory: " + need.summary() + " of " + format_bytes(available) + " available on " + device.str());
  check_fits(need, available, device.str());

  TrainResult res;
  res.out_dir = cfg.run_dir();
  std::error_code ec;
  fs::create_directories(res.out_dir, ec);
  FLOWMOE_CHECK(!ec, IoError, "cannot create the run directory '", res.out_dir, "': ", ec.message());
  {
    std::ofstream out(fs::path(res.out_dir) / "config.yaml");
    out << to_yaml(cfg);
    FLOWMOE_CHECK(out.good(), IoError, "cannot write '", (fs::path(res.out_dir) / "config.yaml").string(), "'");
  }

  DataLoader data = DataLoader::from_config(cfg);
  Transformer model(cfg.model, device, compute, uint64_t(tc.seed), moe_options(cfg));
  AdamW opt(model.parameters(), cfg.optimizer);
  FLOWMOE_CHECK(cfg.optimizer.router_lr_scale == 1.0 || opt.num_router_params() > 0, ConfigError,
                cfg.origin("optimizer.router_lr_scale"), ": optimizer.router_lr_scale is ",
                cfg.optimizer.router_lr_scale, " but the model has no MoE router (n_routed_experts is 0 or ",
                "first_k_dense_replace covers every layer)");

  int64_t step = 0, skipped = 0;
  if (!resume_dir.empty()) {
    CheckpointMeta meta = load_checkpoint(resume_dir, model.parameters(), &opt.exp_avg(), &opt.exp_avg_sq(),
                                          model.buffers());
    FLOWMOE_CHECK(meta.data_seed == uint64_t(cfg.data.seed), ConfigError, cfg.origin("data.seed"),
                  ": data.seed: ", cfg.data.seed, " differs from the checkpoint's ", meta.data_seed,
                  " (a resumed run must keep its data order)");
    data.set_position(meta.data);
    step = meta.step;
    skipped = meta.skipped_steps;
    opt.set_num_updates(meta.num_updates);
    resume_note = "resumed from " + resume_dir + " at step " + std::to_string(step);
  }
  res.first_step = step + 1;
  res.skipped_steps = skipped;
  res.metrics_file = (fs::path(res.out_dir) / ("metrics." + cfg.logging.metrics_format)).string();
  MetricsWriter metrics(res.metrics_file, cfg.logging.metrics_format, resume_dir.empty() ? -1 : step);

  const int64_t tokens_per_step = tc.batch_size * cfg.data.seq_len * tc.grad_accum_steps;
  const bool have_val = data.num_val_windows() > 0;
  const ValBatches val = have_val ? whole_val_batches(data, tc.eval_batches, tc.batch_size) : ValBatches{};
  const std::string source =
      cfg.data.source == "synthetic" ? "synthetic (" + cfg.data.synthetic_kind + ")" : cfg.data.source;
  progress.message("data: " + source + ", " + std::to_string(data.num_train_windows()) + " train / " +
                   std::to_string(data.num_val_windows()) + " val sequences of " + std::to_string(cfg.data.seq_len) +
                   " tokens; " + std::to_string(tc.steps) + " steps x " + std::to_string(tokens_per_step) +
                   " tokens; outputs in " + res.out_dir);
  if (!resume_note.empty()) progress.message(resume_note);
  if (val.capped)
    progress.message("evaluation: train.eval_batches = " + std::to_string(tc.eval_batches) + " is more than " +
                     val.describe() + "; using " + std::to_string(val.num_batches));

  const int64_t end = opts.stop_after >= 0 ? std::min(tc.steps, opts.stop_after) : tc.steps;
  const std::string ckpt_root = cfg.checkpoint_dir();
  auto save = [&](int64_t at) {
    CheckpointMeta meta;
    meta.step = at;
    meta.num_updates = opt.num_updates();
    meta.skipped_steps = skipped;
    meta.data = data.position();
    meta.data_seed = uint64_t(cfg.data.seed);
    meta.init_seed = uint64_t(tc.seed);
    meta.config_yaml = to_yaml(cfg);
    res.last_checkpoint = save_checkpoint(ckpt_root, meta, model.parameters(), opt.exp_avg(), opt.exp_avg_sq(),
                                          cfg.checkpoint.keep_last, model.buffers());
  };

  // Casts are reported per MoE layer and micro-batch (what one forward + backward of a layer makes).
  const double cast_divisor = double(model.num_moe_layers() * tc.grad_accum_steps);
  CastCounts last_casts;

  using clock = std::chrono::steady_clock;
  double train_seconds = 0;
  int64_t steps_done = 0, last_saved = -1;
  while (step < end) {
    const auto t0 = clock::now();
    const uint64_t syncs_before = num_host_syncs();
    reset_cast_counts();
    ++step;
    StepMetrics m;
    m.step = step;
    m.lr = learning_rate(cfg.optimizer, step, tc.steps);
    opt.zero_grad();
    double loss_sum = 0, aux_sum = 0;
    bool has_aux = false;
    for (int64_t a = 0; a < tc.grad_accum_steps; ++a) {
      Batch b = data.next_train(tc.batch_size);
      const Transformer::Losses parts = model.losses(b.inputs, b.targets);
      const Variable loss = parts.total();
      loss_sum += double(parts.lm.data().to_floats()[0]);
      if (parts.aux.defined()) {
        has_aux = true;
        aux_sum += double(parts.aux.data().to_floats()[0]);
      }
      (tc.grad_accum_steps > 1 ? scale(loss, 1.0 / double(tc.grad_accum_steps)) : loss).backward();
    }
    // The LM loss and the balance loss are logged apart; training minimizes their sum.
    m.loss = loss_sum / double(tc.grad_accum_steps);
    m.aux_loss = has_aux ? aux_sum / double(tc.grad_accum_steps) : NAN;
    m.host_syncs = int64_t(num_host_syncs() - syncs_before);  // the model's own; our loss reads are not counted
    if (cast_divisor > 0) {
      last_casts = cast_counts();
      m.moe_casts = double(last_casts.activation_casts()) / cast_divisor;
    }
    if (opts.after_backward) opts.after_backward(step, model.parameters());
    if (opts.after_loss) opts.after_loss(step, &m.loss);
    m.grad_norm = opt.grad_norm();
    const double objective = m.loss + (has_aux ? m.aux_loss : 0.0);
    if (std::isfinite(objective) && std::isfinite(m.grad_norm)) {
      opt.step(m.lr, clip_scale(m.grad_norm, cfg.optimizer.grad_clip));
    } else {
      m.skipped = true;
      ++skipped;
      std::string what = "step " + std::to_string(step) + ": non-finite " +
                         (std::isfinite(objective) ? "gradients (grad norm " + std::to_string(m.grad_norm) + ")"
                                                   : "loss (" + std::to_string(m.loss) +
                                                         (has_aux ? ", balance loss " + std::to_string(m.aux_loss) : "") +
                                                         ")");
      if (tc.nonfinite == "stop") {
        // The update was not applied: the checkpoint holds the weights of the last good step, and a
        // --resume continues after the batch that failed.
        save(step);
        FLOWMOE_THROW(Error, what, "; stopping because train.nonfinite is 'stop' (", cfg.origin("train.nonfinite"),
                      "); the weights before this step are in ", res.last_checkpoint,
                      ". Lower optimizer.lr, raise optimizer.warmup_steps, or set train.nonfinite: skip");
      }
      if (skipped > tc.max_skipped_steps)
        FLOWMOE_THROW(Error, what, "; ", skipped, " steps skipped so far, more than train.max_skipped_steps = ",
                      tc.max_skipped_steps, ": the run is diverging. Lower optimizer.lr or raise warmup_steps");
      progress.message(what + ": update skipped (" + std::to_string(skipped) + " of at most " +
                       std::to_string(tc.max_skipped_steps) + ")");
    }
    opt.zero_grad();
    // Aux-loss-free balancing: every MoE layer moves its expert bias toward the mean load, by
    // bias_update_rate, or (schedule lr) by bias_update_rate * lr / optimizer.lr.
    const double bias_scale = cfg.model.bias_update_schedule != "lr" ? 1.0
                              : cfg.optimizer.lr > 0                 ? m.lr / cfg.optimizer.lr
                                                                     : 0.0;
    // A skipped step moves nothing, the expert bias included (rate 0); its loads are still logged.
    for (const LoadStats& ls : model.update_moe_bias(m.skipped ? 0.0 : bias_scale))
      m.moe_max_over_mean.push_back(ls.max_over_mean);
    const double dt = std::chrono::duration<double>(clock::now() - t0).count();
    train_seconds += dt;
    ++steps_done;
    m.tokens_per_s = double(tokens_per_step) / dt;
    m.peak_mem_bytes = int64_t(memory_stats(device).peak_bytes);
    res.losses.push_back(m.loss);

    if (have_val && ((tc.eval_every > 0 && step % tc.eval_every == 0) || step == tc.steps)) {
      m.val_loss = evaluate(model, data, val.num_batches, val.batch_size);
      if (std::isnan(res.first_val_loss)) res.first_val_loss = m.val_loss;
      res.final_val_loss = m.val_loss;
      progress.message("step " + std::to_string(step) + ": val loss " + fixed(m.val_loss, 4) + " (train loss " +
                       fixed(m.loss, 4) + ")");
    }
    metrics.write(m);
    StepMetrics shown = m;
    shown.tokens_per_s = double(tokens_per_step * steps_done) / train_seconds;  // smoothed for display
    progress.update(shown, train_seconds / double(steps_done) * double(tc.steps - step));

    if ((cfg.checkpoint.every > 0 && step % cfg.checkpoint.every == 0) || step == tc.steps) {
      save(step);
      last_saved = step;
      progress.message("step " + std::to_string(step) + ": checkpoint " + res.last_checkpoint);
    }
    if (g_stop_requested && step < end) {
      if (last_saved != step) save(step);
      progress.message("interrupted at step " + std::to_string(step) + ": checkpoint " + res.last_checkpoint +
                       " (continue with --resume)");
      res.interrupted = true;
      break;
    }
  }
  progress.finish();
  res.last_step = step;
  res.skipped_steps = skipped;
  res.interrupted = res.interrupted || step < tc.steps;
  res.tokens_per_s = train_seconds > 0 ? double(tokens_per_step * steps_done) / train_seconds : 0;
  if (steps_done > 0) {
    std::string line = "done: step " + std::to_string(step) + "/" + std::to_string(tc.steps) + " in " +
                       format_duration(train_seconds) + " | loss " + fixed(res.losses.front(), 4) + " -> " +
                       fixed(res.losses.back(), 4);
    if (!std::isnan(res.final_val_loss)) line += " | val loss " + fixed(res.final_val_loss, 4);
    line += " | " + format_rate(res.tokens_per_s) + " tok/s | peak mem " +
            fixed(double(memory_stats(device).peak_bytes) / (1 << 20), 1) + " MiB";
    progress.message(line);
    if (cast_divisor > 0) {
      // Where each explicit cast of the last step happened (DESIGN.md §1: the published flow has 2).
      std::string casts = "casts per MoE layer per micro-batch (" + cfg.precision.recipe + "): " +
                          fixed(double(last_casts.activation_casts()) / cast_divisor, 1);
      for (const auto& [site, n] : last_casts.by_site)
        if (site.rfind("weight_quantize", 0) != 0)
          casts += " | " + site + " x" + fixed(double(n) / cast_divisor, 1);
      progress.message(casts);
    }
    progress.message("metrics: " + res.metrics_file + (res.last_checkpoint.empty() ? "" : " | checkpoint: " + res.last_checkpoint));
  } else {
    progress.message("nothing to do: the run is already at step " + std::to_string(step) + " of " +
                     std::to_string(tc.steps));
  }
  return res;
}

}  // namespace flowmoe
