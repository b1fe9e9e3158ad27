// A command's set-up (see run_setup.h): the ranks, the device, the data, the model and its weights, and for
// training the gradient reducer and the optimizer.
#include "train/run_setup.h"

#include <utility>
#include <vector>

#include "parallel/backends.h"
#include "parallel/expert_parallel.h"
#include "train/train_options.h"

namespace flowmoe {

RunSetup::RunSetup(const Config& c, std::shared_ptr<Communicator> w, std::optional<Device> d)
    : cfg(c),
      world(w ? std::move(w) : make_none_communicator()),
      rank(world->rank()),
      world_size(world->size()),
      parallel(run_parallel_state(world, c.parallel.expert_parallel_size, c.model.n_routed_experts,
                                  c.origin("parallel.expert_parallel_size"))),
      is_root(rank == 0),
      device(d ? *d : resolve_device(c)),
      compute(compute_dtype_for(device)) {}

void RunSetup::check_fits(MemoryUse use) const { flowmoe::check_fits(estimate_memory(cfg, device, use), device); }

DataLoader& RunSetup::read_data() {
  data_.emplace(DataLoader::from_config(cfg));
  return *data_;
}

Transformer& RunSetup::build_model(uint64_t seed, const MoeOptions& moe) {
  model_.emplace(cfg.model, device, compute, seed, moe);
  // Before any quantize: whether the FP8 weights keep their transposes (precision.fp8_weight_transpose).
  for (const ParamShard& s : model_->parameter_shards())
    if (s.fp8) s.fp8->keeps_transpose = cfg.precision.fp8_weight_transpose == Fp8WeightTranspose::stored;
  return *model_;
}

Transformer& RunSetup::build_model() { return build_model(uint64_t(cfg.train.seed), moe_options(cfg, parallel)); }

CheckpointMeta RunSetup::load_weights(const std::string& dir) {
  return load_checkpoint(dir, model_->parameters(), nullptr, nullptr, model_->buffers(), model_->parameter_shards(),
                         checkpoint_load_options(cfg));
}

// ---- the optimizer ----------------------------------------------------------------------------------

// precision.param_dtype: what the weights the forward reads in the compute dtype are stored in.
static DType weight_dtype(const Config& c, const Transformer& model) {
  return c.precision.param_dtype == ParamDtype::f32 ? DType::f32 : model.compute_dtype();
}

// The model's shards as the optimizer sees them: their FP8 copies only where AdamW writes them
// (precision.fp8_weights: optimizer). Without them the reducer builds no FP8 buckets, AdamW writes no copy, and the
// forward quantizes each FP8 weight once per parameter version.
static std::vector<ParamShard> optimizer_shards(const Config& c, const Transformer& model) {
  std::vector<ParamShard> shards = model.parameter_shards();
  if (c.precision.fp8_weights != Fp8WeightWriter::optimizer)
    for (ParamShard& s : shards) s.fp8 = nullptr;
  return shards;
}

// Several ranks reduce their gradients through a GradientReducer; one rank has none, unless its world is
// nccl's (parallel.backend: nccl), which then takes the several-rank step on one GPU: its collectives, the
// reducer's stream and the sharded optimizer.
static std::unique_ptr<GradientReducer> make_reducer(const Config& c, const ParallelState& ps,
                                                     const Transformer& model) {
  if (ps.world->size() == 1 && ps.world->backend_name() != std::string("nccl")) return nullptr;
  return std::make_unique<GradientReducer>(
      ps, model.parameters(), optimizer_shards(c, model), c.parallel.overlap_grad_reduce, kGradientBucketBytes,
      int(c.parallel.grad_reduce_sms), c.parallel.shard_optimizer, weight_dtype(c, model));
}

// AdamW's f32 masters. Sharded: the reducer's segments. Otherwise, where the weights are stored narrower than
// f32, each such parameter's f32 data becomes its master (flat) and the parameter holds its cast from now on,
// rewritten by AdamW at each update: nothing casts it at use. Undefined where a parameter is its own master.
static std::vector<Tensor> optimizer_masters(const Config& c, Transformer& model, const GradientReducer* reducer) {
  if (reducer && reducer->sharded()) return reducer->master_ranges();
  const DType dtype = weight_dtype(c, model);
  if (dtype == DType::f32) return {};
  std::vector<Variable> params = model.parameters();
  const std::vector<ParamShard>& shards = model.parameter_shards();
  std::vector<Tensor> masters(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    if (shards[i].reads_f32) continue;
    masters[i] = params[i].data();
    params[i].store_as(masters[i].to(dtype));
    masters[i] = masters[i].view({masters[i].numel()});
  }
  return masters;
}

static void check_router_lr_scale(const Config& cfg, const AdamW& opt) {
  FLOWMOE_CHECK(cfg.optimizer.router_lr_scale == 1.0 || opt.num_router_params() > 0, ConfigError,
                cfg.origin("optimizer.router_lr_scale"), ": optimizer.router_lr_scale is ",
                cfg.optimizer.router_lr_scale, " but the model has no MoE router (n_routed_experts is 0 or ",
                "first_k_dense_replace covers every layer)");
}

void RunSetup::build_optimizer() {
  Transformer& model = *model_;
  reducer_ = make_reducer(cfg, parallel, model);
  const bool sharded = reducer_ && reducer_->sharded();
  opt_.emplace(model.parameters(), cfg.optimizer,
               sharded ? reducer_->owned_ranges() : std::vector<std::pair<int64_t, int64_t>>{},
               optimizer_masters(cfg, model, reducer_.get()));
  check_router_lr_scale(cfg, *opt_);
  opt_->set_rounding_seed(uint64_t(cfg.train.seed));
  // AdamW writes the FP8 weights the forward reads where precision.fp8_weights asks it to; sharded, those the
  // reducer gathers.
  std::vector<std::shared_ptr<Fp8WeightCopy>> fp8_copies;
  if (sharded)
    fp8_copies = reducer_->gathered_fp8_copies();
  else
    for (const ParamShard& s : optimizer_shards(cfg, model)) fp8_copies.push_back(s.fp8);
  opt_->set_fp8_copies(std::move(fp8_copies));
}

}  // namespace flowmoe
