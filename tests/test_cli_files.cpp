// The files the flowmoe commands write and read whole. Every file a command writes at a path the user
// named goes through one check (config/output_check.h), made before anything is read or written: a device
// or FIFO, one of the command's inputs under any spelling, and a file inside a run or checkpoint folder
// are refused with one line naming the option, the path and why, and left as they were. Whole-file
// reads take regular files only (a read of /dev/zero never ends), a config at most 1 MiB, and name the
// OS's reason when a file cannot be opened. Path keys of a config refuse a NUL byte.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "config/config.h"
#include "config/output_check.h"
#include "dataset/data.h"
#include "io/file_io.h"
#include "kernels/common/error.h"
#include "tests/support/train_fixtures.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// What f throws as E, or "" (with a failure) when it throws nothing.
template <class E>
std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error was thrown";
  return "";
}

fs::path make_fifo(const fs::path& p) {
  EXPECT_EQ(::mkfifo(p.c_str(), 0644), 0) << p;
  return p;
}

struct Ran {
  int code = -1;  // the exit status; 124 when the timeout ended it
  std::string err;
};

// Runs the built command in `dir` with `args` under a 60 s timeout (`prefix` runs first in the same
// shell, e.g. a ulimit); stdout is dropped, stderr kept.
Ran run_flowmoe(const fs::path& dir, const std::vector<std::string>& args, const std::string& prefix = "") {
  std::string cmd = "cd '" + dir.string() + "' && " + prefix + " timeout 60 " + FLOWMOE_BINARY_DIR + "/flowmoe";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " >/dev/null 2>err.txt";
  const int status = std::system(cmd.c_str());
  Ran r;
  r.code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = read_bytes(dir / "err.txt");
  return r;
}

// A config of a tiny MoE model (every precision recipe takes it) whose run goes to dir/run.
fs::path write_config(const fs::path& dir) {
  const fs::path file = dir / "tiny.yaml";
  std::ofstream(file) << "model: {vocab_size: 64, hidden_size: 128, num_hidden_layers: 1, num_attention_heads: 2,"
                         " intermediate_size: 128, max_position_embeddings: 16, n_routed_experts: 4,"
                         " num_experts_per_tok: 2, moe_intermediate_size: 128}\n"
                         "data: {seq_len: 16, synthetic_tokens: 4000, val_fraction: 0.1}\n"
                         "train: {device: cpu, steps: 2, batch_size: 2, eval_every: 0}\n"
                         "optimizer: {warmup_steps: 1}\n"
                         "logging: {progress: plain, out_dir: "
                      << (dir / "run").string() << "}\n";
  return file;
}

// A run folder as `train` leaves it: its lock file and metrics.
fs::path make_run_folder(const fs::path& dir) {
  fs::create_directories(dir);
  std::ofstream(dir / "run.lock") << "1\n";
  std::ofstream(dir / "metrics.jsonl") << "{\"step\": 1, \"loss\": 4.0}\n{\"step\": 2, \"loss\": 3.5}\n";
  return dir;
}

}  // namespace

TEST(OutputCheck, RefusesDevicesFifosDirectoriesAndMissingFolders) {
  const fs::path d = fresh_dir("outputs_kinds");
  const fs::path fifo = make_fifo(d / "fifo");
  EXPECT_EQ(output_file_problem("x: --out '/dev/null'", "/dev/null", {}),
            "x: --out '/dev/null' is a character device, not a regular file; name a regular file to write");
  EXPECT_EQ(output_file_problem("x: --out 'fifo'", fifo.string(), {}),
            "x: --out 'fifo' is a FIFO, not a regular file; name a regular file to write");
  EXPECT_EQ(output_file_problem("x: --out 'd'", d.string(), {}, "a.png"),
            "x: --out 'd' is a directory; name a file to write, e.g. '" + (d / "a.png").string() + "'");
  EXPECT_EQ(
      output_file_problem("x: --out 'n'", (d / "no" / "a.png").string(), {}),
      "x: --out 'n': its folder '" + (d / "no").string() + "' does not exist (create it first, or name another file)");
  std::ofstream(d / "file") << "a file";
  EXPECT_EQ(output_file_problem("x: --out 'f'", (d / "file" / "a.png").string(), {}),
            "x: --out 'f' cannot be written: Not a directory");
  EXPECT_EQ(output_file_problem("x: --out 'a'", (d / "a.png").string(), {}), "");
  EXPECT_EQ(output_file_problem("x: --out 'f'", (d / "file").string(), {}), "");  // replaced: not an input
  EXPECT_TRUE(fs::is_fifo(fifo));
  fs::remove_all(d);
}

// The same file under any spelling is the input itself: compared by device and inode.
TEST(OutputCheck, RefusesAnInputUnderAnySpelling) {
  const fs::path d = fresh_dir("outputs_inputs");
  fs::create_directories(d / "sub");
  const fs::path in = d / "in.txt";
  std::ofstream(in) << "read me";
  fs::create_hard_link(in, d / "hard.txt");
  fs::create_symlink(in, d / "link.txt");
  const std::vector<InputFile> inputs = {{"config file", "other.yaml"}, {"input", in.string()}};
  EXPECT_EQ(output_file_problem("x: --out 'o'", in.string(), inputs),
            "x: --out 'o' is the input '" + in.string() +
                "': writing it would overwrite what is read; name another file to write");
  for (const fs::path& p : {d / "sub" / ".." / "in.txt", d / "hard.txt", d / "link.txt"})
    EXPECT_TRUE(has(output_file_problem("x: --out 'o'", p.string(), inputs),
                    "x: --out 'o' is the input '" + in.string() + "' (the same file): writing it would overwrite"))
        << p;
  EXPECT_EQ(output_file_problem("x: --out 'o'", (d / "sub" / "in.txt").string(), inputs), "");
  fs::remove_all(d);
}

// A checkpoint folder (model.safetensors) takes no file from another command, even a new one; a run
// folder (run.lock, metrics.jsonl or metrics.csv) takes a new file (a plot) but not one of the run's own
// (its lock, metrics or config.yaml), even one not written yet.
TEST(OutputCheck, RefusesCheckpointFilesAndARunFoldersOwnFiles) {
  const fs::path d = fresh_dir("outputs_folders");
  fs::create_directories(d / "ck");
  std::ofstream(d / "ck" / "model.safetensors") << "x";
  EXPECT_EQ(output_file_problem("x: --out 'o'", (d / "ck" / "new.json").string(), {}),
            "x: --out 'o' is in the checkpoint folder '" + (d / "ck").string() +
                "' (it holds model.safetensors), whose files are the checkpoint's; write it elsewhere");
  for (const std::string marker : {"run.lock", "metrics.jsonl", "metrics.csv"}) {
    const fs::path folder = d / marker;
    fs::create_directories(folder);
    std::ofstream(folder / marker) << "x";
    EXPECT_EQ(output_file_problem("x: --out 'o'", (folder / "loss.png").string(), {}), "") << marker;
    for (const std::string own : {"run.lock", "metrics.jsonl", "metrics.csv", "config.yaml"})
      EXPECT_EQ(output_file_problem("x: --out 'o'", (folder / own).string(), {}),
                "x: --out 'o' is the run folder '" + folder.string() + "''s own " + own + "; write it elsewhere")
          << marker << " " << own;
  }
  fs::create_directories(d / "plain");
  std::ofstream(d / "plain" / "config.yaml") << "x";
  EXPECT_EQ(output_file_problem("x: --out 'o'", (d / "plain" / "config.yaml").string(), {}), "");
  fs::remove_all(d);
}

// plot --output: the metrics it reads, a file of a run folder, a device or a FIFO are refused with
// exit status 2 and one line, and left as they were.
TEST(CliFiles, PlotRefusesItsInputsRunFoldersDevicesAndFifos) {
  const fs::path d = fresh_dir("outputs_plot");
  const fs::path run = make_run_folder(d / "r");
  const std::string metrics = read_bytes(run / "metrics.jsonl");
  fs::create_hard_link(run / "metrics.jsonl", d / "linked.jsonl");
  const fs::path fifo = make_fifo(d / "fifo.png");
  const auto refused = [&](const std::string& output, const std::string& why) {
    const Ran r = run_flowmoe(d, {"plot", "r", "--output", output});
    EXPECT_EQ(r.code, 2) << output << ": " << r.err;
    EXPECT_EQ(r.err, "flowmoe: error: plot: --output '" + output + "' " + why + "\n");
  };
  const std::string overwrite = ": writing it would overwrite what is read; name another file to write";
  refused("r/metrics.jsonl", "is the metrics file 'r/metrics.jsonl'" + overwrite);
  refused("./r/../r/metrics.jsonl", "is the metrics file 'r/metrics.jsonl' (the same file)" + overwrite);
  refused("linked.jsonl", "is the metrics file 'r/metrics.jsonl' (the same file)" + overwrite);
  refused("r/run.lock", "is the run folder 'r''s own run.lock; write it elsewhere");
  refused("/dev/null", "is a character device, not a regular file; name a regular file to write");
  refused("fifo.png", "is a FIFO, not a regular file; name a regular file to write");
  EXPECT_TRUE(read_bytes(run / "metrics.jsonl") == metrics) << "overwritten";
  EXPECT_EQ(run_flowmoe(d, {"plot", "r", "--output", "r/loss.png"}).code, 0) << "a plot beside the metrics";
  EXPECT_TRUE(fs::is_fifo(fifo));
  fs::remove_all(d);
}

// fp8-error --json: refused before the study (here, before the checkpoint is even read) when it is the
// checkpoint's weights, the config, a file in the checkpoint folder, a device or a FIFO.
TEST(CliFiles, Fp8ErrorJsonRefusesTheCheckpointTheConfigAndDevices) {
  const fs::path d = fresh_dir("outputs_fp8_error");
  const std::string config = write_config(d).string();
  fs::create_directories(d / "ck");
  std::ofstream(d / "ck" / "model.safetensors") << "weights";
  std::ofstream(d / "ck" / "meta.json") << "{}";
  fs::create_hard_link(config, d / "config_link.yaml");
  const fs::path fifo = make_fifo(d / "fifo.json");
  const auto refused = [&](const std::string& json, const std::string& why) {
    const Ran r = run_flowmoe(d, {"fp8-error", "--config", config, "--checkpoint", "ck", "--json", json});
    EXPECT_EQ(r.code, 2) << json << ": " << r.err;
    EXPECT_EQ(r.err, "flowmoe: error: fp8-error: --json '" + json + "' " + why + "\n");
  };
  const std::string overwrite = ": writing it would overwrite what is read; name another file to write";
  refused("ck/model.safetensors", "is the checkpoint file 'ck/model.safetensors'" + overwrite);
  refused(config, "is the config file '" + config + "'" + overwrite);
  refused("config_link.yaml", "is the config file '" + config + "' (the same file)" + overwrite);
  refused("ck/errors.json",
          "is in the checkpoint folder 'ck' (it holds model.safetensors), whose files are the checkpoint's; "
          "write it elsewhere");
  refused("/dev/null", "is a character device, not a regular file; name a regular file to write");
  refused("fifo.json", "is a FIFO, not a regular file; name a regular file to write");
  EXPECT_TRUE(read_bytes(d / "ck" / "model.safetensors") == "weights") << "overwritten";
  EXPECT_TRUE(has(read_bytes(config), "model: {vocab_size: 64")) << "overwritten";
  EXPECT_TRUE(fs::is_fifo(fifo));
  fs::remove_all(d);
}

// parity --out is a folder: a file there, or a path through one, is one line naming --out; a run
// folder is refused for the report before any run trains.
TEST(CliFiles, ParityOutIsAFolderAndItsReportIsChecked) {
  const fs::path d = fresh_dir("outputs_parity");
  const std::string config = write_config(d).string();
  std::ofstream(d / "file.txt") << "a file";
  Ran r = run_flowmoe(d, {"parity", "--config", config, "--out", "file.txt"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err,
            "flowmoe: error: parity: --out 'file.txt' is a regular file, not a folder; name a folder for the runs "
            "and the report\n");
  r = run_flowmoe(d, {"parity", "--config", config, "--out", "file.txt/sub"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_EQ(r.err, "flowmoe: error: parity: --out: cannot create the folder 'file.txt/sub': Not a directory\n");
  fs::create_directories(d / "ck");
  std::ofstream(d / "ck" / "model.safetensors") << "x";
  r = run_flowmoe(d, {"parity", "--config", config, "--out", "ck"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err,
            "flowmoe: error: parity: the report 'ck/parity.json' (in --out) is in the checkpoint folder 'ck' (it "
            "holds model.safetensors), whose files are the checkpoint's; write it elsewhere\n");
  EXPECT_FALSE(fs::exists(d / "ck" / "bf16")) << "a run trained before the refusal";
  EXPECT_TRUE(read_bytes(d / "file.txt") == "a file");
  fs::remove_all(d);
}

// A config is a regular file of at most 1 MiB: /dev/zero (whose read never ends), a FIFO (whose read
// waits for a writer) and a larger file are refused at once, naming the file and the limit.
TEST(CliFiles, ConfigFilesAreRegularFilesOfAtMostOneMiB) {
  const fs::path d = fresh_dir("outputs_config");
  const fs::path fifo = make_fifo(d / "fifo.yaml");
  // The address-space limit ends a read that never stops in seconds instead of filling the machine.
  Ran r = run_flowmoe(d, {"train", "--config", "/dev/zero", "--print-config"}, "ulimit -v 4000000;");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err, "flowmoe: error: config file '/dev/zero' is a character device, not a regular file\n");
  r = run_flowmoe(d, {"train", "--config", "fifo.yaml", "--print-config"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(r.err, "flowmoe: error: config file 'fifo.yaml' is a FIFO, not a regular file\n");
  EXPECT_TRUE(fs::is_fifo(fifo));

  // A comment makes up the size: one byte more than the limit is refused, the limit itself is read.
  const std::string text = read_bytes(write_config(d)), big = (d / "big.yaml").string();
  std::ofstream(big) << text << "#" << std::string(kMaxConfigFileBytes - text.size(), '#');
  const std::string m = message_of<ConfigError>([&] { load_config(big); });
  EXPECT_EQ(m,
            "config file '" + big + "' is over the limit of 1048576 bytes (1 MiB) for a config file (1048577 bytes)");
  std::ofstream(big) << text << std::string(kMaxConfigFileBytes - text.size(), '#');
  EXPECT_EQ(load_config(big).model.vocab_size, 64);
  fs::remove_all(d);
}

// Every whole-file read refuses what is not a regular file; a file that cannot be opened is named
// with the OS's reason, the same way for every reader.
TEST(CliFiles, WholeFileReadsTakeRegularFilesAndNameTheOsReason) {
  const fs::path d = fresh_dir("outputs_reads");
  const std::string missing = (d / "missing").string();
  EXPECT_EQ(message_of<IoError>([&] { read_file(missing); }),
            "cannot open file '" + missing + "': No such file or directory");
  EXPECT_EQ(message_of<ConfigError>([&] { load_config(missing); }),
            "cannot open config file '" + missing + "': No such file or directory");
  EXPECT_EQ(message_of<IoError>([&] { FileReader reader(missing); }),
            "cannot open '" + missing + "': No such file or directory");
  EXPECT_EQ(message_of<IoError>([&] { read_file("/dev/null", 10, "tokenizer"); }),
            "tokenizer '/dev/null' is a character device, not a regular file");
  // A named prepare-data input and a text data file are read whole: the same refusal.
  EXPECT_EQ(message_of<IoError>([&] { prepare_token_file({"/dev/null"}, (d / "out.bin").string()); }),
            "input '/dev/null' is a character device, not a regular file");
  EXPECT_EQ(message_of<IoError>([&] { read_text_tokens("/dev/null"); }),
            "text file '/dev/null' is a character device, not a regular file");
  EXPECT_FALSE(fs::exists(d / "out.bin"));
  fs::remove_all(d);
}

// The config keys that name paths refuse a NUL byte, which the OS would take as the path's end
// ("runs/a\0b" writing into runs/a), naming the key; from the YAML file and from --set alike.
TEST(CliFiles, PathKeysRefuseANulByte) {
  for (const char* key : {"data.path", "checkpoint.dir", "checkpoint.resume", "logging.out_dir"}) {
    const std::string k = key, section = k.substr(0, k.find('.')), name = k.substr(k.find('.') + 1);
    std::string m =
        message_of<ConfigError>([&] { parse_config(section + ":\n  " + name + ": \"runs/a\\0b\"\n", "nul.yaml"); });
    EXPECT_EQ(m, "nul.yaml:2: " + k + ": a path cannot hold a NUL byte (one at byte 6)");
    m = message_of<ConfigError>([&] { parse_config("", "x.yaml", {k + "=runs/a" + std::string(1, '\0') + "b"}); });
    EXPECT_TRUE(has(m, k + ": a path cannot hold a NUL byte (one at byte 6)")) << m;
  }
  EXPECT_EQ(parse_config("logging:\n  out_dir: runs/ab\n", "ok.yaml").logging.out_dir, "runs/ab");
}
