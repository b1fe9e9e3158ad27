// `flowmoe export --format hf` and `flowmoe import --format hf`: a checkpoint as a Hugging Face glm4_moe folder
// and back (checkpoint/hf_export.h).
#pragma once

namespace flowmoe {

int cmd_export(int argc, char** argv);  // 0; usage and config errors throw ConfigError (2)
int cmd_import(int argc, char** argv);

}  // namespace flowmoe
