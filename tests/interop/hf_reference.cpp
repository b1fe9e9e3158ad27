// flowmoe's side of tests/interop/check_hf_export.py: the logits of a checkpoint's model on the CPU in f32, for
// the token ids of a token file (dataset/data.h), written as raw f32 [T, V] for transformers' to be compared with.
//   hf_reference CHECKPOINT TOKENS.bin LOGITS.f32
#include <cstdio>
#include <exception>
#include <filesystem>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "dataset/data.h"
#include "io/file_io.h"
#include "layers/transformer.h"
#include "train/train_options.h"

using namespace flowmoe;

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: hf_reference CHECKPOINT TOKENS.bin LOGITS.f32\n");
    return 2;
  }
  try {
    const std::string checkpoint = argv[1];
    const CheckpointMeta meta = read_checkpoint_meta(checkpoint);
    const Config cfg = parse_checkpoint_config(meta.config_yaml, checkpoint + "/meta.json");
    const std::vector<uint16_t> tokens = read_token_file(argv[2]);
    Transformer model(cfg.model, Device::cpu(), DType::f32, 0, moe_options(cfg));
    load_checkpoint(checkpoint, model.parameters(), nullptr, nullptr, model.buffers());
    Tensor ids = Tensor::empty({1, int64_t(tokens.size())}, DType::i32);
    for (size_t i = 0; i < tokens.size(); ++i) ids.data<int32_t>()[i] = tokens[i];
    NoGradGuard no_grad;
    const Tensor logits = model.forward(ids).data().contiguous();
    const std::string bytes(static_cast<const char*>(logits.raw_data()), logits.nbytes());
    write_file_synced(argv[3], {&bytes});
    std::printf("hf_reference: %lld tokens, logits [%lld, %lld] of %s\n", static_cast<long long>(tokens.size()),
                static_cast<long long>(logits.size(1)), static_cast<long long>(logits.size(2)), checkpoint.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_reference: error: %s\n", e.what());
    return 1;
  }
}
