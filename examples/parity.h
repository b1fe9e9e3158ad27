// `flowmoe parity`: trains one config once per precision recipe and reports the loss parity of each
// candidate against the reference (train/parity.h holds the report math).
#pragma once

namespace flowmoe {

// Exit status: 0 every candidate passed, 1 one failed; usage and config errors throw ConfigError (2).
int cmd_parity(int argc, char** argv);

}  // namespace flowmoe
