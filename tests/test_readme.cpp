// The quick-start output that README.md and docs/TRAINING.md show is a copy of real output: this
// trains configs/tiny.yaml on the CPU as the quick start does and checks that every line they show
// is a line the run printed.
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

#include "tests/train_test_util.h"
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
      took(R"( in [0-9hms]+ \|)"), available(R"(of [0-9.]+ [KMGT]?i?B available)"), time_line(R"(^time: .*)");
  if (std::regex_match(s, time_line)) return "time: T";  // every figure of it, and which parts it names
  s = std::regex_replace(s, rate, "R tok/s");
  s = std::regex_replace(s, flop_rate, "F TFLOP/s");
  s = std::regex_replace(s, eta, "ETA T");
  s = std::regex_replace(s, available, "of A available");
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

}  // namespace

TEST(Readme, QuickStartOutputIsRealOutput) {
  const std::vector<std::pair<std::string, std::string>> blocks = {
      {"README.md", "Expected output on a CPU:"}, {"docs/TRAINING.md", "progress is printed as plain lines:"}};

  const fs::path d = fresh_dir("readme");
  Config cfg = load_config((fs::path(FLOWMOE_SOURCE_DIR) / "configs/tiny.yaml").string(),
                           {"train.device=cpu", "logging.progress=plain", "logging.out_dir=" + (d / "tiny").string()});
  std::FILE* out = std::tmpfile();
  ASSERT_NE(out, nullptr);
  TrainOptions opts;
  opts.out = out;
  train(cfg, opts);
  std::vector<std::string> printed;
  for (const std::string& l : read_lines(out)) printed.push_back(mask_timings(replace_all(l, d.string(), "runs")));
  std::fclose(out);
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
