// `flowmoe export` and `flowmoe import` (see hf.h): options and help.
#include "examples/hf.h"

#include <cstdio>
#include <string>
#include <vector>

#include "checkpoint/hf_export.h"
#include "examples/args.h"

namespace flowmoe {

namespace {

const char* kExportHelp = R"(usage: flowmoe export --format hf CHECKPOINT OUT_DIR [--tokenizer FILE | --no-tokenizer]

Writes the model of a checkpoint as a Hugging Face folder that transformers loads with
AutoModelForCausalLM.from_pretrained(OUT_DIR): a model with multi-head attention as glm4_moe
(Glm4MoeForCausalLM: DeepSeek-V3's MoE with multi-head attention), one with model.attention mla as
deepseek_v3 (DeepseekV3ForCausalLM), MTP layers numbered as DeepSeek-V3 numbers them. OUT_DIR gets
config.json, model.safetensors (f32, transformers' names) and, where the run had a BPE tokenizer,
tokenizer.json and tokenizer_config.json. It is written into a temporary folder beside OUT_DIR and
renamed into place. A model these cannot hold (a softmax router; fewer than 2 experts in a group) is
refused naming the model.* key.

options:
  --format hf        the format (the only one)
  CHECKPOINT         a checkpoint directory (e.g. runs/tiny/checkpoints/step_00000300)
  OUT_DIR            a new folder, or an empty one; refused when it holds files or lies in a
                     checkpoint folder
  --tokenizer FILE   the BPE tokenizer to write (prepare-data's .bpe); default: the run's, the
                     .bpe beside data.path (data.source tokens) or bytes (data.source text)
  --no-tokenizer     write no tokenizer
  -h, --help         this text
)";

const char* kImportHelp = R"(usage: flowmoe import --format hf DIR --config-out FILE [--checkpoint-dir D]

Reads a Hugging Face glm4_moe or deepseek_v3 folder (config.json, model.safetensors or its shards with
model.safetensors.index.json, and tokenizer.json when there) and writes a flowmoe config and a
checkpoint of step 0 with its weights, zero AdamW moments and data position 0, so that
`flowmoe train --config FILE` starts from them (the config sets checkpoint.resume: true; edit its
data and train sections). A tokenizer.json in flowmoe's form is also written as FILE's .bpe, for
`prepare-data --tokenizer`. What flowmoe's model cannot represent (grouped-query attention, a
partial or scaled RoPE, attention biases, q/k norms, another model_type, ...) is refused naming the
config.json field; a missing tensor, a tensor of another shape, or a tokenizer whose vocab exceeds
vocab_size is refused too. Nothing is written then. The MTP layers (num_nextn_predict_layers) become
the model's multi-token prediction modules when every declared layer's tensors are there (export writes
them to mtp.safetensors, as DeepSeek-V3's releases hold them apart); otherwise they are left out with a
note.

options:
  --format hf          the format (the only one)
  DIR                  the Hugging Face model folder
  --config-out FILE    the config to write (a new file)
  --checkpoint-dir D   the checkpoint folder for step_00000000 (default: the config's,
                       runs/<FILE's name>/checkpoints); it must hold no checkpoint yet
  -h, --help           this text
)";

// --format's value: hf, the only format; `command` names the subcommand in messages.
void require_hf_format(const std::string& command, const std::string& format) {
  if (format != "hf")
    throw UsageError(command + ": --format " + (format.empty() ? "FORMAT is required" : "'" + format + "' is unknown") +
                     " (formats: hf)");
}

void print_lines(const std::vector<std::string>& lines, const char* command) {
  for (const std::string& line : lines) std::printf("%s: %s\n", command, line.c_str());
}

}  // namespace

int cmd_export(int argc, char** argv) {
  Args args(argc, argv, 2, kExportHelp);
  std::string format;
  std::vector<std::string> positional;
  HfExportOptions options;
  while (!args.done()) {
    const std::string a = args.next();
    if (a == "--format")
      format = args.value(a);
    else if (a == "--tokenizer")
      options.tokenizer = args.value(a);
    else if (a == "--no-tokenizer")
      options.no_tokenizer = true;
    else if (a.rfind("-", 0) == 0)
      throw UsageError("export: unknown option '" + a + "' (see flowmoe export --help)");
    else
      positional.push_back(a);
  }
  require_hf_format("export", format);
  if (positional.size() != 2) throw UsageError("export: give CHECKPOINT and OUT_DIR (see flowmoe export --help)");
  if (options.no_tokenizer && !options.tokenizer.empty())
    throw UsageError("export: --tokenizer and --no-tokenizer exclude each other");
  print_lines(export_hf(positional[0], positional[1], options), "export");
  return 0;
}

int cmd_import(int argc, char** argv) {
  Args args(argc, argv, 2, kImportHelp);
  std::string format;
  std::vector<std::string> positional;
  HfImportOptions options;
  while (!args.done()) {
    const std::string a = args.next();
    if (a == "--format")
      format = args.value(a);
    else if (a == "--config-out")
      options.config_out = args.value(a);
    else if (a == "--checkpoint-dir")
      options.checkpoint_dir = args.value(a);
    else if (a.rfind("-", 0) == 0)
      throw UsageError("import: unknown option '" + a + "' (see flowmoe import --help)");
    else
      positional.push_back(a);
  }
  require_hf_format("import", format);
  if (positional.size() != 1) throw UsageError("import: give one folder DIR (see flowmoe import --help)");
  if (options.config_out.empty()) throw UsageError("import: --config-out FILE is required");
  print_lines(import_hf(positional[0], options), "import");
  return 0;
}

}  // namespace flowmoe
