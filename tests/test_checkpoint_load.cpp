// What a run refuses to load or share: a checkpoint with tensors the model does not have (named; or left
// out with checkpoint.partial_load), a checkpoint holding NaN or Inf (named; or loaded with
// checkpoint.allow_nonfinite), a safetensors file whose tensors overlap or leave a gap, an output folder
// another run holds or that takes no files (io/dir_lock.h), a save that fails (it leaves no step_N.tmp
// behind), and the small pieces of the launch checks: the progress display under a launcher, the first key
// two ranks' configs differ in, and the router's limits as config ranges.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "io/dir_lock.h"
#include "kernels/common/error.h"
#include "kernels/router.h"
#include "parallel/distributed.h"
#include "tests/support/train_fixtures.h"
#include "train/progress.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// Two layers, the second a MoE layer with a shared expert, trained for 2 steps on the CPU.
Config small_config(const fs::path& out_dir) {
  Config c = parse_config(
      "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,"
      " intermediate_size: 64, max_position_embeddings: 16, n_routed_experts: 4, num_experts_per_tok: 2,"
      " n_shared_experts: 1, moe_intermediate_size: 16, first_k_dense_replace: 1}\n"
      "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.1}\n"
      "train: {device: cpu, steps: 2, batch_size: 4, eval_every: 0}\n"
      "optimizer: {warmup_steps: 1}\n"
      "logging: {progress: plain}\n",
      "small_test.yaml");
  c.logging.out_dir = out_dir.string();
  c.checkpoint.dir = (out_dir / "checkpoints").string();
  return c;
}

// A trained checkpoint of small_config, made once for the whole file.
const fs::path& trained_checkpoint() {
  static const fs::path dir = [] {
    const fs::path d = fresh_dir("ckpt_load_source");
    const TrainResult r = train(small_config(d / "run"), quiet());
    return fs::path(r.last_checkpoint);
  }();
  return dir;
}

// A copy of the trained checkpoint whose tensor `name` (in `file`) holds `value` at element 1.
fs::path checkpoint_with_value(const std::string& tag, const std::string& file, const std::string& name, float value) {
  const fs::path d = fresh_dir("ckpt_load_" + tag) / "step_00000002";
  fs::copy(trained_checkpoint(), d, fs::copy_options::recursive);
  std::vector<NamedTensor> tensors = read_safetensors((d / file).string());
  bool found = false;
  for (NamedTensor& t : tensors)
    if (t.name == name) {
      t.tensor.data<float>()[1] = value;
      found = true;
    }
  EXPECT_TRUE(found) << name;
  write_safetensors((d / file).string(), tensors, {{"format", "pt"}});
  return d;
}

// Resumes `checkpoint` with `cfg` (a run of 3 steps in out): what train() throws, or "" when it ran.
std::string resume_error(Config cfg, const fs::path& checkpoint, const fs::path& out) {
  cfg.logging.out_dir = out.string();
  cfg.checkpoint.dir = (out / "checkpoints").string();
  cfg.checkpoint.resume = checkpoint.string();
  cfg.train.steps = 3;
  try {
    train(cfg, quiet());
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A safetensors file by hand: the 8-byte little-endian length, the JSON header, `body_bytes` bytes of data.
std::string safetensors_bytes(const std::string& header, size_t body_bytes) {
  std::string b(8, '\0');
  for (int i = 0; i < 8; ++i) b[size_t(i)] = char((header.size() >> (8 * i)) & 0xff);
  return b + header + std::string(body_bytes, '\x01');
}

// A header entry of an F32 tensor of `n` elements at [begin, end).
std::string f32_entry(const std::string& name, int n, int begin, int end) {
  return "\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[" + std::to_string(n) + "],\"data_offsets\":[" +
         std::to_string(begin) + "," + std::to_string(end) + "]}";
}

// What read_safetensors says of a file of these bytes: "" when it reads.
std::string safetensors_error(const fs::path& file, const std::string& bytes) {
  std::ofstream(file, std::ios::binary) << bytes;
  try {
    read_safetensors(file.string());
  } catch (const IoError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// Fewer layers, tied embeddings or no shared experts make a model whose tensors are a subset of the
// checkpoint's: the load used to take that subset silently and run another model.
TEST(CheckpointLoad, TensorsTheModelDoesNotHaveAreRefusedByName) {
  const fs::path d = fresh_dir("ckpt_load_leftover");
  Config fewer = small_config(d), tied = small_config(d), no_shared = small_config(d);
  fewer.model.num_hidden_layers = 1;
  tied.model.tie_word_embeddings = true;
  no_shared.model.n_shared_experts = 0;
  const std::string e1 = resume_error(fewer, trained_checkpoint(), d / "fewer");
  EXPECT_TRUE(has(e1, "model.safetensors': ") && has(e1, "tensors are not in the model: 'model.layers.1.")) << e1;
  EXPECT_TRUE(has(e1, "checkpoint.partial_load: true")) << e1;
  const std::string e2 = resume_error(tied, trained_checkpoint(), d / "tied");
  EXPECT_TRUE(has(e2, "1 tensor is not in the model: 'lm_head.weight'")) << e2;
  const std::string e3 = resume_error(no_shared, trained_checkpoint(), d / "no_shared");
  EXPECT_TRUE(has(e3, "'model.layers.1.mlp.shared_experts.")) << e3;

  // partial_load takes the model's tensors and reports the rest; the moments of the left-out
  // parameters are left out alike.
  fewer.checkpoint.partial_load = true;
  EXPECT_EQ(resume_error(fewer, trained_checkpoint(), d / "fewer_partial"), "");
  Transformer model(fewer.model, Device::cpu(), DType::f32, 1, moe_options(fewer));
  const CheckpointMeta meta = load_checkpoint(trained_checkpoint().string(), model.parameters(), nullptr, nullptr,
                                              model.buffers(), {}, {.allow_unused = true});
  ASSERT_FALSE(meta.unused_tensors.empty());
  for (const std::string& name : meta.unused_tensors) EXPECT_TRUE(name.starts_with("model.layers.1.")) << name;
  EXPECT_TRUE(has(partial_load_note(meta), "tensors of the checkpoint that the model does not have"))
      << partial_load_note(meta);
  // A model the checkpoint matches loads with nothing left over.
  const Config same = small_config(d);
  Transformer whole(same.model, Device::cpu(), DType::f32, 1, moe_options(same));
  EXPECT_TRUE(load_checkpoint(trained_checkpoint().string(), whole.parameters(), nullptr, nullptr, whole.buffers())
                  .unused_tensors.empty());
  fs::remove_all(d);
}

TEST(CheckpointLoad, NanOrInfInAWeightOrMomentIsRefusedByName) {
  const fs::path d = fresh_dir("ckpt_load_nonfinite");
  const Config cfg = small_config(d);
  const std::string weight = "model.layers.0.self_attn.q_proj.weight";
  const fs::path nan_weight = checkpoint_with_value("nan", "model.safetensors", weight, NAN);
  const fs::path inf_moment = checkpoint_with_value("inf", "optimizer.safetensors", weight + ".exp_avg_sq", INFINITY);
  const std::string e1 = resume_error(cfg, nan_weight, d / "nan");
  EXPECT_TRUE(has(e1, "tensor '" + weight + "' holds nan at element 1")) << e1;
  EXPECT_TRUE(has(e1, "checkpoint.allow_nonfinite: true")) << e1;
  const std::string e2 = resume_error(cfg, inf_moment, d / "inf");
  EXPECT_TRUE(has(e2, "optimizer.safetensors': tensor '" + weight + ".exp_avg_sq' holds inf at element 1")) << e2;

  // allowed, the values arrive as they are
  Transformer model(cfg.model, Device::cpu(), DType::f32, 1, moe_options(cfg));
  EXPECT_THROW(load_checkpoint(nan_weight.string(), model.parameters(), nullptr, nullptr, model.buffers()), IoError);
  load_checkpoint(nan_weight.string(), model.parameters(), nullptr, nullptr, model.buffers(), {},
                  {.allow_nonfinite = true});
  for (const Variable& p : model.parameters()) {
    if (p.name() == weight) {
      EXPECT_TRUE(std::isnan(p.data().to_floats()[1]));
    }
  }
  fs::remove_all(d);
}

// One run per output folder: a second is refused naming the first's pid, and a killed holder (kill -9
// leaves no chance to clean up) blocks nobody: the kernel drops its lock.
TEST(RunDirLock, ASecondRunIsRefusedAndAKilledOneBlocksNothing) {
  const fs::path d = fresh_dir("run_dir_lock");
  const Config cfg = small_config(d / "run");
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t holder = ::fork();
  ASSERT_GE(holder, 0);
  if (holder == 0) {  // the first run: takes the lock, says so, waits to be killed
    DirLock lock((d / "run").string(), "the run directory");
    const char ok = 1;
    if (::write(ready[1], &ok, 1) != 1) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  char ok = 0;
  ASSERT_EQ(::read(ready[0], &ok, 1), 1);
  try {
    train(cfg, quiet());
    ADD_FAILURE() << "a second run into a held folder went ahead";
  } catch (const IoError& e) {
    EXPECT_TRUE(has(e.what(), "the run directory '" + (d / "run").string() +
                                  "' is in use by another flowmoe run (pid " + std::to_string(holder) + ")"))
        << e.what();
  }
  EXPECT_FALSE(fs::exists(d / "run" / "metrics.jsonl"));
  ::kill(holder, SIGKILL);
  ::waitpid(holder, nullptr, 0);
  ::close(ready[0]);
  ::close(ready[1]);
  EXPECT_EQ(train(cfg, quiet()).last_step, 2);

  // Within one process too, and a checkpoint folder outside the run folder is held as well.
  {
    DirLock held((d / "ckpt").string(), "the checkpoint directory");
    EXPECT_THROW(DirLock((d / "ckpt").string(), "the checkpoint directory"), IoError);
    Config elsewhere = cfg;
    elsewhere.checkpoint.dir = (d / "ckpt").string();
    EXPECT_THROW(train(elsewhere, quiet()), IoError);
  }
  EXPECT_NO_THROW(DirLock((d / "ckpt").string(), "the checkpoint directory"));
  fs::remove_all(d);
}

// A run holds its checkpoint folder inside its run folder too: a second run with a run folder of its own
// but checkpoint.dir pointing at the first's checkpoints/ would write its weights as the first's step_N.
// A checkpoint folder that is the run folder itself (however spelled) is locked once, not refused.
TEST(RunDirLock, TheCheckpointFolderInsideTheRunFolderIsHeldToo) {
  const fs::path d = fresh_dir("ckpt_dir_lock");
  const Config first = small_config(d / "first");
  Config second = small_config(d / "second");
  second.checkpoint.dir = first.checkpoint.dir;
  std::string refusal = "(the second run was not refused)";
  TrainOptions o = quiet();
  o.after_backward = [&](int64_t step, const std::vector<Variable>&) {
    if (step != 1) return;
    try {
      train(second, quiet());
    } catch (const IoError& e) {
      refusal = e.what();
    }
  };
  EXPECT_EQ(train(first, o).last_step, 2);
  EXPECT_TRUE(has(refusal, "the checkpoint directory '" + first.checkpoint.dir +
                               "' is in use by another flowmoe run (pid " + std::to_string(::getpid()) +
                               "); wait for it to end or give this run another checkpoint.dir"))
      << refusal;
  EXPECT_FALSE(fs::exists(d / "second" / "metrics.jsonl"));

  for (const std::string& spelling :
       {(d / "same").string(), (d / "same").string() + "/", (d / "." / "same").string()}) {
    Config same = small_config(d / "same");
    same.checkpoint.dir = spelling;
    EXPECT_EQ(train(same, quiet()).last_step, 2) << spelling;
    EXPECT_TRUE(fs::exists(d / "same" / "step_00000002" / "meta.json")) << spelling;
  }
  fs::remove_all(d);
}

// A checkpoint folder that takes no new files is refused at start, as one outside the run folder is,
// not at the first save after the steps before it. The run goes as another user where this one is root
// (whom a mode of 0555 does not stop), in a child whose message comes back through a pipe.
TEST(RunDirLock, AReadOnlyCheckpointFolderInsideTheRunFolderIsRefusedAtStart) {
  const fs::path d = fresh_dir("ckpt_dir_read_only");
  const fs::path run = d / "run", ckpt = run / "checkpoints";
  fs::create_directories(ckpt);
  // An earlier run's lock file, which still opens for writing where no new file can be made.
  std::ofstream(ckpt / "run.lock") << "1\n";
  fs::permissions(ckpt / "run.lock", fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                                         fs::perms::group_write | fs::perms::others_read | fs::perms::others_write);
  fs::permissions(d, fs::perms::all);
  fs::permissions(run, fs::perms::all);
  fs::permissions(ckpt, fs::perms::owner_read | fs::perms::owner_exec | fs::perms::group_read | fs::perms::group_exec |
                            fs::perms::others_read | fs::perms::others_exec);
  Config cfg = small_config(run);
  cfg.checkpoint.every = 1;
  int pipe_fds[2];
  ASSERT_EQ(::pipe(pipe_fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(120);  // the test's time limit for the child
    ::close(pipe_fds[0]);
    std::string message = "(no error)";
    if (::geteuid() == 0 && (::setgid(65534) != 0 || ::setuid(65534) != 0)) {
      message = "skip: cannot become another user";
    } else {
      try {
        train(cfg, quiet());
      } catch (const Error& e) {
        message = e.what();
      }
    }
    const bool sent = ::write(pipe_fds[1], message.data(), message.size()) == ssize_t(message.size());
    ::_exit(sent ? 0 : 1);
  }
  ::close(pipe_fds[1]);
  std::string message;
  char buf[512];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;) message.append(buf, size_t(n));
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  fs::permissions(ckpt, fs::perms::all);
  if (message.rfind("skip:", 0) == 0) GTEST_SKIP() << message;
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
  EXPECT_TRUE(has(message, "the checkpoint directory '" + ckpt.string() + "' is not writable: cannot create '" +
                               (ckpt / ".run.lock.probe").string() + "': Permission denied"))
      << message;
  EXPECT_FALSE(fs::exists(run / "metrics.jsonl")) << "a step ran before the refusal";
  fs::remove_all(d);
}

// A save whose write fails (here the file size limit refuses it with EFBIG, as a full disk refuses with
// ENOSPC) throws naming the file and the reason, and removes its step_N.tmp at once rather than leaving
// it to hold the disk's space until the next run's start.
TEST(CheckpointSave, AFailedSaveRemovesItsTemporaryDirectory) {
  const fs::path d = fresh_dir("ckpt_failed_save");
  const Variable w(Tensor::zeros({1 << 16}, DType::f32, Device::cpu()), true, "w");
  const std::vector<Tensor> moments = {Tensor::zeros({1 << 16}, DType::f32, Device::cpu())};
  CheckpointMeta meta;
  meta.step = 7;
  std::string error = "(the save went through)";
  try {
    FileSizeLimit limit(4096);  // the weights file is 256 KiB
    save_checkpoint(d.string(), meta, {w}, moments, moments, 3);
  } catch (const IoError& e) {
    error = e.what();
  }
  EXPECT_TRUE(
      has(error, "writing '" + (d / "step_00000007.tmp" / "model.safetensors").string() + "' failed: File too large"))
      << error;
  EXPECT_FALSE(fs::exists(d / "step_00000007.tmp"));
  EXPECT_FALSE(fs::exists(d / "step_00000007"));
  fs::remove_all(d);
}

TEST(Progress, AutoDrawsABarOnlyForOneProcessOnATerminal) {
  EXPECT_TRUE(auto_progress_bar(true, "xterm", false));
  EXPECT_TRUE(auto_progress_bar(true, nullptr, false));
  EXPECT_FALSE(auto_progress_bar(false, "xterm", false));
  EXPECT_FALSE(auto_progress_bar(true, "dumb", false));
  EXPECT_FALSE(auto_progress_bar(true, "xterm", true));  // mpirun's pseudo-terminal says nothing of the user's
}

TEST(LaunchChecks, TheFirstConfigDifferenceNamesTheKeyAndBothValues) {
  const std::string a = "model:\n  hidden_size: 128\n  n_group: 1\ntrain:\n  steps: 20\n";
  EXPECT_EQ(first_config_difference(a, 0, "model:\n  hidden_size: 128\n  n_group: 1\ntrain:\n  steps: 21\n", 3),
            "train.steps is 20 on rank 0 and 21 on rank 3");
  EXPECT_EQ(first_config_difference(a, 0, "model:\n  hidden_size: 64\n  n_group: 1\ntrain:\n  steps: 20\n", 1),
            "model.hidden_size is 128 on rank 0 and 64 on rank 1");
  EXPECT_EQ(first_config_difference(a, 0, "model:\n  hidden_size: 128\n  n_group: 1\n", 1),
            "rank 0 has 'train' where rank 1 has nothing");
  EXPECT_EQ(first_config_difference("command: train\n" + a, 0, "command: eval\n" + a, 2),
            "command is train on rank 0 and eval on rank 2");
  EXPECT_EQ(first_config_difference(a, 0, a + "# a comment\n", 1), "the texts differ only in spacing or comments");
}

// The router kernel routes a token in one warp (kernels/router.h): the config's ranges are its limits,
// so the documented range and the check agree.
TEST(ConfigLimits, TheRouterLimitsAreTheConfigRanges) {
  for (const auto& [key, limit] : {std::pair{"n_routed_experts", kRouterMaxExperts},
                                   {"num_experts_per_tok", kRouterMaxTopk},
                                   {"n_group", kRouterMaxGroups},
                                   {"topk_group", kRouterMaxGroups}}) {
    const std::string base = "model: {" + std::string(key) + ": ";
    try {
      parse_config(base + std::to_string(limit + 1) + "}\n", "limits.yaml");
      ADD_FAILURE() << key << " above the router's limit was accepted";
    } catch (const ConfigError& e) {
      EXPECT_TRUE(has(e.what(), std::string(key) + ": expected an integer in [")) << e.what();
      EXPECT_TRUE(has(e.what(), ", " + std::to_string(limit) + "], got " + std::to_string(limit + 1))) << e.what();
    }
  }
}

// The tensors' byte ranges must tile the data section: a norm weight pointed at the embedding's bytes
// (an overlap) is refused naming both, and bytes no tensor owns (a gap inside or at the end) naming them.
TEST(CheckpointLoad, SafetensorsRangesOverlappingOrLeavingAGapAreRefused) {
  const fs::path d = fresh_dir("ckpt_load_tiling");
  const fs::path file = d / "model.safetensors";
  const std::string embed = f32_entry("embed", 4, 0, 16), norm = f32_entry("norm", 2, 16, 24);
  EXPECT_EQ(safetensors_error(file, safetensors_bytes("{" + norm + "," + embed + "}", 24)), "");
  // An empty tensor takes no bytes: it may stand where a range begins or ends.
  EXPECT_EQ(
      safetensors_error(file, safetensors_bytes("{" + embed + "," + f32_entry("e", 0, 16, 16) + "," + norm + "}", 24)),
      "");

  const std::string prefix = "'" + file.string() + "': ";
  EXPECT_EQ(safetensors_error(file, safetensors_bytes("{" + embed + "," + f32_entry("norm", 2, 8, 16) + "}", 16)),
            prefix + "tensors 'embed' [0, 16) and 'norm' [8, 16) overlap in the data section");
  EXPECT_EQ(safetensors_error(file, safetensors_bytes("{" + embed + "," + f32_entry("norm", 4, 0, 16) + "}", 16)),
            prefix + "tensors 'embed' [0, 16) and 'norm' [0, 16) overlap in the data section");
  EXPECT_EQ(safetensors_error(file, safetensors_bytes("{" + embed + "," + f32_entry("e", 0, 8, 8) + "}", 16)),
            prefix + "tensors 'embed' [0, 16) and 'e' [8, 8) overlap in the data section");
  EXPECT_EQ(safetensors_error(file, safetensors_bytes("{" + embed + "," + f32_entry("norm", 2, 24, 32) + "}", 32)),
            prefix + "bytes [16, 24) of the data section belong to no tensor (the tensors must tile it with no gap)");
  EXPECT_EQ(safetensors_error(file, safetensors_bytes("{" + f32_entry("norm", 2, 8, 16) + "}", 16)),
            prefix + "bytes [0, 8) of the data section belong to no tensor (the tensors must tile it with no gap)");
  EXPECT_EQ(safetensors_error(file, safetensors_bytes("{" + embed + "}", 20)),
            prefix + "bytes [16, 20) of the data section belong to no tensor (the tensors must tile it with no gap)");
  fs::remove_all(d);
}
