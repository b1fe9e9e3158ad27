// The run configuration: one YAML file with sections model, data, train, optimizer, precision,
// parallel, checkpoint and logging, plus "section.key=value" overrides from the command line.
//
// Validation is strict and happens before any work: an unknown key, a wrong type, an out-of-range
// value or an inconsistent combination throws ConfigError naming the file, the line and the key
// ("configs/tiny.yaml:7: model.hidden_size: ..."). Overrides go through the same checks and are
// named "--set key=value". Model keys use the Hugging Face DeepSeek-V3 names (DESIGN.md §5); the
// model: section fills the layers' ModelConfig (layers/model_config.h).
// This header holds the sections as structs, which the schema and the checks read; config.h reads them.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/common/dtype.h"
#include "kernels/common/name_table.h"
#include "layers/model_config.h"
#include "layers/moe.h"
#include "parallel/dispatch.h"
#include "parallel/distributed.h"

namespace flowmoe {

// The choice keys the sections below hold as enums: each is parsed once from its name through its table
// (kernels/common/name_table.h), which also gives the schema its choices, in the table's order, and the config
// file its text.
enum class DataSource { synthetic, text, tokens };
inline constexpr EnumName<DataSource> kDataSourceNames[] = {
    {DataSource::synthetic, "synthetic"}, {DataSource::text, "text"}, {DataSource::tokens, "tokens"}};
enum class SyntheticKind { words, bigram };
inline constexpr EnumName<SyntheticKind> kSyntheticKindNames[] = {{SyntheticKind::words, "words"},
                                                                  {SyntheticKind::bigram, "bigram"}};
enum class DeviceChoice { automatic, cpu, cuda };
inline constexpr EnumName<DeviceChoice> kDeviceChoiceNames[] = {
    {DeviceChoice::automatic, "auto"}, {DeviceChoice::cpu, "cpu"}, {DeviceChoice::cuda, "cuda"}};
enum class NonfinitePolicy { skip, stop };
inline constexpr EnumName<NonfinitePolicy> kNonfinitePolicyNames[] = {{NonfinitePolicy::skip, "skip"},
                                                                      {NonfinitePolicy::stop, "stop"}};
// train.cuda_graph and parallel.shared_expert_overlap: auto decides from the run, on requires, off leaves out.
enum class AutoOnOff { automatic, on, off };
inline constexpr EnumName<AutoOnOff> kAutoOnOffNames[] = {
    {AutoOnOff::automatic, "auto"}, {AutoOnOff::on, "on"}, {AutoOnOff::off, "off"}};
enum class ParamDtype { automatic, f32 };
inline constexpr EnumName<ParamDtype> kParamDtypeNames[] = {{ParamDtype::automatic, "auto"}, {ParamDtype::f32, "f32"}};
enum class MetricsFormat { jsonl, csv };
inline constexpr EnumName<MetricsFormat> kMetricsFormatNames[] = {{MetricsFormat::jsonl, "jsonl"},
                                                                  {MetricsFormat::csv, "csv"}};
enum class ProgressMode { automatic, bar, plain };
inline constexpr EnumName<ProgressMode> kProgressModeNames[] = {
    {ProgressMode::automatic, "auto"}, {ProgressMode::bar, "bar"}, {ProgressMode::plain, "plain"}};

struct DataConfig {
  DataSource source = DataSource::synthetic;
  std::string path;  // text: a file or a directory of files; tokens: a .bin file
  int64_t seq_len = 128;
  double val_fraction = 0.05;
  int64_t seed = 1234;
  int64_t synthetic_tokens = 1 << 20;                   // size of the generated corpus
  SyntheticKind synthetic_kind = SyntheticKind::words;  // dataset/data.h
};

struct TrainConfig {
  DeviceChoice device = DeviceChoice::automatic;
  int64_t steps = 300;
  int64_t batch_size = 8;  // sequences per micro-batch
  int64_t grad_accum_steps = 1;
  int64_t eval_every = 100;  // 0: evaluate only at the end
  int64_t eval_batches = 4;
  int64_t sample_every = 0;  // steps between the greedy samples rank 0 prints (train/generate.h); 0: none
  int64_t seed = 42;
  NonfinitePolicy nonfinite = NonfinitePolicy::skip;
  std::string recompute;  // comma-joined modules recomputed in backward: "" or "moe_expert"
  bool recomputes(const std::string& module) const;
  int64_t max_skipped_steps = 10;
  // λ of the multi-token prediction loss (model.num_nextn_predict_layers > 0). DeepSeek-V3 trained with 0.3 for
  // its first 10T tokens and 0.1 after; flowmoe's runs are short, the regime of that first phase.
  double mtp_loss_weight = 0.3;
  AutoOnOff cuda_graph = AutoOnOff::automatic;  // replay the step as one CUDA graph (train/step_graph.h)
};

// precision.fp8_weights: who writes the FP8 copies the FP8 GEMMs read. optimizer (the default): AdamW writes them in
// its update (sharded, they are what is all-gathered), which moves fewer bytes than an update followed by a quantize;
// forward: the forward quantizes each FP8 weight once per parameter version. Parsed once; no effect under the bf16
// recipe, which has no FP8 weights.
enum class Fp8WeightWriter { forward, optimizer };
inline constexpr EnumName<Fp8WeightWriter> kFp8WeightWriterNames[] = {{Fp8WeightWriter::forward, "forward"},
                                                                      {Fp8WeightWriter::optimizer, "optimizer"}};

// precision.fp8_weight_transpose: whether each FP8 weight's exact block transpose (what dgrad reads) is kept beside
// it. stored (the default): written with the copy (AdamW's update or the forward's quantize) and kept; rebuilt: the
// backward rebuilds it from the copy where dgrad needs it and frees it after, which keeps 1 byte per FP8 weight
// parameter less and moves about 2 more per step. The same bits either way.
enum class Fp8WeightTranspose { stored, rebuilt };
inline constexpr EnumName<Fp8WeightTranspose> kFp8WeightTransposeNames[] = {{Fp8WeightTranspose::stored, "stored"},
                                                                            {Fp8WeightTranspose::rebuilt, "rebuilt"}};

struct OptimizerConfig {
  double lr = 3e-3;
  double min_lr = 3e-4;
  int64_t warmup_steps = 20;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;        // 0 disables clipping
  double router_lr_scale = 1.0;  // multiplies the learning rate of the MoE routers' gate weights
  // f32 | bf16: AdamW's exp_avg and exp_avg_sq (kernels/adamw.h)
  DType moment_dtype = DType::f32;
};

struct PrecisionConfig {
  MoeRecipe recipe = MoeRecipe::bf16;  // fp8_flow: the routed experts' GEMMs; fp8_full: every linear but the
                                       // routers and the head (DESIGN.md §1, §7)
  int64_t align_size = 16;             // 16 | 32 | 64 | 128
  // auto | f32: the dtype the model's weights are stored in. auto: the compute dtype (bf16 on the GPU) where the
  // forward reads it, with f32 masters in the optimizer; f32: f32 weights, cast at each use.
  ParamDtype param_dtype = ParamDtype::automatic;
  Fp8WeightWriter fp8_weights = Fp8WeightWriter::optimizer;
  Fp8WeightTranspose fp8_weight_transpose = Fp8WeightTranspose::stored;
};

// The data-parallel size is not a key: it is the number of processes the launcher started.
struct ParallelConfig {
  int64_t expert_parallel_size = 1;
  CommBackend backend = CommBackend::automatic;            // parallel/distributed.h
  EpDispatch ep_dispatch = EpDispatch::automatic;          // parallel/dispatch.h
  AutoOnOff shared_expert_overlap = AutoOnOff::automatic;  // shared experts on a side stream (layers/moe.h)
  int64_t exchange_chunks = 1;      // zero_sync: token chunks whose exchanges overlap the experts (layers/moe.h)
  int64_t exchange_sms = 0;         // chunks or dual micro-batches: SMs the grouped GEMMs leave to the exchanges
  double ep_capacity_factor = 0;    // zero_sync: receive rows as a multiple of an even load; 0: worst case
  bool dual_microbatch = false;     // two halves of the batch interleaved layer by layer (layers/transformer.h)
  bool overlap_grad_reduce = true;  // reduce gradient buckets during the backward (parallel/grad_reducer.h)
  int64_t grad_reduce_sms = 0;      // nccl: thread blocks the overlapped reduction may take; 0: nccl's choice
  bool shard_optimizer = true;      // optimizer and gradients over the data-parallel ranks (parallel/grad_reducer.h)
  double timeout_s = 600;           // a collective waiting longer ends the job (parallel/watchdog.h); 0: never
};

// checkpoint.init_from's form: this prefix, then the folder.
constexpr const char* kInitFromHfPrefix = "hf:";

struct CheckpointConfig {
  std::string dir;    // empty: <logging.out_dir>/checkpoints
  int64_t every = 0;  // steps between checkpoints; 0: only the final one
  bool final = true;  // a checkpoint at train.steps (false: timing runs skip writing it)
  int64_t keep_last = 3;
  std::string resume = "false";  // false | true (latest in dir) | path of a checkpoint directory
  bool partial_load = false;     // a loaded checkpoint may hold tensors the model does not have
  bool allow_nonfinite = false;  // a loaded checkpoint may hold NaN or Inf
  std::string init_from;         // "" | hf:DIR: a fresh run's weights from a Hugging Face glm4_moe folder
};

struct LoggingConfig {
  std::string out_dir;  // empty: runs/<config file name without extension>
  MetricsFormat metrics_format = MetricsFormat::jsonl;
  int64_t log_every = 10;
  ProgressMode progress = ProgressMode::automatic;
};

struct Config {
  ModelConfig model;
  DataConfig data;
  TrainConfig train;
  OptimizerConfig optimizer;
  PrecisionConfig precision;
  ParallelConfig parallel;
  CheckpointConfig checkpoint;
  LoggingConfig logging;

  std::string file;                            // the YAML file it came from ("" when built in code)
  std::map<std::string, std::string> origins;  // "section.key" -> "file:line" or "--set ..."

  // Where a key's value came from, for messages: "configs/tiny.yaml:7", "--set k=v" or "default".
  std::string origin(const std::string& dotted_key) const;
  std::string run_dir() const;         // logging.out_dir, or runs/<config file name>
  std::string checkpoint_dir() const;  // checkpoint.dir, or <run_dir()>/checkpoints
};

// The largest config file read: a config is a few kilobytes, and a whole-file read without a bound
// would take a wrong path (a log, a token file) into memory whole.
constexpr uint64_t kMaxConfigFileBytes = uint64_t(1) << 20;
// The resolved config a run writes into its run folder (and `parity --resume` reads back).
constexpr const char* kRunConfigFile = "config.yaml";

}  // namespace flowmoe
