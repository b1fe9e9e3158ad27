// Checkpoints: the safetensors format (read back here and by Python's safetensors package), atomic
// directories with keep-last-N, and resume: on the CPU an interrupted-and-resumed run repeats the
// uninterrupted loss sequence bit for bit.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "checkpoint/checkpoint.h"
#include "kernels/common/error.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

bool bits_equal(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

TEST(Safetensors, RoundTripEveryDtype) {
  fs::path d = fresh_dir("ckpt_roundtrip");
  std::vector<NamedTensor> ts = {
      {"w.f32", Tensor::from_floats({1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, -7.0f}, {2, 3})},
      {"w.bf16", Tensor::from_floats({1.0f, 0.5f, -3.0f}, {3}, DType::bf16)},
      {"steps.i64", Tensor::from_ints({1, -2, int64_t(1) << 40}, {3}, DType::i64)},
      {"ids.i32", Tensor::from_ints({7, 8}, {1, 2}, DType::i32)},
      {"bytes.u8", Tensor::from_ints({0, 255, 3}, {3}, DType::u8)},
      {"empty", Tensor::empty({0, 4}, DType::f32)},
      {"scalar", Tensor::from_floats({42.0f}, {})},
  };
  std::string path = (d / "t.safetensors").string();
  write_safetensors(path, ts, {{"format", "pt"}, {"note", "quote \" and \\ and\nnewline"}});

  std::string bytes = read_bytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);  // little-endian host
  EXPECT_EQ(n % 8, 0u) << "the data should start 8-byte aligned";
  EXPECT_EQ(bytes[8], '{');

  std::map<std::string, std::string> meta;
  auto back = read_safetensors(path, &meta);
  ASSERT_EQ(back.size(), ts.size());
  for (size_t i = 0; i < ts.size(); ++i) {
    SCOPED_TRACE(ts[i].name);
    EXPECT_EQ(back[i].name, ts[i].name);  // file order is write order
    EXPECT_EQ(back[i].tensor.dtype(), ts[i].tensor.dtype());
    EXPECT_EQ(back[i].tensor.shape(), ts[i].tensor.shape());
    EXPECT_TRUE(bit_equal(back[i].tensor, ts[i].tensor));
  }
  EXPECT_EQ(meta["format"], "pt");
  EXPECT_EQ(meta["note"], "quote \" and \\ and\nnewline");
  fs::remove_all(d);
}

TEST(Safetensors, CorruptFilesAreNamed) {
  fs::path d = fresh_dir("ckpt_corrupt");
  std::string path = (d / "c.safetensors").string();
  write_safetensors(path, {{"a", Tensor::from_floats({1, 2, 3, 4}, {4})}});
  fs::resize_file(path, fs::file_size(path) - 4);
  try {
    read_safetensors(path);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("c.safetensors"), std::string::npos) << e.what();
  }
  std::ofstream(path, std::ios::binary) << "abc";
  EXPECT_THROW(read_safetensors(path), IoError);
  EXPECT_THROW(dtype_from_safetensors("F16"), IoError);
  fs::remove_all(d);
}

TEST(Checkpoint, AtomicDirectoriesAndKeepLast) {
  fs::path d = fresh_dir("ckpt_keep");
  std::vector<Variable> params = {Variable(Tensor::from_floats({1, 2, 3}, {3}), true, "a.weight"),
                                  Variable(Tensor::from_floats({4, 5, 6, 7}, {2, 2}), true, "b.weight")};
  std::vector<Tensor> m = {Tensor::zeros({3}, DType::f32), Tensor::full({2, 2}, 0.5, DType::f32)};
  std::vector<Tensor> v = {Tensor::full({3}, 2.0, DType::f32), Tensor::zeros({2, 2}, DType::f32)};
  fs::create_directories(d / "step_00000099.tmp");  // a crashed save: never taken for a checkpoint
  for (int64_t step : {1, 2, 3}) {
    CheckpointMeta meta;
    meta.step = step;
    meta.num_updates = step - 1;
    meta.skipped_steps = 1;
    meta.data = {2, uint64_t(step * 10)};
    meta.data_seed = 77;
    meta.init_seed = 5;
    meta.config_yaml = "model:\n  vocab_size: 64\n";
    save_checkpoint(d.string(), meta, params, m, v, 2);
  }
  EXPECT_FALSE(fs::exists(d / "step_00000001"));
  EXPECT_TRUE(fs::exists(d / "step_00000002"));
  EXPECT_TRUE(fs::exists(d / "step_00000003" / "model.safetensors"));
  EXPECT_TRUE(fs::exists(d / "step_00000003" / "optimizer.safetensors"));
  EXPECT_FALSE(fs::exists(d / "step_00000003.tmp"));
  EXPECT_EQ(latest_checkpoint(d.string()), (d / "step_00000003").string());
  EXPECT_EQ(latest_checkpoint((d / "nothing").string()), "");

  std::vector<Variable> fresh = {Variable(Tensor::zeros({3}, DType::f32), true, "a.weight"),
                                 Variable(Tensor::zeros({2, 2}, DType::f32), true, "b.weight")};
  std::vector<Tensor> m2 = {Tensor::zeros({3}, DType::f32), Tensor::zeros({2, 2}, DType::f32)};
  std::vector<Tensor> v2 = {Tensor::zeros({3}, DType::f32), Tensor::zeros({2, 2}, DType::f32)};
  CheckpointMeta meta = load_checkpoint(latest_checkpoint(d.string()), fresh, &m2, &v2);
  EXPECT_EQ(meta.step, 3);
  EXPECT_EQ(meta.num_updates, 2);
  EXPECT_EQ(meta.skipped_steps, 1);
  EXPECT_EQ(meta.data.epoch, 2u);
  EXPECT_EQ(meta.data.cursor, 30u);
  EXPECT_EQ(meta.data_seed, 77u);
  EXPECT_EQ(meta.init_seed, 5u);
  EXPECT_EQ(meta.config_yaml, "model:\n  vocab_size: 64\n");
  EXPECT_EQ(fresh[1].data().to_floats(), (std::vector<float>{4, 5, 6, 7}));
  EXPECT_EQ(m2[1].to_floats(), (std::vector<float>{0.5, 0.5, 0.5, 0.5}));
  EXPECT_EQ(v2[0].to_floats(), (std::vector<float>{2, 2, 2}));

  // A model of another shape is refused with the tensor named.
  std::vector<Variable> other = {Variable(Tensor::zeros({4}, DType::f32), true, "a.weight")};
  try {
    load_checkpoint((d / "step_00000003").string(), other);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("'a.weight'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(load_checkpoint((d / "step_00000001").string(), fresh), IoError);
  fs::remove_all(d);
}

// The resume guarantee: run 12 steps straight; run 6, stop, resume to 12. Every loss, the final
// weights and the metrics file agree bit for bit.
namespace {

// Trains 12 steps straight, and 6 + 6 with a resume between, from `extra` overrides of tiny_config.
void expect_resume_repeats_bit_for_bit(const std::string& name, const std::vector<std::string>& extra) {
  fs::path d = fresh_dir(name);
  const auto config = [&](const fs::path& out) {
    Config c = tiny_config(out);
    for (const std::string& o : extra) apply_override(c, o);
    validate(c);
    return c;
  };

  Config straight = config(d / "straight");
  TrainResult a = train(straight, quiet());
  ASSERT_EQ(a.losses.size(), 12u);
  EXPECT_FALSE(a.interrupted);

  Config split = config(d / "split");
  TrainOptions stop6 = quiet();
  stop6.stop_after = 6;
  TrainResult b = train(split, stop6);
  ASSERT_EQ(b.losses.size(), 6u);
  EXPECT_TRUE(b.interrupted);
  EXPECT_EQ(b.last_checkpoint, (d / "split" / "checkpoints" / "step_00000006").string());

  apply_override(split, "checkpoint.resume=true");
  TrainResult c = train(split, quiet());
  EXPECT_EQ(c.first_step, 7);
  ASSERT_EQ(c.losses.size(), 6u);

  for (size_t i = 0; i < 12; ++i) {
    double resumed = i < 6 ? b.losses[i] : c.losses[i - 6];
    EXPECT_TRUE(bits_equal(a.losses[i], resumed))
        << "step " << i + 1 << ": uninterrupted " << a.losses[i] << " vs resumed " << resumed;
  }
  EXPECT_TRUE(bits_equal(a.final_val_loss, c.final_val_loss)) << a.final_val_loss << " vs " << c.final_val_loss;
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_bytes(d / "straight" / "checkpoints" / "step_00000012" / f),
              read_bytes(d / "split" / "checkpoints" / "step_00000012" / f))
        << f << " differs after resume";

  // The resumed run's metrics hold each step once, in order, with the same losses.
  auto rows = read_metrics(c.metrics_file), straight_rows = read_metrics(a.metrics_file);
  ASSERT_EQ(rows.size(), 12u);
  for (size_t i = 0; i < rows.size(); ++i) {
    EXPECT_EQ(rows[i].step, int64_t(i) + 1);
    EXPECT_EQ(rows[i].loss, straight_rows[i].loss);
  }
  // Resuming a finished run does nothing.
  TrainResult again = train(split, quiet());
  EXPECT_TRUE(again.losses.empty());
  EXPECT_EQ(again.last_step, 12);
  fs::remove_all(d);
}

}  // namespace

TEST(Checkpoint, ResumeRepeatsTheLossSequenceBitForBit) { expect_resume_repeats_bit_for_bit("ckpt_resume", {}); }

// An evaluation at the step of the checkpoint runs in the interrupted run and in the straight one,
// but not in the resumed one: it must leave the expert biases' load counts alone.
TEST(Checkpoint, ResumeOfAnMoeModelRepeatsTheLossSequenceBitForBit) {
  expect_resume_repeats_bit_for_bit(
      "ckpt_resume_moe",
      {"model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.first_k_dense_replace=1",
       "model.moe_intermediate_size=32", "model.bias_update_rule=proportional", "train.eval_every=3"});
}

// Multi-token prediction modules (an MoE one, with its expert bias) are saved and resumed like the model's layers.
TEST(Checkpoint, ResumeWithMtpModulesRepeatsTheLossSequenceBitForBit) {
  expect_resume_repeats_bit_for_bit(
      "ckpt_resume_mtp", {"model.n_routed_experts=4", "model.num_experts_per_tok=2", "model.first_k_dense_replace=1",
                          "model.moe_intermediate_size=32", "model.num_nextn_predict_layers=2"});
}

// bf16 moments round stochastically from (train.seed, AdamW's update count, tensor, element): a resumed run
// draws what the uninterrupted one drew, so it repeats it bit for bit too, its bf16 moment files included.
TEST(Checkpoint, ResumeWithBf16MomentsRepeatsTheLossSequenceBitForBit) {
  expect_resume_repeats_bit_for_bit("ckpt_resume_bf16_moments", {"optimizer.moment_dtype=bf16"});
}

TEST(Checkpoint, ResumeFromAMissingPathIsAConfigError) {
  fs::path d = fresh_dir("ckpt_badresume");
  Config c = tiny_config(d / "run");
  apply_override(c, "checkpoint.resume=" + (d / "no_such_checkpoint").string());
  try {
    train(c, quiet());
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("checkpoint.resume"), std::string::npos) << e.what();
  }
  fs::remove_all(d);
}

// checkpoint.resume may name a folder of checkpoints (a run's checkpoints/): its newest complete one.
TEST(Checkpoint, ResumeFromAFolderTakesItsNewestCompleteCheckpoint) {
  fs::path d = fresh_dir("ckpt_resume_folder");
  Config first = tiny_config(d / "run");
  TrainOptions stop6 = quiet();
  stop6.stop_after = 6;
  ASSERT_EQ(train(first, stop6).last_step, 6);
  const fs::path folder = d / "run" / "checkpoints";
  fs::create_directories(folder / "step_00000011");  // no meta.json: never taken

  Config again = tiny_config(d / "run");
  apply_override(again, "checkpoint.resume=" + folder.string());
  TrainResult r = train(again, quiet());
  EXPECT_EQ(r.first_step, 7);
  EXPECT_EQ(r.last_step, 12);

  Config none = tiny_config(d / "other");
  fs::create_directories(d / "empty" / "step_00000003");
  apply_override(none, "checkpoint.resume=" + (d / "empty").string());
  EXPECT_TRUE(throws_naming<ConfigError>([&] { train(none, quiet()); },
                                         {"checkpoint.resume", "holds no complete checkpoint (no step_N/meta.json)"}));
  fs::remove_all(d);
}

TEST(Checkpoint, RemovesOnlyUnfinishedStepDirectories) {
  fs::path d = fresh_dir("ckpt_stale");
  fs::create_directories(d / "step_00000020.tmp");
  std::ofstream(d / "step_00000020.tmp" / "model.safetensors") << "half a file";
  fs::create_directories(d / "step_00000005.tmp");
  fs::create_directories(d / "step_00000007");
  std::ofstream(d / "step_00000007" / "meta.json") << "{}";
  fs::create_directories(d / "notes.tmp");             // not a checkpoint's
  fs::create_directories(d / "step_x.tmp");            // not a step number
  std::ofstream(d / "step_00000009.tmp") << "a file";  // not a directory
  EXPECT_EQ(remove_stale_checkpoint_tmp(d.string()),
            (std::vector<std::string>{"step_00000005.tmp", "step_00000020.tmp"}));
  EXPECT_FALSE(fs::exists(d / "step_00000020.tmp"));
  EXPECT_FALSE(fs::exists(d / "step_00000005.tmp"));
  for (const char* kept : {"step_00000007", "notes.tmp", "step_x.tmp", "step_00000009.tmp"})
    EXPECT_TRUE(fs::exists(d / kept)) << kept;
  EXPECT_TRUE(remove_stale_checkpoint_tmp(d.string()).empty());
  EXPECT_TRUE(remove_stale_checkpoint_tmp((d / "missing").string()).empty());
  fs::remove_all(d);
}

// A run clears the unfinished directories of a crashed save before it starts, and says so.
TEST(Checkpoint, TrainingRemovesUnfinishedCheckpointDirectories) {
  fs::path d = fresh_dir("ckpt_stale_train");
  Config c = tiny_config(d / "run");
  c.train.steps = 2;
  c.optimizer.warmup_steps = 1;
  const fs::path stale = fs::path(c.checkpoint_dir()) / "step_00000004.tmp";
  fs::create_directories(stale);
  TrainOptions opts;
  opts.out = std::tmpfile();
  ASSERT_NE(opts.out, nullptr);
  train(c, opts);
  std::rewind(opts.out);
  std::string printed;
  for (int ch; (ch = std::fgetc(opts.out)) != EOF;) printed += char(ch);
  std::fclose(opts.out);
  EXPECT_NE(printed.find("removed 1 unfinished checkpoint directory from a previous run: step_00000004.tmp\n"),
            std::string::npos)
      << printed;
  EXPECT_FALSE(fs::exists(stale));
  fs::remove_all(d);
}

// checkpoint.final: false leaves out the checkpoint at the last step (a timing run), not the periodic
// ones: every 3 of 4 steps saves step 3 alone; with every 0 nothing is written.
TEST(Checkpoint, FinalFalseLeavesOutOnlyTheLastStepsCheckpoint) {
  fs::path d = fresh_dir("ckpt_final");
  for (int64_t every : {3, 0}) {
    Config c = tiny_config(d / ("every" + std::to_string(every)));
    c.train.steps = 4;
    c.optimizer.warmup_steps = 1;
    c.checkpoint.every = every;
    c.checkpoint.final = false;
    TrainOptions opts;
    const TrainResult r = train(c, opts);
    EXPECT_EQ(r.last_checkpoint, every ? checkpoint_path(c.checkpoint_dir(), 3) : "");
    EXPECT_EQ(latest_checkpoint(c.checkpoint_dir()), every ? checkpoint_path(c.checkpoint_dir(), 3) : "");
  }
  Config c = tiny_config(d / "default");  // and by default the last step's checkpoint is there
  c.train.steps = 4;
  c.optimizer.warmup_steps = 1;
  TrainOptions opts;
  EXPECT_EQ(train(c, opts).last_checkpoint, checkpoint_path(c.checkpoint_dir(), 4));
  fs::remove_all(d);
}

// Directory names that look like checkpoints but are not are skipped, whatever their digits.
TEST(Checkpoint, OddDirectoryNamesAreNotCheckpoints) {
  fs::path d = fresh_dir("ckpt_odd_names");
  for (const char* name : {"step_99999999999999999999999", "step_", "step_12a", "step_-3"}) {
    fs::create_directories(d / name);
    std::ofstream(d / name / "meta.json") << "{}";
  }
  EXPECT_EQ(latest_checkpoint(d.string()), "");
  fs::create_directories(d / "step_00000002");
  std::ofstream(d / "step_00000002" / "meta.json") << "{}";
  EXPECT_EQ(latest_checkpoint(d.string()), (d / "step_00000002").string());
  fs::remove_all(d);
}

// Python's safetensors package opens a real checkpoint and sees the same names, shapes and values.
// The packages come from scripts/install_python_deps.sh (run by the test command) in .deps/python.
TEST(Checkpoint, PythonSafetensorsOpensCheckpoints) {
  const char* inherited = std::getenv("PYTHONPATH");
  const std::string python = "PYTHONPATH='" FLOWMOE_SOURCE_DIR "/.deps/python" +
                             std::string(inherited && *inherited ? std::string(":") + inherited : "") + "' python3";
  if (std::system((python + " -c 'import safetensors.numpy, numpy' >/dev/null 2>&1").c_str()) != 0)
    GTEST_SKIP() << "python3 with the safetensors and numpy packages is not available "
                    "(scripts/install_python_deps.sh installs them): Python interoperability not checked";
  fs::path d = fresh_dir("ckpt_python");
  Config c = tiny_config(d / "run");
  c.train.steps = 2;
  c.optimizer.warmup_steps = 1;
  TrainResult r = train(c, quiet());
  fs::path ckpt = r.last_checkpoint;

  // The expected names, shapes and a checksum of every tensor, as the C++ reader sees them.
  std::ostringstream expect;
  expect << "{";
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    for (const NamedTensor& nt : read_safetensors((ckpt / file).string())) {
      double sum = 0;
      for (double x : nt.tensor.to_doubles()) sum += x;
      expect << "'" << file << ":" << nt.name << "': ((";
      for (int i = 0; i < nt.tensor.dim(); ++i) expect << nt.tensor.size(i) << ",";
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17g", sum);
      expect << "), " << buf << "),";
    }
  }
  expect << "}";
  fs::path script = d / "check.py";
  std::ofstream(script) << "import sys, numpy as np\n"
                           "from safetensors import safe_open\n"
                           "expect = "
                        << expect.str()
                        << "\n"
                           "seen = 0\n"
                           "for f in ['model.safetensors', 'optimizer.safetensors']:\n"
                           "    with safe_open(sys.argv[1] + '/' + f, framework='numpy') as st:\n"
                           "        assert st.metadata() == {'format': 'pt'}, st.metadata()\n"
                           "        for k in st.keys():\n"
                           "            t = st.get_tensor(k)\n"
                           "            shape, total = expect[f + ':' + k]\n"
                           "            assert t.dtype == np.float32, (k, t.dtype)\n"
                           "            assert t.shape == shape, (k, t.shape, shape)\n"
                           "            s = float(np.sum(t.astype(np.float64)))\n"
                           "            assert abs(s - total) <= 1e-9 * (1 + abs(total)), (k, s, total)\n"
                           "            seen += 1\n"
                           "assert seen == len(expect), (seen, len(expect))\n"
                           "print('python safetensors: %d tensors match' % seen)\n";
  int status = std::system((python + " " + script.string() + " " + ckpt.string()).c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the Python check failed (its output is above)";
  fs::remove_all(d);
}
