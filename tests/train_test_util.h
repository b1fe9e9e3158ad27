// What the tests that run the trainer share: a directory of their own, emptied, options that print
// nothing, and a file's bytes.
#pragma once
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "tests/test_util.h"
#include "train/safetensors.h"
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

}  // namespace flowmoe::test
