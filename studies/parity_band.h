// The noise band of a parity study (`flowmoe parity --controls N`): N controls train the reference's
// recipe perturbed in a way that leaves the recipe alone (another data order, another initialization,
// AdamW's eps), so their EMA errors against the reference are what two runs of one recipe differ by.
// A candidate is "within noise" when its mean EMA error after warmup is at most (1 + margin) times
// the largest of the controls' mean errors. If the candidate were one more control, it would exceed
// all N of them with probability 1 / (N + 1): the margin keeps such a run inside, N says how sharp
// the test is. Final-loss parity is reported beside it: each run's final validation loss relative to
// the reference's, with the controls' spread of the same figure. Tests: tests/test_parity_band.cpp.
#pragma once
#include "studies/parity_report.h"

namespace flowmoe {

// (final - reference) / reference: signed, NaN unless both are finite and the reference is not 0.
double signed_relative(double value, double reference);

// Fills report.band from its controls (runs whose `control` is set) and, for each candidate that is
// not a control, within_noise, noise_ratio and noise_reason. With fewer than two controls the band
// stays undefined (one control is a noise floor to read, not a spread to judge by) and every
// candidate's noise verdict is left unset. Called by make_parity_report.
void apply_noise_band(ParityReport& report, double margin);

}  // namespace flowmoe
