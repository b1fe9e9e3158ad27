// Byte-level BPE (dataset/bpe.h) and `flowmoe prepare-data` with it: the word split, merges worked out
// by hand and against the textbook loop, ties, the vocab cap, exact round trips of any bytes, the
// tokenizer file and its errors, words that stop at file boundaries, --exclude, and the command end
// to end.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "dataset/bpe.h"
#include "dataset/data.h"
#include "io/file_io.h"
#include "kernels/common/error.h"
#include "tests/support/train_fixtures.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;
using Merge = BpeTokenizer::Merge;
using Merges = std::vector<Merge>;

namespace {

BpeTokenizer trained_on(const std::vector<std::string>& texts, int64_t vocab_size) {
  BpeWordCounts words;
  for (const std::string& t : texts) words.add_text(t);
  return BpeTokenizer::train(words, vocab_size);
}

void write_text(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

// The textbook loop, with none of the bookkeeping: recount every pair of every word each time.
Merges naive_merges(const std::string& text, int64_t vocab_size) {
  std::map<std::string, int64_t> counts;
  for (std::string_view w : bpe_words(text)) ++counts[std::string(w)];
  std::vector<std::pair<std::vector<int>, int64_t>> words;
  for (const auto& [w, c] : counts) words.push_back({{w.begin(), w.end()}, c});
  for (auto& [s, c] : words)
    for (int& t : s) t = static_cast<unsigned char>(t);
  Merges merges;
  while (256 + int64_t(merges.size()) < vocab_size) {
    std::map<std::pair<int, int>, int64_t> pairs;
    for (const auto& [s, c] : words)
      for (size_t i = 0; i + 1 < s.size(); ++i) pairs[{s[i], s[i + 1]}] += c;
    std::pair<int, int> best{};
    int64_t best_count = 1;
    for (const auto& [p, c] : pairs)  // in key order: the first of the highest count wins ties
      if (c > best_count) best = p, best_count = c;
    if (best_count < 2) break;
    const int token = 256 + int(merges.size());
    merges.push_back({uint16_t(best.first), uint16_t(best.second)});
    for (auto& [s, c] : words) {
      std::vector<int> out;
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == best.first && s[i + 1] == best.second)
          out.push_back(token), ++i;
        else
          out.push_back(s[i]);
      }
      s = out;
    }
  }
  return merges;
}

// Seeded text from a small alphabet, so that many pairs repeat and many counts tie.
std::string random_text(std::mt19937_64& gen, size_t size) {
  const std::string alphabet = "aaabbcde  \n19.,\xc3\xa9";
  std::string s;
  for (size_t i = 0; i < size; ++i) s += alphabet[gen() % alphabet.size()];
  return s;
}

PrepareOptions options(int64_t bpe_vocab, const std::string& tokenizer = "", std::vector<std::string> exclude = {}) {
  PrepareOptions o;
  o.bpe_vocab = bpe_vocab;
  o.tokenizer = tokenizer;
  o.exclude = std::move(exclude);
  return o;
}

const std::string kBinary = std::string(FLOWMOE_BINARY_DIR) + "/flowmoe";

struct CommandResult {
  int exit_code = -1;
  std::string out, err;
};

// Runs the built command with `args` (each quoted for the shell).
CommandResult run_flowmoe(const fs::path& dir, const std::vector<std::string>& args) {
  std::string cmd = "'" + kBinary + "'";
  for (const std::string& a : args) cmd += " '" + a + "'";
  cmd += " >'" + (dir / "out.txt").string() + "' 2>'" + (dir / "err.txt").string() + "'";
  const int status = std::system(cmd.c_str());
  CommandResult r;
  if (status != -1 && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  r.out = read_file(dir / "out.txt");
  r.err = read_file(dir / "err.txt");
  return r;
}

}  // namespace

TEST(Bpe, SplitsWordsLikeGpt2) {
  using W = std::vector<std::string_view>;
  EXPECT_EQ(bpe_words("Hello, world!  42 x\n\n  y"), (W{"Hello", ",", " world", "!", " ", " 42", " x", "\n\n ", " y"}));
  EXPECT_EQ(bpe_words(" caf\xc3\xa9 \xe2\x82\xac"
                      "100 a.b"),
            (W{" caf\xc3\xa9", " \xe2\x82\xac", "100", " a", ".", "b"}));
  EXPECT_EQ(bpe_words(std::string_view("a\0\0b \n", 6)), (W{"a", std::string_view("\0\0", 2), "b", " \n"}));
  EXPECT_EQ(bpe_words(" "), W{" "});
  EXPECT_TRUE(bpe_words("").empty());
}

// The classic example: aa (4 times), then ab and Za tie at 2 (ab has the smaller ids), then ZY.
TEST(Bpe, LearnsTheMergesOfAWorkedExample) {
  BpeTokenizer tok = trained_on({"aaabdaaabac"}, 1000);
  EXPECT_EQ(tok.merges(), (Merges{{'a', 'a'}, {'a', 'b'}, {256, 257}}));
  EXPECT_EQ(tok.vocab_size(), 259);
  EXPECT_EQ(tok.encode("aaabdaaabac"), (std::vector<uint16_t>{258, 'd', 258, 'a', 'c'}));
  EXPECT_EQ(tok.encode("aaaa"), (std::vector<uint16_t>{256, 256}));
}

TEST(Bpe, TiesGoToTheSmallestPair) {
  EXPECT_EQ(trained_on({"cd\nab\ncd\nab"}, 1000).merges(), (Merges{{'a', 'b'}, {'c', 'd'}}));
  EXPECT_EQ(trained_on({"zz yx zz yx"}, 257).merges(), (Merges{{' ', 'y'}}));  // " y" < "yx" < "zz"
}

TEST(Bpe, StopsAtTheVocabOrWhenNoPairRepeats) {
  std::mt19937_64 gen(7);
  const std::string text = random_text(gen, 20000);
  BpeTokenizer capped = trained_on({text}, 300);
  EXPECT_EQ(capped.vocab_size(), 300);
  for (uint16_t t : capped.encode(text)) ASSERT_LT(t, 300);
  EXPECT_EQ(trained_on({"abcdefg"}, 1000).vocab_size(), 256);            // no pair occurs twice
  EXPECT_EQ(trained_on({"abab"}, 1000).merges(), (Merges{{'a', 'b'}}));  // then (Z, Z) occurs once
  EXPECT_EQ(trained_on({""}, 300).vocab_size(), 256);
  BpeWordCounts none;
  EXPECT_TRUE(throws_naming<Error>([&] { BpeTokenizer::train(none, 256); }, {"from 257 to 65536", "got 256"}));
  EXPECT_TRUE(throws_naming<Error>([&] { BpeTokenizer::train(none, 65537); }, {"got 65537"}));
}

// The pair index and the lazy heap give the merges of the textbook loop, and encoding by rank gives
// the training's own segmentation.
TEST(Bpe, MatchesTheTextbookLoop) {
  std::mt19937_64 gen(test_seed());
  const std::string text = random_text(gen, 30000);
  BpeTokenizer tok = trained_on({text}, 420);
  const Merges want = naive_merges(text, 420);
  ASSERT_EQ(tok.merges(), want);
  ASSERT_EQ(tok.vocab_size(), 420);
  std::vector<uint16_t> naive;
  for (std::string_view w : bpe_words(text)) {
    std::vector<uint16_t> s(w.begin(), w.end());
    for (uint16_t& t : s) t = uint16_t(t & 0xFF);
    for (size_t m = 0; m < want.size(); ++m) {
      std::vector<uint16_t> out;
      for (size_t i = 0; i < s.size(); ++i) {
        const bool hit = i + 1 < s.size() && s[i] == want[m].left && s[i + 1] == want[m].right;
        out.push_back(hit ? uint16_t(256 + m) : s[i]);
        i += hit;
      }
      s = out;
    }
    naive.insert(naive.end(), s.begin(), s.end());
  }
  EXPECT_EQ(tok.encode(text), naive);
}

TEST(Bpe, EncodeDecodeRoundTripsAnyBytes) {
  std::mt19937_64 gen(test_seed());
  BpeTokenizer text_tok = trained_on({random_text(gen, 20000)}, 600);
  std::string random_bytes;
  for (int i = 0; i < 20000; ++i) random_bytes += char(gen() % 7 == 0 ? 0 : gen() % 256);
  BpeTokenizer byte_tok = trained_on({random_bytes}, 2000);
  std::vector<std::string> inputs = {"",
                                     std::string(1, '\0'),
                                     std::string("a\0b\0\0", 5),
                                     "\xff\xfe\xc3(\x80",
                                     std::string(10000, '='),
                                     std::string(5000, ' ') + "x",
                                     random_bytes,
                                     random_text(gen, 5000)};
  for (int i = 0; i < 50; ++i) {
    std::string s;
    for (size_t n = gen() % 300; n > 0; --n) s += char(gen() % 256);
    inputs.push_back(s);
  }
  for (BpeTokenizer* tok : {&text_tok, &byte_tok}) {
    for (const std::string& s : inputs) {
      const std::vector<uint16_t> tokens = tok->encode(s);
      for (uint16_t t : tokens) ASSERT_LT(t, tok->vocab_size());
      ASSERT_EQ(tok->decode(tokens), s) << "input of " << s.size() << " bytes";
      ASSERT_EQ(tok->encode(s), tokens) << "the cached words encode the same";
    }
  }
  EXPECT_LT(text_tok.encode(random_text(gen, 5000)).size(), 4500u);  // it learned something
  EXPECT_TRUE(throws_naming<Error>([&] { text_tok.decode({1, 600}); }, {"token 600 at position 1"}));
}

TEST(Bpe, SavesAndLoads) {
  const fs::path d = fresh_dir("bpe_save");
  std::mt19937_64 gen(3);
  const std::string text = random_text(gen, 10000);
  BpeTokenizer tok = trained_on({text}, 400);
  const std::string path = (d / "t.bpe").string();
  tok.save(path);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  const std::string file = read_file(path);
  EXPECT_EQ(file.substr(0, file.find('\n')), "flowmoe-bpe 1 vocab 400");
  BpeTokenizer loaded = BpeTokenizer::load(path);
  EXPECT_EQ(loaded.merges(), tok.merges());
  EXPECT_EQ(loaded.encode(text), tok.encode(text));
  BpeTokenizer().save(path);
  EXPECT_EQ(read_file(path), "flowmoe-bpe 1 vocab 256\n");
  EXPECT_EQ(BpeTokenizer::load(path).vocab_size(), 256);
  fs::remove_all(d);
}

TEST(Bpe, BadTokenizerFilesNameTheFileAndLine) {
  const fs::path d = fresh_dir("bpe_bad");
  const std::string path = (d / "bad.bpe").string();
  auto fails = [&](const std::string& text, const std::string& line, const char* what) {
    write_text(path, text);
    const std::string where = path + ":" + line + ":";
    return throws_naming<IoError>([&] { BpeTokenizer::load(path); }, {where.c_str(), what});
  };
  EXPECT_TRUE(fails("", "1", "the file is empty"));
  EXPECT_TRUE(fails("hello\n", "1", "expected 'flowmoe-bpe 1 vocab N', got 'hello'"));
  EXPECT_TRUE(fails("flowmoe-bpe 2 vocab 257\n97 98\n", "1", "version '2', expected 1"));
  EXPECT_TRUE(fails("flowmoe-bpe 1 vocab 70000\n", "1", "vocab '70000' is not a whole number from 256 to 65536"));
  EXPECT_TRUE(fails("flowmoe-bpe 1 vocab 258\n97 98\n", "2", "holds 1 of the 2 merges"));
  EXPECT_TRUE(fails("flowmoe-bpe 1 vocab 257\n97 98\n99 100\n", "3", "more merges than the 1"));
  EXPECT_TRUE(fails("flowmoe-bpe 1 vocab 258\n97 98\n97 x\n", "3", "expected a merge 'LEFT RIGHT'"));
  EXPECT_TRUE(fails("flowmoe-bpe 1 vocab 258\n97 98\n-1 2\n", "3", "expected a merge 'LEFT RIGHT'"));
  EXPECT_TRUE(fails("flowmoe-bpe 1 vocab 258\n97 98\n97 98 99\n", "3", "expected a merge 'LEFT RIGHT'"));
  EXPECT_TRUE(fails("flowmoe-bpe 1 vocab 258\n97 98\n\n", "3", "expected a merge 'LEFT RIGHT'"));
  EXPECT_TRUE(fails("flowmoe-bpe 1 vocab 258\n97 98\n300 1\n", "3",
                    "merge '300 1' names a token that does not exist before token 257"));
  EXPECT_TRUE(fails("flowmoe-bpe 1 vocab 258\n97 98\n97 98\n", "3", "repeats merge 0 (token 256)"));
  EXPECT_TRUE(throws_naming<IoError>([&] { BpeTokenizer::load((d / "none.bpe").string()); }, {"none.bpe"}));
  fs::remove_all(d);
}

// "aaa" in two texts is the word "aaa" twice (aa, then aa+a), not the word "aaaaaa" (aa, then aa+aa).
TEST(Bpe, WordsDoNotCrossTexts) {
  EXPECT_EQ(trained_on({"aaa", "aaa"}, 1000).merges(), (Merges{{'a', 'a'}, {256, 'a'}}));
  EXPECT_EQ(trained_on({"aaaaaa"}, 1000).merges(), (Merges{{'a', 'a'}, {256, 256}}));
}

TEST(PrepareData, BpeEncodesEachFileOnItsOwnAndSavesTheTokenizer) {
  const fs::path d = fresh_dir("bpe_files");
  write_text(d / "in" / "1.txt", "aaa");
  write_text(d / "in" / "2.txt", "aaa");
  const std::string out = (d / "in" / "tokens.bin").string();  // inside the input: skipped with its tokenizer
  for (int run = 0; run < 2; ++run) {
    PreparedInputs read;
    EXPECT_EQ(prepare_token_file({(d / "in").string()}, out, &read, options(1000)), 2);
    EXPECT_EQ(read_token_file(out), (std::vector<uint16_t>{257, 257})) << "run " << run;
    EXPECT_EQ(read.files.size(), 2u);
    EXPECT_EQ(read.tokenizer, (d / "in" / "tokens.bpe").string());
    EXPECT_EQ(read.vocab_size, 258);
    EXPECT_EQ(BpeTokenizer::load(read.tokenizer).merges(), (Merges{{'a', 'a'}, {256, 'a'}}));
  }
  // An existing tokenizer encodes other inputs without learning anything.
  write_text(d / "other.txt", "aaaaa b");
  PreparedInputs read;
  const std::string other = (d / "other.bin").string();
  const std::string saved = (d / "in" / "tokens.bpe").string();
  EXPECT_EQ(prepare_token_file({(d / "other.txt").string()}, other, &read, options(0, saved)), 4);
  EXPECT_EQ(read_token_file(other), (std::vector<uint16_t>{256, 257, ' ', 'b'}));
  EXPECT_EQ(read.vocab_size, 258);
  EXPECT_FALSE(fs::exists(d / "other.bpe"));
  fs::remove_all(d);
}

TEST(PrepareData, ExcludeSkipsMatchingFilesBelowADirectory) {
  const fs::path d = fresh_dir("bpe_exclude");
  const fs::path in = d / "docs";
  write_text(in / "a.txt", "A");
  write_text(in / "translations" / "it" / "a.txt", "I");
  write_text(in / "translations.txt", "T");
  write_text(in / "z" / "notes.md", "N");
  const std::string out = (d / "out.bin").string();
  for (const char* pattern : {"translations/*", "translations", "*/it"}) {
    PreparedInputs read;
    EXPECT_EQ(prepare_token_file({in.string()}, out, &read, options(0, "", {pattern, "*.md"})), 2) << pattern;
    EXPECT_EQ(read_token_file(out), (std::vector<uint16_t>{'A', 'T'})) << pattern;
    const std::string excluded =
        (in / "translations" / "it" / "a.txt").string() + ", " + (in / "z" / "notes.md").string();
    EXPECT_EQ(read.summary(), "read 2 files (2 bytes), excluded 2 files: " + excluded);
  }
  // A file named as an input is read even when a pattern matches it; an all-excluded directory is an error.
  EXPECT_EQ(prepare_token_file({(in / "z" / "notes.md").string()}, out, nullptr, options(0, "", {"*"})), 1);
  EXPECT_TRUE(throws_naming<IoError>([&] { prepare_token_file({in.string()}, out, nullptr, options(0, "", {"*"})); },
                                     {"holds no text files (0 binary files skipped, 4 excluded)"}));
  fs::remove_all(d);
}

TEST(PrepareData, BadBpeOptionsNameTheOption) {
  const fs::path d = fresh_dir("bpe_options");
  write_text(d / "a.txt", "abab");
  const std::vector<std::string> in = {(d / "a.txt").string()};
  const std::string out = (d / "out.bin").string();
  EXPECT_TRUE(throws_naming<ConfigError>([&] { prepare_token_file(in, out, nullptr, options(256)); },
                                         {"--bpe-vocab must be from 257 to 65536", "got 256"}));
  EXPECT_TRUE(throws_naming<ConfigError>([&] { prepare_token_file(in, out, nullptr, options(70000)); },
                                         {"--bpe-vocab", "got 70000"}));
  EXPECT_TRUE(
      throws_naming<ConfigError>([&] { prepare_token_file(in, out, nullptr, options(300, "t.bpe")); }, {"not both"}));
  EXPECT_TRUE(throws_naming<ConfigError>(
      [&] { prepare_token_file(in, (d / "out.bpe").string(), nullptr, options(300)); }, {"ends in .bpe"}));
  EXPECT_TRUE(
      throws_naming<IoError>([&] { prepare_token_file(in, out, nullptr, options(0, (d / "none.bpe").string())); },
                             {"--tokenizer '", "none.bpe' does not exist"}));
  EXPECT_FALSE(fs::exists(out));
  fs::remove_all(d);
}

// The built command: train, encode, and decode back to the inputs in their order; then encode again
// with the saved tokenizer; bad option values are one-line errors.
TEST(PrepareData, BpeCommandEndToEnd) {
  const fs::path d = fresh_dir("bpe_cli");
  std::mt19937_64 gen(11);
  std::string all;
  for (const char* name : {"b/2.txt", "a.txt", "b/1.txt", "skip/x.txt"})
    write_text(d / "in" / name, random_text(gen, 4000));
  for (const char* name : {"a.txt", "b/1.txt", "b/2.txt"}) all += read_file(d / "in" / name);
  const std::string out = (d / "tokens.bin").string();
  CommandResult r = run_flowmoe(
      d, {"prepare-data", "--output", out, "--bpe-vocab", "300", "--exclude", "skip/*", (d / "in").string()});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("read 3 files (12.0 kB), excluded 1 file: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("trained a BPE tokenizer of vocab 300 on "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("(BPE, vocab 300, "), std::string::npos) << r.out;
  const std::vector<uint16_t> tokens = read_token_file(out);
  for (uint16_t t : tokens) ASSERT_LT(t, 300);
  EXPECT_LT(tokens.size(), all.size());
  BpeTokenizer tok = BpeTokenizer::load((d / "tokens.bpe").string());
  EXPECT_EQ(tok.decode(tokens), all);

  const std::string again = (d / "again.bin").string();
  r = run_flowmoe(d, {"prepare-data", "-o", again, "--tokenizer", (d / "tokens.bpe").string(), "--exclude=skip",
                      (d / "in").string()});
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_EQ(read_token_file(again), tokens);

  const std::string in = (d / "in" / "a.txt").string();
  for (const char* bad : {"256", "65537", "0", "-5", "abc", "12x", "", "99999999999999999999"}) {
    r = run_flowmoe(d, {"prepare-data", "--output", out, "--bpe-vocab", bad, in});
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_EQ(r.err.rfind("flowmoe: error: prepare-data: --bpe-vocab needs a whole number from 257 to 65536", 0), 0u)
        << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
  r = run_flowmoe(d, {"prepare-data", "--output", out, "--tokenizer", (d / "none.bpe").string(), in});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err, "flowmoe: error: prepare-data: --tokenizer '" + (d / "none.bpe").string() + "' does not exist\n");
  write_text(d / "bad.bpe", "flowmoe-bpe 1 vocab 257\n1 2 3\n");
  r = run_flowmoe(d, {"prepare-data", "--output", out, "--tokenizer", (d / "bad.bpe").string(), in});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.err.find((d / "bad.bpe").string() + ":2: expected a merge"), std::string::npos) << r.err;
  fs::remove_all(d);
}
