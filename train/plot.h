// Loss-curve plots of one or several training runs.
#pragma once
#include <string>
#include <vector>

namespace flowmoe {

// Renders the loss (and validation loss) curves of the runs into a PNG, with gnuplot when it is
// installed, else Python's matplotlib. Each run is a run directory or a metrics file.
void plot_runs(const std::vector<std::string>& runs, const std::string& png_path, const std::string& title);

}  // namespace flowmoe
