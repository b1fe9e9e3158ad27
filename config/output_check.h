// The one check of a file a command is about to write at a path the user named (prepare-data's
// --output, plot's --output, fp8-error's --json, parity's report): made before any input is read or
// anything is written, so a refused command has destroyed nothing and wasted no work.
#pragma once
#include <string>
#include <vector>

#include "config/config.h"

namespace flowmoe {

// A file the command reads: how a message names it ("input", "--config file") and its path.
struct InputFile {
  std::string what;
  std::string path;
};

// The files a run of `cfg` reads: its config file and its data (data.path, or the files of a text
// directory), the inputs of a command that trains or reads a checkpoint and writes a file beside.
std::vector<InputFile> config_inputs(const Config& cfg);

// Why the file at `path` must not be written, as one line that begins with `named` (how the command
// names it: "plot: --output 'loss.png'"), or "" when it may be:
//  - it exists and is not a regular file: a device (/dev/null, /dev/full), a FIFO or a socket would take
//    the bytes elsewhere or a rename would replace the node itself; a directory would fail the write
//    (example_name, when given, is suggested inside it: "name a file to write, e.g. 'out/loss.png'");
//  - it is the same file as one of `inputs`, compared by device and inode, so "./x", a symlink and a
//    hard link count as the input itself;
//  - it lies in a checkpoint folder (one holding kCheckpointModelFile), whose files are all the
//    checkpoint's and which keep_last deletes whole, or it is one of a run folder's own files (its
//    lock, metrics or config; a plot beside them is fine);
//  - its folder does not exist, or the OS refuses to look (the reason is given).
std::string output_file_problem(const std::string& named, const std::string& path, const std::vector<InputFile>& inputs,
                                const std::string& example_name = "");

// Throws ConfigError (the user's to fix: exit status 2) with output_file_problem's line, if any.
void check_output_file(const std::string& named, const std::string& path, const std::vector<InputFile>& inputs,
                       const std::string& example_name = "");

// Why a command must not fill the folder at `path` (export's OUT_DIR, import's checkpoint folder), as one line
// that begins with `named`, or "" when it may: a folder that exists must be an empty directory (the command
// renames its output into place, over nothing); a new one's parent must exist and not be a checkpoint folder,
// whose files are all the checkpoint's (keep_last deletes it whole); the OS's reason where it refuses to look.
std::string output_folder_problem(const std::string& named, const std::string& path);
void check_output_folder(const std::string& named, const std::string& path);  // ConfigError with that line

}  // namespace flowmoe
