// A resume continues its checkpoint's data position, which counts windows into one corpus, split, sequence
// length, seed and batch: a config that reads other data is refused at set-up, naming the key and both
// values (train/run_checkpoint.cpp, kDataKeys), and keys that change nothing the run reads are not.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "dataset/data.h"
#include "kernels/common/error.h"
#include "tests/support/train_fixtures.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

Config resume_config(const fs::path& out_dir, std::vector<std::string> sets = {}) {
  sets.push_back("logging.out_dir=" + out_dir.string());
  return parse_config(
      "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2,"
      " intermediate_size: 64, max_position_embeddings: 16}\n"
      "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.1}\n"
      "train: {device: cpu, steps: 4, batch_size: 4, eval_every: 0}\n"
      "optimizer: {warmup_steps: 1}\n"
      "checkpoint: {every: 2}\n",
      "tiny_test.yaml", sets);
}

}  // namespace

TEST(ResumeData, EveryKeyThatChangesWhatTheRunReadsIsRefused) {
  const fs::path d = fresh_dir("resume_data");
  TrainOptions first = quiet();
  first.stop_after = 2;
  const std::string checkpoint = train(resume_config(d), first).last_checkpoint;
  ASSERT_FALSE(checkpoint.empty());
  // A token file of the synthetic corpus's size, for data.source.
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 20000; ++i) tokens.push_back(uint16_t(i * 7 % 64));
  write_token_file((d / "corpus.bin").string(), tokens);

  struct Change {
    std::string key, was;
    std::vector<std::string> sets;
  };
  const std::vector<Change> changes = {
      {"data.seq_len", "16", {"data.seq_len=8"}},
      {"train.batch_size", "4", {"train.batch_size=8"}},
      {"train.grad_accum_steps", "1", {"train.grad_accum_steps=2"}},
      {"data.synthetic_kind", "words", {"data.synthetic_kind=bigram"}},
      {"data.synthetic_tokens", "20000", {"data.synthetic_tokens=30000"}},
      {"data.val_fraction", "0.1", {"data.val_fraction=0.2"}},
      {"data.seed", "1234", {"data.seed=7"}},
      {"data.source", "synthetic", {"data.source=tokens", "data.path=" + (d / "corpus.bin").string()}},
  };
  for (const Change& c : changes) {
    std::vector<std::string> sets = c.sets;
    sets.push_back("checkpoint.resume=true");
    const Config cfg = resume_config(d, sets);
    const std::string now = c.sets.front().substr(c.sets.front().find('=') + 1);
    try {
      train(cfg, quiet());
      ADD_FAILURE() << c.key << " changed on resume was accepted";
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()), "--set " + c.sets.front() + ": " + c.key + ": " + now +
                                           " differs from the checkpoint's " + c.was + " (" + checkpoint +
                                           "): a resumed run must read the data its checkpoint's position counts in "
                                           "(the same corpus, split, sequence length, seed and batch)");
    }
  }
  // Keys that change nothing the run reads: the learning rate, and the synthetic corpus's keys of a run
  // that reads a token file (resumed from a checkpoint of its own).
  TrainResult r = train(resume_config(d, {"checkpoint.resume=true", "optimizer.lr=0.001"}), quiet());
  EXPECT_EQ(r.first_step, 3);
  EXPECT_EQ(r.last_step, 4);
  const std::vector<std::string> file = {"data.source=tokens", "data.path=" + (d / "corpus.bin").string()};
  train(resume_config(d / "file", file), first);
  std::vector<std::string> sets = file;
  sets.push_back("data.synthetic_kind=bigram");
  sets.push_back("checkpoint.resume=true");
  r = train(resume_config(d / "file", sets), quiet());
  EXPECT_EQ(r.first_step, 3);
  fs::remove_all(d);
}
