// The names of the files flowmoe keeps in a run folder and a checkpoint folder: the folders that write
// them and the check of a command's output path (config/output_check.h), which must not overwrite
// them, read the same names.
#pragma once

namespace flowmoe {

// The files of a checkpoint directory.
constexpr const char* kCheckpointModelFile = "model.safetensors";
constexpr const char* kCheckpointMetaFile = "meta.json";

// The names of a run directory's metrics file, one per logging.metrics_format.
constexpr const char* kMetricsFiles[] = {"metrics.jsonl", "metrics.csv"};

}  // namespace flowmoe
