// Whole files and JSON strings, for checkpoints (train/checkpoint.cpp) and plots (train/plot.cpp).
#pragma once
#include <string>
#include <vector>

namespace flowmoe {

// s as a JSON string literal, with the quotes (also a valid gnuplot and Python string).
std::string json_escape(const std::string& s);

// Writes the chunks to path, back to back, and fsyncs the file, so a later rename publishes complete
// contents. Throws IoError naming the file.
void write_file_synced(const std::string& path, const std::vector<const std::string*>& chunks);
// fsyncs a directory (after a rename into it); quietly does nothing where the filesystem refuses.
void fsync_dir(const std::string& dir);
// The whole file; throws IoError naming it when it cannot be opened.
std::string read_file(const std::string& path);

}  // namespace flowmoe
