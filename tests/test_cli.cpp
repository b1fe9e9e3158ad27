// The flowmoe command as a user runs it: exit statuses, one-line errors (with the source location
// only under --debug), SIGTERM and SIGINT during training (a long accumulation, a second signal during the
// checkpoint's write), --resume of a folder of checkpoints,
// eval's batch count and plot failures. Each test runs the built binary in a directory of its own.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/error.h"
#include "tests/support/train_fixtures.h"

extern char** environ;

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

const std::string kBinary = std::string(FLOWMOE_BINARY_DIR) + "/flowmoe";

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A 0.02M-parameter model that trains a step in a few milliseconds on the CPU: 124 validation
// sequences of 16 tokens (31 batches of 4).
fs::path write_config(const fs::path& dir, const std::string& extra_train = "") {
  const fs::path file = dir / "tiny.yaml";
  std::ofstream(file) << "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,"
                         " intermediate_size: 64, max_position_embeddings: 16}\n"
                         "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.1}\n"
                         "train: {device: cpu, steps: 4, batch_size: 4, eval_every: 0, eval_batches: 2"
                      << extra_train
                      << "}\n"
                         "optimizer: {lr: 0.01, min_lr: 0.001, warmup_steps: 1}\n"
                         "checkpoint: {every: 2, keep_last: 2}\n"
                         "logging: {progress: plain, log_every: 1, out_dir: "
                      << (dir / "run").string() << "}\n";
  return file;
}

// A started flowmoe process; its stdout and stderr go to files.
struct Child {
  pid_t pid = -1;
  fs::path out, err;
};

// Starts the binary with `args`; `env` entries ("NAME=value") are added to (or replace) ours.
Child spawn(const fs::path& dir, const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  static int counter = 0;
  Child c;
  c.out = dir / ("stdout_" + std::to_string(counter) + ".txt");
  c.err = dir / ("stderr_" + std::to_string(counter++) + ".txt");
  std::vector<std::string> argv_s = {kBinary};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<std::string> env_s;
  for (char** e = environ; *e; ++e) {
    std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('=') + 1);
    bool replaced = false;
    for (const std::string& o : env) replaced = replaced || name == o.substr(0, o.find('=') + 1);
    if (!replaced) env_s.push_back(entry);
  }
  env_s.insert(env_s.end(), env.begin(), env.end());
  std::vector<char*> argv_p, env_p;
  for (std::string& s : argv_s) argv_p.push_back(s.data());
  for (std::string& s : env_s) env_p.push_back(s.data());
  argv_p.push_back(nullptr);
  env_p.push_back(nullptr);

  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, c.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, STDERR_FILENO, c.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  int rc = posix_spawn(&c.pid, kBinary.c_str(), &fa, nullptr, argv_p.data(), env_p.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    ADD_FAILURE() << "cannot start " << kBinary << ": " << std::strerror(rc);
    c.pid = -1;
  }
  return c;
}

// waitpid with a deadline; a process that runs past it is killed and reported (-1).
int wait_exit(pid_t pid, double timeout_s, int options = 0) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  int status = 0;
  while (true) {
    pid_t r = ::waitpid(pid, &status, options | WNOHANG);
    if (r == pid) return status;
    if (r < 0) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      ADD_FAILURE() << "flowmoe did not finish within " << timeout_s << " s";
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// Waits until `file` contains `text`, or the deadline.
bool wait_for_text(const fs::path& file, const std::string& text, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (has(read_text(file), text)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

struct Result {
  int exit_code = -1;  // -1: did not exit normally
  std::string out, err;
};

Result run(const fs::path& dir, const std::vector<std::string>& args, const std::vector<std::string>& env = {}) {
  Child c = spawn(dir, args, env);
  Result r;
  if (c.pid < 0) return r;
  int status = wait_exit(c.pid, 60);
  if (status != -1 && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  r.out = read_text(c.out);
  r.err = read_text(c.err);
  return r;
}

// The number of lines of `s` (a final newline ends the last line).
size_t lines(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  return n + (!s.empty() && s.back() != '\n');
}

std::string step_dir(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

}  // namespace

TEST(Cli, ErrorKeepsTheSourceLocationApartFromTheMessage) {
  const int line = __LINE__ + 2;
  try {
    FLOWMOE_THROW(IoError, "first line\n  second line\n");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "first line; second line");
    ASSERT_NE(e.file(), nullptr);
    EXPECT_TRUE(std::string(e.file()).ends_with("test_cli.cpp")) << e.file();
    EXPECT_EQ(e.line(), line);
    EXPECT_EQ(e.location(), std::string(e.file()) + ":" + std::to_string(line));
  }
  ConfigError plain("a.yaml:3: model.x:\n  bad");
  EXPECT_STREQ(plain.what(), "a.yaml:3: model.x: bad");
  EXPECT_EQ(plain.file(), nullptr);
  EXPECT_EQ(plain.location(), "");
}

TEST(Cli, ErrorsAreOneLineWithTheSourceLocationOnlyUnderDebug) {
  const fs::path d = fresh_dir("cli_errors");
  const std::string cfg = write_config(d).string(), missing = (d / "no_checkpoint").string();
  const std::vector<std::string> eval = {"eval", "--config", cfg, "--checkpoint", missing};
  const std::string expected = "flowmoe: error: '" + missing + "' is not a checkpoint (no meta.json)\n";

  Result plain = run(d, eval);
  EXPECT_EQ(plain.exit_code, 1);
  EXPECT_EQ(plain.err, expected);
  Result off = run(d, eval, {"FLOWMOE_DEBUG=0"});
  EXPECT_EQ(off.err, expected);

  std::vector<std::string> debug_first = {"--debug"}, debug_last = eval;
  debug_first.insert(debug_first.end(), eval.begin(), eval.end());
  debug_last.push_back("--debug");
  for (const Result& r : {run(d, debug_first), run(d, debug_last), run(d, eval, {"FLOWMOE_DEBUG=1"})}) {
    EXPECT_EQ(r.exit_code, 1);
    EXPECT_EQ(lines(r.err), 1u) << r.err;
    EXPECT_EQ(r.err.rfind(expected.substr(0, expected.size() - 1) + " (at ", 0), 0u) << r.err;
    EXPECT_TRUE(std::regex_search(r.err, std::regex(R"(checkpoint\.cpp:[0-9]+\)\n$)"))) << r.err;
  }

  // Usage errors: status 2, one line, no location.
  Result usage = run(d, {"eval", "--config", cfg, "--batches", "0", "--checkpoint", missing});
  EXPECT_EQ(usage.exit_code, 2);
  EXPECT_EQ(usage.err, "flowmoe: error: eval: --batches needs a positive integer, got '0'\n");
  fs::remove_all(d);
}

TEST(Cli, EvalReadsAtMostTheWholeBatchesOfTheValidationSplit) {
  const fs::path d = fresh_dir("cli_eval");
  const std::string cfg = write_config(d).string();
  Result trained = run(d, {"train", "--config", cfg});
  ASSERT_EQ(trained.exit_code, 0) << trained.out << trained.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(trained.out, m, std::regex(R"(([0-9]+) val sequences)"))) << trained.out;
  const long long val = std::stoll(m[1]);
  ASSERT_GE(val, 8) << "the config should hold out a few batches";
  const std::string ckpt = (d / "run" / "checkpoints" / step_dir(4)).string();

  Result many = run(d, {"eval", "--config", cfg, "--checkpoint", ckpt, "--batches", "1000"});
  EXPECT_EQ(many.exit_code, 0) << many.err;
  const std::string cap = "eval: --batches 1000 is more than the validation split holds (" + std::to_string(val / 4) +
                          " batches of 4); using " + std::to_string(val / 4) + "\n";
  EXPECT_TRUE(has(many.out, cap)) << many.out;
  EXPECT_TRUE(has(many.out, "| " + std::to_string(val / 4 * 4) + " sequences of 16 tokens")) << many.out;

  Result few = run(d, {"eval", "--config", cfg, "--checkpoint", ckpt, "--batches", "3"});
  EXPECT_EQ(few.exit_code, 0) << few.err;
  EXPECT_FALSE(has(few.out, "more than the validation split")) << few.out;
  EXPECT_TRUE(has(few.out, "| 12 sequences of 16 tokens")) << few.out;

  // A batch larger than the split: one batch of every validation sequence, each read once.
  Result big = run(d, {"eval", "--config", cfg, "--checkpoint", ckpt, "--set", "train.batch_size=1000"});
  EXPECT_EQ(big.exit_code, 0) << big.err;
  EXPECT_TRUE(has(big.out, "eval: train.eval_batches = 2 is more than the validation split holds (1 batches of " +
                               std::to_string(val) + "); using 1"))
      << big.out;
  EXPECT_TRUE(has(big.out, "| " + std::to_string(val) + " sequences of 16 tokens")) << big.out;
  fs::remove_all(d);
}

// SIGTERM (timeout, Slurm, Kubernetes) is handled like Ctrl-C: the step is finished, a checkpoint
// written, and the status is 128 + 15; --resume continues from that checkpoint.
TEST(Cli, SigtermSavesACheckpointAndResumeContinues) {
  const fs::path d = fresh_dir("cli_sigterm");
  const std::string cfg = write_config(d).string();
  Child c = spawn(d, {"train", "--config", cfg, "--set", "train.steps=1000000", "--set", "checkpoint.every=0"});
  ASSERT_GT(c.pid, 0);
  ASSERT_TRUE(wait_for_text(c.out, "/1000000 | loss", 20)) << read_text(c.out) << read_text(c.err);
  ::kill(c.pid, SIGTERM);
  const int status = wait_exit(c.pid, 20);
  const std::string out = read_text(c.out), err = read_text(c.err);
  ASSERT_TRUE(status != -1 && WIFEXITED(status)) << "status " << status << "\n" << out << err;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << err;
  EXPECT_TRUE(has(err, "flowmoe: stopped by SIGTERM; exit status 143")) << err;

  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(interrupted at step ([0-9]+): checkpoint (\S+) )"))) << out;
  const int64_t step = std::stoll(m[1]);
  const fs::path ckpt = d / "run" / "checkpoints" / step_dir(step);
  EXPECT_EQ(m[2].str(), ckpt.string());
  for (const char* f : {"meta.json", "model.safetensors", "optimizer.safetensors"})
    EXPECT_TRUE(fs::exists(ckpt / f)) << ckpt / f;
  EXPECT_FALSE(fs::exists(ckpt.string() + ".tmp"));

  Result resumed = run(d, {"train", "--config", cfg, "--resume", "--set", "train.steps=" + std::to_string(step + 2)});
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_TRUE(has(resumed.out, "resumed from " + ckpt.string() + " at step " + std::to_string(step))) << resumed.out;
  // The step is padded to the width of the last ("step  9/10"): match what follows the padding.
  EXPECT_TRUE(has(resumed.out, " " + std::to_string(step + 1) + "/" + std::to_string(step + 2) + " | loss"))
      << resumed.out;
  EXPECT_TRUE(has(resumed.out, "done: step " + std::to_string(step + 2) + "/")) << resumed.out;
  fs::remove_all(d);
}

// A signal while a step accumulates many micro-batches stops the run at the next one: the step is dropped
// (nothing was finished, so nothing is saved) and the process ends in a small part of the step's time. It
// used to finish the step first, and grad_accum_steps accepts 2^20 micro-batches: hours of waiting.
TEST(Cli, ASignalDuringALongAccumulationStopsAtTheNextMicroBatch) {
  const fs::path d = fresh_dir("cli_accum_signal");
  const std::string cfg = write_config(d, ", grad_accum_steps: 10000").string();
  Child c = spawn(d, {"train", "--config", cfg, "--set", "checkpoint.every=0"});
  ASSERT_GT(c.pid, 0);
  ASSERT_TRUE(wait_for_text(c.out, "data: ", 20)) << read_text(c.out) << read_text(c.err);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // into the first step's micro-batches
  const auto signalled = std::chrono::steady_clock::now();
  ::kill(c.pid, SIGTERM);
  const int status = wait_exit(c.pid, 120);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count();
  const std::string out = read_text(c.out), err = read_text(c.err);
  ASSERT_TRUE(status != -1 && WIFEXITED(status)) << "status " << status << "\n" << out << err;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << err;
  EXPECT_TRUE(has(out, "stopped before the first step: nothing trained, no checkpoint")) << out;
  EXPECT_FALSE(has(out, "/4 | loss")) << out;
  EXPECT_FALSE(fs::exists(d / "run" / "checkpoints" / step_dir(1)));
  // One step of 10000 micro-batches takes 5-20 s here, a micro-batch a few milliseconds.
  EXPECT_LT(seconds, 5.0) << out;
  fs::remove_all(d);
}

// A second signal ends the process at once, even while it writes the checkpoint the first one asked for:
// the write stops where it is, as a step_N.tmp directory that no resume takes and the next run removes.
// A model of 13M parameters makes the write (160 MB, fsynced) last long enough to be caught in it.
TEST(Cli, ASecondSignalStopsAtOnceAndLeavesNoPartialCheckpoint) {
  const fs::path d = fresh_dir("cli_second_signal");
  const std::string cfg = write_config(d).string();
  std::vector<std::string> big;
  for (const char* set :
       {"model.vocab_size=8192", "model.hidden_size=512", "model.intermediate_size=1024", "checkpoint.every=0"})
    big.insert(big.end(), {"--set", set});
  std::vector<std::string> args = {"train", "--config", cfg, "--set", "train.steps=1000000"};
  args.insert(args.end(), big.begin(), big.end());
  Child c = spawn(d, args);
  ASSERT_GT(c.pid, 0);
  ASSERT_TRUE(wait_for_text(c.out, "/1000000 | loss", 60)) << read_text(c.out) << read_text(c.err);
  ::kill(c.pid, SIGINT);
  const fs::path ckpts = d / "run" / "checkpoints";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  bool writing = false;  // the stop's checkpoint directory exists, not yet renamed into place
  while (!writing && std::chrono::steady_clock::now() < deadline && ::waitpid(c.pid, nullptr, WNOHANG) == 0) {
    std::error_code ec;
    for (fs::directory_iterator it(ckpts, ec), end; !ec && it != end; it.increment(ec))
      writing = writing || it->path().extension() == ".tmp";
    if (!writing) std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ASSERT_TRUE(writing) << "the checkpoint's write was not seen\n" << read_text(c.out);
  ::kill(c.pid, SIGTERM);  // the handler has reset the default action: this one ends the process
  const int status = wait_exit(c.pid, 20);
  ASSERT_TRUE(WIFSIGNALED(status)) << "status " << status << "\n" << read_text(c.out) << read_text(c.err);
  EXPECT_EQ(WTERMSIG(status), SIGTERM);
  EXPECT_FALSE(has(read_text(c.out), "interrupted at step")) << read_text(c.out);
  // Every checkpoint directory is complete or a .tmp; the resume takes no .tmp, and removes it.
  int64_t newest = 0;
  size_t unfinished = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(ckpts)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory()) continue;  // the folder's run.lock
    if (name.ends_with(".tmp")) {
      ++unfinished;
      continue;
    }
    for (const char* f : {"meta.json", "model.safetensors", "optimizer.safetensors"})
      EXPECT_TRUE(fs::exists(e.path() / f)) << e.path() / f;
    newest = std::max<int64_t>(newest, std::stoll(name.substr(5)));
  }
  args = {"train", "--config", cfg, "--resume", "--set", "train.steps=" + std::to_string(newest + 1)};
  args.insert(args.end(), big.begin(), big.end());
  Result resumed = run(d, args);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
  EXPECT_EQ(has(resumed.out, "removed 1 unfinished checkpoint directory"), unfinished == 1) << resumed.out;
  EXPECT_TRUE(has(resumed.out, newest > 0 ? "resumed from " + (ckpts / step_dir(newest)).string()
                                          : "no checkpoint in " + ckpts.string() + " yet"))
      << resumed.out;
  fs::remove_all(d);
}

TEST(Cli, ResumeTakesTheNewestCheckpointOfAFolderAndNamesWhatTheUserTyped) {
  const fs::path d = fresh_dir("cli_resume_folder");
  const std::string cfg = write_config(d).string();
  ASSERT_EQ(run(d, {"train", "--config", cfg}).exit_code, 0);
  const fs::path folder = d / "run" / "checkpoints";
  fs::create_directories(folder / "step_00000009");  // no meta.json: not a complete checkpoint

  Result r = run(d, {"train", "--config", cfg, "--resume", folder.string(), "--set", "train.steps=6"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(has(r.out, "resumed from " + (folder / step_dir(4)).string() + " at step 4")) << r.out;
  EXPECT_TRUE(has(r.out, "done: step 6/6")) << r.out;

  const fs::path empty = d / "empty";
  fs::create_directories(empty / "step_00000003");
  Result none = run(d, {"train", "--config", cfg, "--resume", empty.string()});
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_EQ(none.err, "flowmoe: error: --resume " + empty.string() + ": '" + empty.string() +
                          "' holds no complete checkpoint (no step_N/meta.json)\n");
  Result missing = run(d, {"train", "--config", cfg, "--resume=" + (d / "nowhere").string()});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_EQ(missing.err, "flowmoe: error: --resume " + (d / "nowhere").string() + ": '" + (d / "nowhere").string() +
                             "' does not exist\n");
  // Given with --set, the message names the --set.
  Result set = run(d, {"train", "--config", cfg, "--set", "checkpoint.resume=" + empty.string()});
  EXPECT_EQ(set.exit_code, 2);
  EXPECT_TRUE(has(set.err, "flowmoe: error: --set checkpoint.resume=" + empty.string() + ": checkpoint.resume: '"))
      << set.err;
  fs::remove_all(d);
}

TEST(Cli, TrainingRemovesUnfinishedCheckpointDirectoriesAndSaysSo) {
  const fs::path d = fresh_dir("cli_stale_tmp");
  const std::string cfg = write_config(d).string();
  const fs::path ckpts = d / "run" / "checkpoints";
  fs::create_directories(ckpts / "step_00000020.tmp");
  std::ofstream(ckpts / "step_00000020.tmp" / "model.safetensors") << "half";
  fs::create_directories(ckpts / "step_00000003.tmp");
  Result r = run(d, {"train", "--config", cfg});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(has(r.out,
                  "removed 2 unfinished checkpoint directories from a previous run: step_00000003.tmp, "
                  "step_00000020.tmp\n"))
      << r.out;
  EXPECT_FALSE(fs::exists(ckpts / "step_00000020.tmp"));
  EXPECT_FALSE(fs::exists(ckpts / "step_00000003.tmp"));
  Result again = run(d, {"train", "--config", cfg, "--resume"});
  EXPECT_FALSE(has(again.out, "unfinished")) << again.out;
  fs::remove_all(d);
}

TEST(Cli, PlotFailuresAreOneLineWithTheRealExitStatus) {
  const fs::path d = fresh_dir("cli_plot");
  fs::create_directories(d / "run");
  std::ofstream(d / "run" / "metrics.jsonl") << "{\"step\": 1, \"loss\": 4.0}\n{\"step\": 2, \"loss\": 3.5}\n";

  Result missing = run(d, {"plot", (d / "run").string(), "--output", (d / "nowhere" / "loss.png").string()});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_EQ(missing.err, "flowmoe: error: plot: --output '" + (d / "nowhere" / "loss.png").string() +
                             "': its folder '" + (d / "nowhere").string() +
                             "' does not exist (create it first, or name another file)\n");

  // A plotting program that fails with a multi-line message and status 3.
  const fs::path bin = d / "bin";
  fs::create_directories(bin);
  std::ofstream(bin / "gnuplot") << "#!/bin/sh\n"
                                    "echo 'set output \"x\"' >&2\necho '           ^' >&2\n"
                                    "echo '\"plot.gp\" line 2: cannot open file; output not changed' >&2\nexit 3\n";
  fs::permissions(bin / "gnuplot", fs::perms::owner_all);
  const char* path = std::getenv("PATH");
  Result failed = run(d, {"plot", (d / "run").string(), "--output", (d / "loss.png").string()},
                      {"PATH=" + bin.string() + ":" + (path ? path : "/usr/bin:/bin")});
  EXPECT_EQ(failed.exit_code, 1);
  EXPECT_EQ(failed.err,
            "flowmoe: error: plot: gnuplot failed (exit status 3): \"plot.gp\" line 2: cannot open file; "
            "output not changed; no '" +
                (d / "loss.png").string() + "' was written\n");
  fs::remove_all(d);
}

// bench/torch_peer.py reads the config.yaml a run writes (bench/peer_compare.sh takes the tokens per
// step from it), so its key table must know every key flowmoe writes there. Skipped without python3.
TEST(Cli, ThePytorchPeerReadsEveryKeyOfARunsConfig) {
  if (std::system("python3 -c 'import sys' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3 on PATH";
  const fs::path d = fresh_dir("cli_peer_config");
  Result r = run(d, {"train", "--config", write_config(d).string(), "--set", "train.steps=1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const fs::path err = d / "peer_err.txt";
  const std::string cmd = "python3 '" + std::string(FLOWMOE_SOURCE_DIR) +
                          "/bench/torch_peer.py' --yaml builtin --config '" + (d / "run" / "config.yaml").string() +
                          "' --print-config >/dev/null 2>'" + err.string() + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << read_text(err);
  fs::remove_all(d);
}

// The summary's last line splits the run's wall time into parts that add up to it (each printed to
// 0.1 s), and names the set-up parts that took 0.05 s or more.
TEST(Cli, TheTimeLineAddsUpToTheWholeRun) {
  const fs::path d = fresh_dir("cli_time_line");
  // Long enough (about a second) for the parts to be more than their rounding.
  Result r = run(d, {"train", "--config", write_config(d).string(), "--set", "train.steps=400", "--set",
                     "checkpoint.every=200", "--set", "train.eval_every=100"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::smatch m;
  const std::regex line(R"(\ntime: ([0-9.]+) s in all: set-up ([0-9.]+) s(?: \(([^)]*)\))?, training ([0-9.]+) s, )"
                        R"(evaluation ([0-9.]+) s, checkpoints ([0-9.]+) s, other ([0-9.]+) s\n$)");
  ASSERT_TRUE(std::regex_search(r.out, m, line)) << r.out;
  const double total = std::stod(m[1]), setup = std::stod(m[2]);
  double parts = 0;
  for (int i : {4, 5, 6, 7}) parts += std::stod(m[i]);
  EXPECT_NEAR(setup + parts, total, 0.26) << m[0];
  EXPECT_GT(std::stod(m[4]), 0.0) << "400 steps take some training time: " << m[0];
  const std::string named = m[3];
  const std::regex part(R"(([a-z -]+) ([0-9.]+))");
  double named_sum = 0;
  for (auto it = std::sregex_iterator(named.begin(), named.end(), part); it != std::sregex_iterator(); ++it) {
    const std::string name = (*it)[1].str();
    EXPECT_TRUE(name == "start-up" || name == "device and memory check" || name == "data" || name == "model" ||
                name == "optimizer" || name == "checkpoint load" || name == "rest")
        << "unknown set-up part '" << name << "' in " << m[0];
    named_sum += std::stod((*it)[2]);
  }
  EXPECT_LE(named_sum, setup + 0.05 * 7 + 1e-9) << m[0];
  fs::remove_all(d);
}
