// Loss-curve plots of one or several training runs.
#pragma once
#include <cmath>
#include <string>
#include <vector>

namespace flowmoe {

// Renders the loss (and validation loss) curves of the runs into a PNG, with gnuplot when it is
// installed, else Python's matplotlib. Each run is a run directory or a metrics file. Throws
// ConfigError before any work when check_output_file (config/output_check.h) refuses png_path, the
// runs' metrics files being its inputs.
void plot_runs(const std::vector<std::string>& runs, const std::string& png_path, const std::string& title);

struct PlotSeries {
  std::string label;
  std::vector<double> y;  // one value per x; NaN leaves a gap
};
// Two panels over one x axis, e.g. loss curves above and their deviations below; bottom_line (unless
// NaN) is drawn across the lower panel, e.g. a threshold.
struct TwoPanelPlot {
  std::string title, top_ylabel, bottom_ylabel, bottom_line_label;
  std::vector<double> x;
  std::vector<PlotSeries> top, bottom;
  double bottom_line = NAN;
  // Shaded from 0 up to these values behind the lower panel's curves (empty: none), e.g. a noise band.
  std::vector<double> bottom_band;
  std::string bottom_band_label;
};
// Draws it into a PNG with gnuplot or matplotlib. Returns false, drawing nothing, when neither is
// installed (callers for whom the image is a by-product go on without it); throws IoError when one fails,
// and ConfigError when check_output_file refuses png_path (callers check it with their inputs first).
bool plot_two_panels(const TwoPanelPlot& plot, const std::string& png_path);

}  // namespace flowmoe
