// `flowmoe walkthrough` and docs/WALKTHROUGH.md: every output block the document shows after a
// `build/flowmoe walkthrough ...` command is what that command prints now (a line "..." in a block
// stands for lines left out), every step appears in the document, the output is the same on every
// run, and the step that runs MoeLayer itself finds every tensor bit-identical to the walk's.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Output {
  int status = -1;
  std::string out;
};

// Runs `flowmoe walkthrough <args>` (stderr into stdout) and returns its exit status and output.
Output walkthrough(const std::string& args) {
  const std::string cmd = std::string(FLOWMOE_BINARY_DIR) + "/flowmoe walkthrough " + args + " 2>&1";
  Output r;
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

struct Block {
  std::string args;  // what follows "build/flowmoe walkthrough"
  int line = 0;      // where the command is named in the document
  std::vector<std::string> shown;
};

// Each `build/flowmoe walkthrough ARGS` (in backticks) followed, after blank lines, by a ```text block.
std::vector<Block> doc_blocks(const std::vector<std::string>& doc) {
  static const std::regex command("`build/flowmoe walkthrough([^`]*)`");
  std::vector<Block> blocks;
  for (size_t i = 0; i < doc.size(); ++i) {
    std::smatch m;
    if (!std::regex_search(doc[i], m, command)) continue;
    size_t j = i + 1;
    while (j < doc.size() && doc[j].empty()) ++j;
    if (j >= doc.size() || doc[j] != "```text") continue;  // a command named in prose, no output shown
    Block b{m[1].str(), int(i + 1), {}};
    for (++j; j < doc.size() && doc[j] != "```"; ++j) b.shown.push_back(doc[j]);
    blocks.push_back(b);
    i = j;
  }
  return blocks;
}

// The shown lines must be printed lines, in order and consecutive, except where "..." skips some.
std::string mismatch(const std::vector<std::string>& shown, const std::vector<std::string>& printed) {
  size_t p = 0;
  bool skipping = false;
  for (const std::string& want : shown) {
    if (want == "...") {
      skipping = true;
      continue;
    }
    while (skipping && p < printed.size() && printed[p] != want) ++p;
    if (p >= printed.size() || printed[p] != want) return want;
    ++p, skipping = false;
  }
  return "";
}

std::vector<std::string> read_doc() {
  std::ifstream in(fs::path(FLOWMOE_SOURCE_DIR) / "docs/WALKTHROUGH.md");
  std::stringstream ss;
  ss << in.rdbuf();
  return lines_of(ss.str());
}

}  // namespace

TEST(Walkthrough, DocumentShowsRealOutput) {
  const std::vector<std::string> doc = read_doc();
  ASSERT_FALSE(doc.empty()) << "docs/WALKTHROUGH.md is missing";
  const std::vector<Block> blocks = doc_blocks(doc);
  ASSERT_GE(blocks.size(), 20u) << "docs/WALKTHROUGH.md shows too few walkthrough outputs";
  for (const Block& b : blocks) {
    SCOPED_TRACE("docs/WALKTHROUGH.md:" + std::to_string(b.line) + ": build/flowmoe walkthrough" + b.args);
    const Output r = walkthrough(b.args);
    ASSERT_EQ(r.status, 0) << r.out;
    ASSERT_FALSE(b.shown.empty());
    const std::string bad = mismatch(b.shown, lines_of(r.out));
    EXPECT_EQ(bad, "") << "the document shows a line the command does not print (or not there):\n  " << bad
                       << "\nthe command printed:\n"
                       << r.out;
  }
}

TEST(Walkthrough, DocumentShowsEveryStep) {
  const std::vector<Block> blocks = doc_blocks(read_doc());
  std::set<std::string> shown;
  static const std::regex step(R"(--step (\S+))");
  for (const Block& b : blocks) {
    std::smatch m;
    if (std::regex_search(b.args, m, step)) shown.insert(m[1].str());
  }
  // The names, as the help lists them.
  const Output help = walkthrough("--help");
  ASSERT_EQ(help.status, 0);
  const std::string intro = "NAME is one of";
  const size_t at = help.out.find(intro) + intro.size();
  ASSERT_NE(help.out.find(intro), std::string::npos) << help.out;
  const std::string list = help.out.substr(at, help.out.find("--seed", at) - at);
  static const std::regex name(R"(([a-z0-9]+(-[a-z]+)?)(,|\n))");
  int steps = 0;
  for (auto it = std::sregex_iterator(list.begin(), list.end(), name); it != std::sregex_iterator(); ++it, ++steps)
    EXPECT_TRUE(shown.count((*it)[1].str())) << "docs/WALKTHROUGH.md shows no output of --step " << (*it)[1].str();
  EXPECT_GE(steps, 20) << list;
}

TEST(Walkthrough, SameOutputEveryRunAndLayerAgrees) {
  const Output a = walkthrough(""), b = walkthrough("");
  ASSERT_EQ(a.status, 0) << a.out;
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.out.find("DIFFERENT"), std::string::npos) << a.out;
  EXPECT_EQ(a.out.find(": NO"), std::string::npos) << a.out;
  EXPECT_NE(a.out.find("y      identical; dx identical"), std::string::npos) << a.out;
  // Another seed: other numbers, the same agreement with the layer.
  const Output c = walkthrough("--seed 7");
  ASSERT_EQ(c.status, 0) << c.out;
  EXPECT_NE(c.out, a.out);
  EXPECT_EQ(c.out.find("DIFFERENT"), std::string::npos) << c.out;
  // One step prints only its own block.
  const Output one = walkthrough("--step router");
  ASSERT_EQ(one.status, 0);
  EXPECT_EQ(one.out.rfind("== forward 1 [router]: scores and top-2 ==\n", 0), 0u) << one.out;
  EXPECT_EQ(one.out.find("== forward 2"), std::string::npos) << one.out;
}

TEST(Walkthrough, BadArgumentsExit2) {
  const Output bad_step = walkthrough("--step nope");
  EXPECT_EQ(bad_step.status, 2);
  EXPECT_NE(bad_step.out.find("unknown step 'nope'"), std::string::npos) << bad_step.out;
  const Output bad_seed = walkthrough("--seed x");
  EXPECT_EQ(bad_seed.status, 2);
  EXPECT_NE(bad_seed.out.find("--seed needs a non-negative integer"), std::string::npos) << bad_seed.out;
  const Output missing = walkthrough("--step");
  EXPECT_EQ(missing.status, 2);
  EXPECT_NE(missing.out.find("--step needs a value"), std::string::npos) << missing.out;
}
