// `flowmoe fp8-error`: the FP8 error of the expert GEMMs' weight gradients on a checkpoint's own
// activations and gradients, the scaling-aware transpose against double quantization (studies/fp8_error.h).
#pragma once

namespace flowmoe {

int cmd_fp8_error(int argc, char** argv);  // 0; usage and config errors throw ConfigError (2)

}  // namespace flowmoe
