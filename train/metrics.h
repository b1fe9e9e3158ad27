// Training metrics: a JSONL or CSV file with one row per step, its writer and its reader.
// The progress display is in progress.h, the loss-curve plots in plot.h.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "config/config_types.h"
#include "io/run_files.h"  // kMetricsFiles

namespace flowmoe {

struct StepMetrics {
  int64_t step = 0;
  double loss = NAN;      // mean language-model (cross-entropy) loss over the step's micro-batches
  double aux_loss = NAN;  // mean MoE balance loss (sum over layers of aux_loss_alpha * L_Bal); NaN: off
  double val_loss = NAN;  // NaN: no validation at this step
  double lr = 0;
  double grad_norm = NAN;  // before clipping
  double tokens_per_s = 0;
  int64_t peak_mem_bytes = 0;             // peak tensor memory on the training device so far
  int64_t host_syncs = 0;                 // host synchronisations of the model and gradient reduction in the step
  double moe_casts = NAN;                 // explicit activation quantize + dequantize calls per MoE layer and
                                          // micro-batch this step (engine/cast_stats.h; weight quantization not
                                          // included); NaN: dense
  bool skipped = false;                   // non-finite loss or gradient: no update
  std::vector<double> moe_max_over_mean;  // per MoE layer: max load / mean load this step (1 = balanced)
  double exchange_ms = NAN;               // expert parallelism: the step's time in token exchanges (dispatch and
                                          // combine, forward and backward; Communicator::take_exchange_ms), the
                                          // slowest rank's; NaN: no expert-parallel group
  double tflops = NAN;  // model TFLOP/s per GPU: model FLOPs per token (train/model_flops.h) x tokens_per_s / ranks;
                        // NaN: a row written before the column existed
  double mfu = NAN;     // tflops over the GPU's bf16 dense peak (a fraction); NaN: no peak known (the CPU)
  // mean multi-token prediction loss (1/D) Σ_k CE_k, unweighted (training minimizes loss + aux_loss +
  // train.mtp_loss_weight * mtp_loss); NaN: no MTP modules
  double mtp_loss = NAN;
};

// Appends rows to <path>. With keep_up_to_step >= 0 (a resumed run) the rows of later steps an
// interrupted run had written are dropped first, and so is a last line it left torn (no line end, or
// not a row), which note() then names; with -1 the file starts empty. Every write is flushed and
// checked: one the OS refuses (a full disk) throws IoError naming the file and the reason, so a run
// never goes on with rows missing.
class MetricsWriter {
 public:
  MetricsWriter(const std::string& path, MetricsFormat format, int64_t keep_up_to_step);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;
  void write(const StepMetrics& m);
  const std::string& path() const { return path_; }
  // One line for the user about what the resume dropped beyond later steps' rows; "" when nothing.
  const std::string& note() const { return note_; }

 private:
  std::string path_;
  bool csv_;
  std::FILE* file_ = nullptr;
  std::string note_;
  void put(const std::string& line);  // the line and its end, into the stream's buffer
  void flush();
};

// Rows of a metrics file (format from its extension, .csv or else JSONL). Throws IoError.
std::vector<StepMetrics> read_metrics(const std::string& path);
// The metrics file inside a run directory (metrics.jsonl or metrics.csv), or path itself if a file.
std::string find_metrics_file(const std::string& run_or_file);

}  // namespace flowmoe
