// A training run's checkpoints (see run.h): the resume at set-up and each save, with the optimizer's f32
// masters as the weights a checkpoint holds, whether AdamW keeps them whole or a sharded optimizer keeps
// segments of them (parallel/grad_reducer.h).
#include <yaml-cpp/yaml.h>

#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "parallel/expert_parallel.h"
#include "parallel/watchdog.h"
#include "train/run.h"

namespace flowmoe {

// Parameter i's f32 master in the parameter's shape when AdamW holds it whole (run_setup.cpp, optimizer_masters),
// else undefined.
static Tensor whole_master(const AdamW& opt, size_t i, const Shape& shape) {
  if (opt.sharded() || opt.masters().empty() || !opt.masters()[i].defined()) return Tensor();
  return opt.masters()[i].view(shape);
}

// The keys that decide which tokens a run reads, and in which order, each with the data sources it applies
// to. A resumed run takes up its checkpoint's data position, a count of windows into the order of one
// corpus, split, sequence length and seed, read a batch at a time: over any other it would go on silently
// with other data than the run it continues.
namespace {
struct DataKey {
  const char* key;
  bool (*applies)(DataSource source);
};
const DataKey kDataKeys[] = {
    {"data.source", [](DataSource) { return true; }},
    {"data.path", [](DataSource source) { return source != DataSource::synthetic; }},
    {"data.synthetic_tokens", [](DataSource source) { return source == DataSource::synthetic; }},
    {"data.synthetic_kind", [](DataSource source) { return source == DataSource::synthetic; }},
    {"data.seed", [](DataSource) { return true; }},
    {"data.seq_len", [](DataSource) { return true; }},
    {"data.val_fraction", [](DataSource) { return true; }},
    {"train.batch_size", [](DataSource) { return true; }},
    {"train.grad_accum_steps", [](DataSource) { return true; }},
};
}  // namespace

// The value of "section.key" in a resolved config's YAML, as to_yaml wrote it; "" where it has none.
static std::string yaml_value(const YAML::Node& config, const std::string& dotted) {
  const size_t dot = dotted.find('.');
  const YAML::Node section = config[dotted.substr(0, dot)];
  if (!section || !section.IsMap()) return "";
  const YAML::Node n = section[dotted.substr(dot + 1)];
  return n && n.IsScalar() ? n.Scalar() : "";
}

// Refuses a resume whose config reads other data than its checkpoint's (kDataKeys), naming the first key that
// differs and both values. A key the checkpoint's config lacks (an older run's) is not compared.
static void check_same_data(const Config& cfg, const std::string& checkpoint_config, const std::string& dir) {
  YAML::Node was;
  try {
    was = YAML::Load(checkpoint_config);
  } catch (const YAML::Exception& e) {
    FLOWMOE_THROW(IoError, "'", dir, "/meta.json': its config is not YAML (", e.msg, ")");
  }
  const YAML::Node now = YAML::Load(to_yaml(cfg));
  for (const DataKey& k : kDataKeys) {
    if (!k.applies(cfg.data.source)) continue;
    const std::string before = yaml_value(was, k.key), after = yaml_value(now, k.key);
    FLOWMOE_CHECK(before.empty() || before == after, ConfigError, cfg.origin(k.key), ": ", k.key, ": ", after,
                  " differs from the checkpoint's ", before, " (", dir,
                  "): a resumed run must read the data its checkpoint's position counts in (the same corpus, "
                  "split, sequence length, seed and batch)");
  }
}

CheckpointMeta resume_from_checkpoint(RunSetup& setup, const std::string& dir) {
  const Config& cfg = setup.cfg;
  AdamW& opt = setup.optimizer();
  // Every rank reads the full tensors and keeps its rows of each expert shard; a sharded optimizer reads
  // the weights and moments whole, on the host, and keeps its ranges of them (parallel/grad_reducer.h). Whole
  // masters (optimizer_masters) take the weights, and the model's copies are cast from them.
  const bool sharded = opt.sharded();
  const std::vector<Variable> model_params = setup.model().parameters();
  std::vector<Variable> params = model_params;
  std::vector<Tensor> whole[3];  // sharded: the weights, exp_avg, exp_avg_sq (the moments in the optimizer's dtype)
  for (int k = 0; k < 3; ++k)
    if (sharded)
      for (const Variable& p : params)
        whole[k].push_back(Tensor::zeros(p.shape(), k == 0 ? DType::f32 : opt.moment_dtype(), Device::cpu()));
  for (size_t i = 0; i < params.size(); ++i)
    if (sharded)
      params[i] = Variable(whole[0][i], false, params[i].name());
    else if (const Tensor master = whole_master(opt, i, params[i].shape()); master.defined())
      params[i] = Variable(master, false, params[i].name());
  std::vector<Tensor>* exp_avg = sharded ? &whole[1] : &opt.exp_avg();
  std::vector<Tensor>* exp_avg_sq = sharded ? &whole[2] : &opt.exp_avg_sq();
  CheckpointMeta meta = load_checkpoint(dir, params, exp_avg, exp_avg_sq, setup.model().buffers(),
                                        setup.model().parameter_shards(), checkpoint_load_options(cfg));
  if (sharded) {
    setup.reducer()->load_masters(whole[0]);
    opt.load_moment_ranges(whole[1], whole[2]);
  } else {
    for (size_t i = 0; i < params.size(); ++i)
      if (const Tensor master = whole_master(opt, i, params[i].shape()); master.defined()) {
        Tensor weights = model_params[i].data();  // the same storage
        weights.copy_(master.to(weights.dtype()));
        model_params[i].bump_version();
      }
  }
  check_same_data(cfg, meta.config_yaml, dir);
  setup.data().set_position(meta.data);
  opt.set_num_updates(meta.num_updates);
  return meta;
}

void save_run_checkpoint(TrainRun& run, int64_t at) {
  run.clock.checkpoints.restart();
  RunSetup& setup = run.setup;
  const AdamW& opt = setup.optimizer();
  CheckpointMeta meta;
  meta.step = at;
  meta.num_updates = opt.num_updates();
  meta.skipped_steps = run.loop.skipped;
  meta.data = setup.data().position();
  meta.data_seed = uint64_t(run.cfg.data.seed);
  meta.init_seed = uint64_t(run.cfg.train.seed);
  meta.config_yaml = to_yaml(run.cfg);
  // Rank 0 writes what one process would: the expert shards gathered over its expert-parallel group
  // (the other groups hold copies of the same state), the rest as every rank holds it. The data
  // position counts global batches, so the files depend on neither the world nor the group size.
  // A sharded optimizer's f32 master weights and moments are first gathered whole over the data-parallel
  // groups, on every rank; whole masters are written as they are (the model's bf16 weights are not what a
  // checkpoint holds).
  const int64_t group_size = setup.parallel.expert_parallel_size;
  const bool keep = setup.rank < group_size;
  std::vector<Variable> weights = setup.model().parameters();
  std::pair<std::vector<Tensor>, std::vector<Tensor>> moments;
  if (opt.sharded()) {
    setup.reducer()->wait_weights();
    // exp_avg first, then exp_avg_sq: the order of the collectives on every rank.
    moments.first = setup.reducer()->full_ranges(opt.exp_avg(), opt.moment_dtype(), keep);
    moments.second = setup.reducer()->full_ranges(opt.exp_avg_sq(), opt.moment_dtype(), keep);
    const std::vector<Tensor> masters = setup.reducer()->full_masters(keep);
    if (keep)
      for (size_t i = 0; i < weights.size(); ++i) weights[i] = Variable(masters[i], false, weights[i].name());
  } else {
    for (size_t i = 0; i < weights.size(); ++i)
      if (const Tensor master = whole_master(opt, i, weights[i].shape()); master.defined())
        weights[i] = Variable(master, false, weights[i].name());
  }
  const std::vector<Tensor>& exp_avg = opt.sharded() ? moments.first : opt.exp_avg();
  const std::vector<Tensor>& exp_avg_sq = opt.sharded() ? moments.second : opt.exp_avg_sq();
  FullState full;
  if (keep)
    full = gather_full_state(*setup.parallel.expert_parallel, weights, setup.model().parameter_shards(), exp_avg,
                             exp_avg_sq, setup.is_root);
  if (setup.is_root)
    run.res.last_checkpoint = save_checkpoint(run.cfg.checkpoint_dir(), meta, full.params, full.exp_avg,
                                              full.exp_avg_sq, run.cfg.checkpoint.keep_last, setup.model().buffers());
  else
    run.res.last_checkpoint = checkpoint_path(run.cfg.checkpoint_dir(), at);
  if (setup.world_size > 1) {
    // The other ranks wait here for rank 0's write, as long as the model makes it: not timed
    // (parallel/watchdog.h). Rank 0's own wait there is timed as any other.
    std::optional<UnwatchedWait> untimed;
    if (!setup.is_root) untimed.emplace();
    setup.world->barrier();
  }
  run.clock.checkpoints.lap();
}

}  // namespace flowmoe
