// The quick-start output that README.md and docs/TRAINING.md show is a copy of real output: this
// trains the config scripts/quickstart.sh trains (configs/tiny_text.yaml, on its committed text) on the
// CPU from the repository root as the quick start does, runs the `flowmoe generate` line the README's
// quick start ends with on that run's final checkpoint (through the built command, as
// scripts/quickstart.sh does), and checks that every line they show is a line the two printed.
// Timings (tok/s, TFLOP/s, ETA, durations, the time line) and the memory available differ between machines
// and are masked on both sides.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/cli_run.h"
#include "tests/support/train_fixtures.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// The output block that follows the line holding `marker` in the document `doc`: a ```text fence,
// or lines indented by 4 spaces; without the fence or the indent.
std::vector<std::string> shown_block(const std::string& doc, const std::string& marker) {
  std::ifstream in(fs::path(FLOWMOE_SOURCE_DIR) / doc);
  std::vector<std::string> block;
  std::string line;
  while (std::getline(in, line) && line.find(marker) == std::string::npos) {
  }
  while (std::getline(in, line) && line.empty()) {
  }
  if (line == "```text") {
    while (std::getline(in, line) && line != "```") block.push_back(line);
    return block;
  }
  do {
    if (line.rfind("    ", 0) != 0) break;
    block.push_back(line.substr(4));
  } while (std::getline(in, line));
  return block;
}

// Replaces what depends on the machine's speed and memory with placeholders.
std::string mask_timings(std::string s) {
  static const std::regex rate(R"([0-9.]+k? tok/s)"), flop_rate(R"([0-9.]+ TFLOP/s)"), eta(R"(ETA [0-9hms]+)"),
      took(R"( in [0-9hms]+ \|)"), took_ms(R"( in [0-9.]+ ms)"), available(R"(of [0-9.]+ [KMGT]?i?B available)"),
      time_line(R"(^time: .*)");
  if (std::regex_match(s, time_line)) return "time: T";  // every figure of it, and which parts it names
  s = std::regex_replace(s, rate, "R tok/s");
  s = std::regex_replace(s, flop_rate, "F TFLOP/s");
  s = std::regex_replace(s, eta, "ETA T");
  s = std::regex_replace(s, available, "of A available");
  s = std::regex_replace(s, took_ms, " in T ms");
  return std::regex_replace(s, took, " in T |");
}

std::vector<std::string> read_lines(std::FILE* f) {
  std::rewind(f);
  std::vector<std::string> lines;
  char buf[4096];
  while (std::fgets(buf, sizeof buf, f)) {
    std::string l = buf;
    if (!l.empty() && l.back() == '\n') l.pop_back();
    lines.push_back(l);
  }
  return lines;
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t at = s.find(from); at != std::string::npos; at = s.find(from, at + to.size()))
    s.replace(at, from.size(), to);
  return s;
}

// The words of a shell command line, a double-quoted word without its quotes.
std::vector<std::string> shell_words(const std::string& line) {
  std::vector<std::string> words;
  std::string word;
  bool quoted = false, any = false;
  for (char c : line) {
    if (c == '"') {
      quoted = !quoted;
      any = true;
    } else if (c == ' ' && !quoted) {
      if (any) words.push_back(word);
      word.clear();
      any = false;
    } else {
      word += c;
      any = true;
    }
  }
  if (any) words.push_back(word);
  return words;
}

// The words of the first line of `file` (from the line holding `from` on) that holds `command`.
std::vector<std::string> command_line(const std::string& file, const std::string& from, const std::string& command) {
  std::ifstream in(fs::path(FLOWMOE_SOURCE_DIR) / file);
  std::string line;
  while (std::getline(in, line) && line.find(from) == std::string::npos) {
  }
  while (std::getline(in, line))
    if (line.find(command) != std::string::npos) return shell_words(line);
  return {};
}

// Runs from `dir` while it lives: the quick start runs from the repository root, where the config's
// relative data.path points.
class WorkingDirectory {
 public:
  explicit WorkingDirectory(const fs::path& dir) : before_(fs::current_path()) { fs::current_path(dir); }
  ~WorkingDirectory() { fs::current_path(before_); }
  WorkingDirectory(const WorkingDirectory&) = delete;
  WorkingDirectory& operator=(const WorkingDirectory&) = delete;

 private:
  fs::path before_;
};

}  // namespace

TEST(Readme, QuickStartOutputIsRealOutput) {
  const std::vector<std::pair<std::string, std::string>> blocks = {
      {"README.md", "Expected output on a CPU:"}, {"docs/TRAINING.md", "progress is printed as plain lines:"}};

  // The config the quick start trains, as scripts/quickstart.sh names it.
  const std::vector<std::string> trains = command_line("scripts/quickstart.sh", "set -euo", "flowmoe train ");
  const auto config_arg = std::find(trains.begin(), trains.end(), "--config");
  ASSERT_LT(config_arg + 1, trains.end()) << "scripts/quickstart.sh has no flowmoe train --config line";
  const std::string config = config_arg[1];
  EXPECT_NE(command_line("scripts/quickstart.sh", "set -euo", "[quickstart] training " + config + "\"").size(), 0u)
      << "scripts/quickstart.sh does not say it trains " << config;

  const fs::path d = fresh_dir("readme");
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  {
    const WorkingDirectory at_root(FLOWMOE_SOURCE_DIR);
    const std::string out_dir = (d / load_config(config).logging.out_dir).string();
    Config cfg = load_config(config, {"train.device=cpu", "logging.progress=plain", "logging.out_dir=" + out_dir});
    TrainOptions opts;
    opts.out = out;
    train(cfg, opts);
  }
  std::vector<std::string> printed;
  for (const std::string& l : read_lines(out)) printed.push_back(mask_timings(replace_all(l, d.string() + "/", "")));
  std::fclose(out);

  const auto summary =
      std::find_if(printed.begin(), printed.end(), [](const std::string& l) { return l.rfind("metrics: ", 0) == 0; });
  ASSERT_NE(summary, printed.end());
  const std::string printed_checkpoint = summary->substr(summary->find("checkpoint: ") + 12);
  // The quick start's last command, from the README as a user copies it, run in the folder that holds runs/
  // but not the run's text: generate reads the checkpoint's config, whose relative data.path does not resolve
  // here, and needs no data file for a byte-level tokenizer.
  std::vector<std::string> generate = command_line("README.md", "## Quick start", "flowmoe generate ");
  ASSERT_GE(generate.size(), 4u) << "README.md's quick start shows no flowmoe generate line";
  EXPECT_EQ(generate[0], "build/flowmoe");
  const Ran sampled = run_flowmoe_command(d, std::vector<std::string>(generate.begin() + 1, generate.end()), 60);
  ASSERT_EQ(sampled.code, 0) << "README.md's generate line failed on the quick start's run:\n" << sampled.err;
  const auto prompt = std::find(generate.begin(), generate.end(), "--prompt");
  ASSERT_LT(prompt + 1, generate.end()) << "README.md's generate line gives no --prompt";
  const std::string first_line = sampled.out.substr(0, sampled.out.find('\n'));
  EXPECT_EQ(first_line.rfind(prompt[1], 0), 0u) << "generate did not print the prompt: " << sampled.out;
  EXPECT_GT(first_line.size(), prompt[1].size() + 1) << "generate printed no continuation: " << sampled.out;
  const std::regex rates(R"(^prefill: .* tok/s\) \| decode: .* tok/s\)$)");
  std::istringstream err(sampled.err), text(sampled.out);
  size_t num_rate_lines = 0;
  for (std::string l; std::getline(err, l);) {
    num_rate_lines += std::regex_match(l, rates);
    printed.push_back(mask_timings(l));
  }
  EXPECT_EQ(num_rate_lines, 1u) << "generate printed no tokens/s line: " << sampled.err;
  for (std::string l; std::getline(text, l);) printed.push_back(l);
  // scripts/quickstart.sh runs the same command on the run's last checkpoint.
  std::vector<std::string> script = command_line("scripts/quickstart.sh", "set -euo", " generate ");
  ASSERT_EQ(generate[2], "--checkpoint");
  ASSERT_EQ(script.size(), generate.size()) << "scripts/quickstart.sh's generate line differs from README.md's";
  script[0] = generate[0];  // "$build"/flowmoe
  script[3] = generate[3];  // the checkpoint it finds
  EXPECT_EQ(script, generate) << "scripts/quickstart.sh's generate line differs from README.md's";
  EXPECT_EQ(generate[3], printed_checkpoint)
      << "README.md's generate line names another checkpoint than the run's last";
  std::ostringstream all;
  for (const std::string& p : printed) all << "\n  " << p;

  for (const auto& [doc, marker] : blocks) {
    SCOPED_TRACE(doc);
    const std::vector<std::string> shown = shown_block(doc, marker);
    ASSERT_GE(shown.size(), 4u) << doc << " has no output block after '" << marker << "'";
    for (const std::string& line : shown) {
      // "..." stands for lines left out; "wrote ..." is the quick start's plot step, not the trainer.
      if (line == "..." || line.rfind("wrote ", 0) == 0) continue;
      const std::string want = mask_timings(line);
      EXPECT_NE(std::find(printed.begin(), printed.end(), want), printed.end())
          << doc << " shows a line the run did not print:\n  " << want << "\nthe run printed:" << all.str();
    }
  }
  fs::remove_all(d);
}
