// `flowmoe generate`: text from a checkpoint, with a K/V cache (train/generate.h).
#pragma once

namespace flowmoe {

int cmd_generate(int argc, char** argv);

}  // namespace flowmoe
