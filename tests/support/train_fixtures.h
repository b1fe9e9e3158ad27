// What the tests that run the trainer share: a directory of their own, emptied, options that print
// nothing, a file's bytes, and a limit on the size of the files written.
#pragma once
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/safetensors.h"
#include "tests/support/checks.h"
#include "train/trainer.h"

namespace flowmoe::test {

// flowmoe_<name>_<seed> under the temp directory, emptied and created: the seed keeps two runs of the
// suite on one machine apart.
inline std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path d =
      std::filesystem::temp_directory_path() / ("flowmoe_" + name + "_" + std::to_string(test_seed()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// A file's bytes ("" when it cannot be read): checkpoints compared byte for byte.
inline std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A model small enough to train a dozen steps in about a second: 12 steps of 2 micro-batches on the CPU,
// evaluated every 4, saved every 6 (the last 2 kept), writing into out_dir.
inline Config tiny_config(const std::filesystem::path& out_dir) {
  Config c = parse_config(
      "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,"
      " intermediate_size: 64, max_position_embeddings: 16}\n"
      "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.1}\n"
      "train: {device: cpu, steps: 12, batch_size: 4, grad_accum_steps: 2, eval_every: 4, eval_batches: 2}\n"
      "optimizer: {lr: 0.01, min_lr: 0.001, warmup_steps: 3}\n"
      "checkpoint: {every: 6, keep_last: 2}\n"
      "logging: {progress: plain}\n",
      "tiny_test.yaml");
  c.logging.out_dir = out_dir.string();
  return c;
}

// The model weights of two checkpoint directories, tensor by tensor, bit for bit.
inline ::testing::AssertionResult same_model_weights(const std::string& checkpoint_a, const std::string& checkpoint_b) {
  const std::vector<NamedTensor> a = read_safetensors(checkpoint_a + "/model.safetensors");
  const std::vector<NamedTensor> b = read_safetensors(checkpoint_b + "/model.safetensors");
  if (a.size() != b.size()) return ::testing::AssertionFailure() << a.size() << " tensors against " << b.size();
  for (size_t i = 0; i < a.size(); ++i)
    if (const ::testing::AssertionResult same = bit_equal(a[i].tensor, b[i].tensor); !same)
      return ::testing::AssertionFailure() << a[i].name << ": " << same.message();
  return ::testing::AssertionSuccess();
}

// Train without progress output (the test reads the returned losses and the files).
inline TrainOptions quiet() {
  TrainOptions o;
  o.out = nullptr;
  return o;
}

// While it lives, a file of this process may not grow past `bytes`: a write beyond fails with EFBIG, as
// one on a full disk fails with ENOSPC (SIGXFSZ, which would end the process, is ignored meanwhile).
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) : old_handler_(std::signal(SIGXFSZ, SIG_IGN)) {
    ::getrlimit(RLIMIT_FSIZE, &before_);
    rlimit small = before_;
    small.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &small);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &before_);
    std::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  void (*old_handler_)(int);
  rlimit before_{};
};

}  // namespace flowmoe::test
