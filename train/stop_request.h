// Asking a training run to stop early with a checkpoint: a signal (main's handler calls request_stop) or the
// stop file, <logging.out_dir>/stop, which needs no signal and so works under every launcher (mpirun, which
// kills its ranks a second after it passes them a signal, srun, a batch system that sends none).
// The trainer checks both at each step (rank 0 the file; the ranks agree through the step's own agreement),
// after a step's evaluation and checkpoint, and, in one process, before each micro-batch (trainer.cpp,
// train_step.cpp); docs/TRAINING.md ("Stopping a run") says what a user sees.
#pragma once
#include <string>

namespace flowmoe {

// The stop file's name inside logging.out_dir.
constexpr const char* kStopFileName = "stop";

// Asks a running train() to stop with a checkpoint (async-signal-safe: one atomic store).
void request_stop();
// Forgets a request (train() does on return: the next run in the process starts afresh).
void clear_stop_request();

// <out_dir>/stop.
std::string stop_file_path(const std::string& out_dir);
// Whether this process was asked to stop: a signal, or, when `check_file` (rank 0), the stop file exists.
bool stop_requested(const std::string& out_dir, bool check_file);
// Removes the stop file once a run has honoured it, so that a resume does not stop at once. Returns whether
// there was one; IoError with the OS's reason when it cannot be removed.
bool remove_stop_file(const std::string& out_dir);

}  // namespace flowmoe
