// `flowmoe parity`: trains one config once per precision recipe and reports the loss parity of each
// candidate against the reference (studies/parity.h holds the report math).
#pragma once

namespace flowmoe {

// What cmd_parity returns when a stop request (SIGINT, SIGTERM: the handlers flowmoe's main installs)
// ended a run after its checkpoint; main turns it into 128 + the signal number, as `flowmoe train` exits.
constexpr int kParityInterrupted = -1;

// Exit status: ParityReport::exit_status (0 every candidate passed what the study judges; 1 one failed
// the bar, or with controls fell outside the noise band; 4 all within the band but one failed the bar),
// or kParityInterrupted; usage and config errors throw ConfigError (2).
int cmd_parity(int argc, char** argv);

}  // namespace flowmoe
