// Checkpoints: weights and optimizer state in the safetensors format (safetensors.h), plus meta.json.
// A checkpoint is a directory <root>/step_00000100/ with model.safetensors (fp32 master weights,
// Hugging Face names), optimizer.safetensors (<name>.exp_avg, <name>.exp_avg_sq, in
// optimizer.moment_dtype: f32 or bf16) and meta.json (step, optimizer step count, data position, the
// resolved config). It is written into a temporary directory, every file fsynced, then renamed into
// place, so a crash never leaves a half checkpoint.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "config/config.h"
#include "dataset/data.h"
#include "engine/autograd.h"
#include "io/run_files.h"  // kCheckpointModelFile, kCheckpointMetaFile
#include "parallel/param_shard.h"

namespace flowmoe {

struct CheckpointMeta {
  int64_t step = 0;           // optimizer steps taken (including skipped ones)
  int64_t num_updates = 0;    // AdamW's t (skipped steps do not count)
  int64_t skipped_steps = 0;  // steps skipped for non-finite values so far
  DataPosition data;          // where the batch order continues
  uint64_t data_seed = 0;     // the seed of that order (checked on resume)
  uint64_t init_seed = 0;     // train.seed of the weight init (no random numbers are drawn after it)
  std::string config_yaml;    // the resolved config of the run
  // Tensors of the checkpoint that the model did not take (a partial load), sorted; empty otherwise.
  std::vector<std::string> unused_tensors;
};

// What load_checkpoint accepts beyond an exact match (checkpoint.partial_load, checkpoint.allow_nonfinite).
struct CheckpointLoadOptions {
  // Tensors of the file that the model does not have are left unread (fine-tuning a smaller model)
  // instead of refused. Every tensor of the model must still be in the file.
  bool allow_unused = false;
  // Weights or moments holding NaN or Inf are loaded instead of refused.
  bool allow_nonfinite = false;
};

inline CheckpointLoadOptions checkpoint_load_options(const Config& cfg) {
  return {cfg.checkpoint.partial_load, cfg.checkpoint.allow_nonfinite};
}

// "; left out N tensors of the checkpoint that the model does not have (...)" after a partial load, else "".
std::string partial_load_note(const CheckpointMeta& meta);

// Writes <root>/step_<step>/ atomically and deletes all but the newest keep_last checkpoints.
// Returns the checkpoint's directory.
// buffers: model state without gradients or moments (MoE expert biases), stored beside the weights.
std::string save_checkpoint(const std::string& root, const CheckpointMeta& meta, const std::vector<Variable>& params,
                            const std::vector<Tensor>& exp_avg, const std::vector<Tensor>& exp_avg_sq,
                            int64_t keep_last, const std::vector<Variable>& buffers = {});
// The directory save_checkpoint(root, meta with this step, ...) writes and returns.
std::string checkpoint_path(const std::string& root, int64_t step);
// The newest complete checkpoint under root, or "" when there is none.
std::string latest_checkpoint(const std::string& root);
// Deletes the step_N.tmp directories under root that a crash during a save left behind (a run
// calls it before its first save). Returns their names, sorted; throws IoError if one cannot go.
std::vector<std::string> remove_stale_checkpoint_tmp(const std::string& root);
// The meta.json of the checkpoint at dir (its counts and the resolved config of its run), read alone: IoError
// when dir holds none or it is damaged. load_checkpoint returns the same.
CheckpointMeta read_checkpoint_meta(const std::string& dir);
// Fills params (and the moments, when given) from the checkpoint at dir; names, shapes and dtypes
// must match (IoError names the first that does not), but for the moments' dtype: an f32 or bf16
// moment loads into an f32 or bf16 one, converted (f32 to bf16 rounded to nearest even, bf16 to f32
// exactly). Every tensor of the files read must be used, so a checkpoint of a larger model (more
// layers, untied embeddings, shared experts) is refused naming the tensors left over, and a weight or
// moment holding NaN or Inf is refused naming the tensor; `options` relaxes either. A damaged checkpoint throws
// IoError, never anything else. Returns its meta. shards (one per parameter, or empty: all whole): a sharded parameter
// and its moments take their rows [offset, offset + rows) of the file's tensor, which must have the full shape, and
// only those rows are read. A checkpoint holds full tensors, so it loads at any expert-parallel size. Each tensor goes
// from the file to its parameter through a host copy of its own: the host never holds the file.
CheckpointMeta load_checkpoint(const std::string& dir, const std::vector<Variable>& params,
                               std::vector<Tensor>* exp_avg = nullptr, std::vector<Tensor>* exp_avg_sq = nullptr,
                               const std::vector<Variable>& buffers = {}, const std::vector<ParamShard>& shards = {},
                               const CheckpointLoadOptions& options = {});

}  // namespace flowmoe
