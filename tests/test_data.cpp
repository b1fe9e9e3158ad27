// The data pipeline: token files (llm.c format), the synthetic corpora, and the loader's seeded
// order, epochs, validation split and resumable position (prepare-data: test_prepare_data.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>

#include "dataset/data.h"
#include "kernels/common/error.h"
#include "tests/support/checks.h"

using namespace flowmoe;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("flowmoe_test_data_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::vector<int64_t> ints(const Tensor& t) { return t.to_ints(); }

}  // namespace

TEST(TokenFile, RoundTripAndHeaderLayout) {
  fs::path d = temp_dir("roundtrip");
  std::vector<uint16_t> tokens = {0, 1, 65535, 300, 7, 42};
  std::string path = (d / "t.bin").string();
  write_token_file(path, tokens);
  EXPECT_EQ(read_token_file(path), tokens);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  // The llm.c layout, byte for byte: 256 int32 header, then uint16 tokens.
  EXPECT_EQ(fs::file_size(path), 1024u + 2 * tokens.size());
  std::ifstream in(path, std::ios::binary);
  int32_t header[256];
  in.read(reinterpret_cast<char*>(header), sizeof header);
  EXPECT_EQ(header[0], 20240520);
  EXPECT_EQ(header[1], 1);
  EXPECT_EQ(header[2], int32_t(tokens.size()));
  uint16_t third = 0;
  in.seekg(1024 + 2 * 2);
  in.read(reinterpret_cast<char*>(&third), 2);
  EXPECT_EQ(third, 65535);
  fs::remove_all(d);
}

TEST(TokenFile, BadFilesAreNamed) {
  fs::path d = temp_dir("bad");
  std::string path = (d / "bad.bin").string();
  write_token_file(path, {1, 2, 3, 4});
  {  // wrong magic
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    int32_t magic = 12345;
    f.write(reinterpret_cast<char*>(&magic), 4);
  }
  try {
    read_token_file(path);
    FAIL() << "no error";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("bad.bin"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("magic 12345"), std::string::npos) << e.what();
  }
  write_token_file(path, {1, 2, 3, 4});
  fs::resize_file(path, 1024 + 5);  // truncated body
  EXPECT_THROW(read_token_file(path), IoError);
  EXPECT_THROW(read_token_file((d / "missing.bin").string()), IoError);
  fs::remove_all(d);
}

// The body must be exactly the header's token count of uint16 tokens: an odd byte, extra tokens or
// a short body are refused with the file's size and the size its header means.
TEST(TokenFile, SizeMustMatchTheHeader) {
  fs::path d = temp_dir("size");
  const std::string path = (d / "t.bin").string();
  auto error_of = [&](const std::function<void()>& damage) {
    write_token_file(path, {1, 2, 3, 4});  // 1024 + 8 = 1032 bytes
    damage();
    try {
      read_token_file(path);
    } catch (const IoError& e) {
      return std::string(e.what());
    }
    ADD_FAILURE() << "no IoError for " << fs::file_size(path) << " bytes";
    return std::string();
  };
  auto append = [&](int n) { std::ofstream(path, std::ios::binary | std::ios::app) << std::string(size_t(n), 'x'); };
  std::string m = error_of([&] { append(1); });
  EXPECT_NE(m.find("'" + path + "' is 1033 bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("odd"), std::string::npos) << m;
  EXPECT_NE(m.find("1032 bytes"), std::string::npos) << m;
  m = error_of([&] { append(2); });
  EXPECT_NE(m.find("is 1034 bytes, but its header's token count 4 means 1024 + 2 x 4 = 1032 bytes (extra bytes"),
            std::string::npos)
      << m;
  m = error_of([&] { fs::resize_file(path, 1028); });
  EXPECT_NE(m.find("is 1028 bytes, but its header's token count 4 means 1024 + 2 x 4 = 1032 bytes (truncated)"),
            std::string::npos)
      << m;
  m = error_of([&] { fs::resize_file(path, 100); });
  EXPECT_NE(m.find("'" + path + "' is 100 bytes, shorter than its 1024-byte header"), std::string::npos) << m;
  m = error_of([&] {  // a count no file of this size can hold is caught before anything is allocated
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    const int32_t count = INT32_MAX;
    f.seekp(8);
    f.write(reinterpret_cast<const char*>(&count), 4);
  });
  EXPECT_NE(m.find("token count 2147483647 means 1024 + 2 x 2147483647 = 4294968318 bytes (truncated)"),
            std::string::npos)
      << m;
  EXPECT_TRUE(test::throws_naming<IoError>([&] { read_token_file(d.string()); }, {"not a regular file"}));
  write_token_file(path, {});
  EXPECT_TRUE(read_token_file(path).empty());
  fs::remove_all(d);
}

TEST(SyntheticCorpus, SeededAndInRange) {
  auto a = synthetic_corpus(256, 50000, 7), b = synthetic_corpus(256, 50000, 7), c = synthetic_corpus(256, 50000, 8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  ASSERT_EQ(a.size(), 50000u);
  for (uint16_t t : a) ASSERT_LT(t, 256);
  auto small = synthetic_corpus(16, 1000, 1);
  for (uint16_t t : small) ASSERT_LT(t, 16);
}

// The corpus must be learnable: the empirical next-token entropy given the previous token is well
// under half of ln(vocab), so even a bigram model can halve the loss.
TEST(SyntheticCorpus, IsLearnable) {
  const int64_t vocab = 256;
  auto tokens = synthetic_corpus(vocab, 400000, 1234);
  std::map<std::pair<int, int>, double> pair_count;
  std::map<int, double> prev_count;
  for (size_t i = 1; i < tokens.size(); ++i) {
    pair_count[{tokens[i - 1], tokens[i]}] += 1;
    prev_count[tokens[i - 1]] += 1;
  }
  double h = 0, n = double(tokens.size() - 1);
  for (const auto& [pair, cnt] : pair_count) h -= cnt / n * std::log(cnt / prev_count[pair.first]);
  EXPECT_LT(h, 0.5 * std::log(double(vocab))) << "bigram entropy " << h << " nats";
  EXPECT_GT(h, 0.1) << "the corpus should not be trivial";
}

TEST(SyntheticBigramCorpus, SeededAndInRange) {
  auto a = synthetic_bigram_corpus(8192, 50000, 7), b = synthetic_bigram_corpus(8192, 50000, 7),
       c = synthetic_bigram_corpus(8192, 50000, 8);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  ASSERT_EQ(a.size(), 50000u);
  for (uint16_t t : a) ASSERT_LT(t, 8192);
  EXPECT_NE(a, synthetic_corpus(8192, 50000, 7)) << "the two corpora must differ";
  auto small = synthetic_bigram_corpus(16, 5000, 1);
  ASSERT_EQ(small.size(), 5000u);
  std::set<uint16_t> seen(small.begin(), small.end());
  for (uint16_t t : small) ASSERT_LT(t, 16);
  EXPECT_GE(seen.size(), 8u) << "a 16-token vocabulary should still be mostly used";
  EXPECT_TRUE(synthetic_bigram_corpus(256, 0, 1).empty());
  EXPECT_TRUE(test::throws_naming<Error>([] { synthetic_bigram_corpus(8, 100, 1); }, {"vocab_size 8"}));
}

// BPE-like statistics: no dominant token, a rare separator, many distinct tokens, and a true bigram
// chain (each token is followed by at most 16 distinct tokens, except after the separator, where a
// fresh document starts) whose conditional entropy is a few nats.
TEST(SyntheticBigramCorpus, LooksLikeTokenizedText) {
  const int64_t vocab = 8192, n = 400000;
  auto tokens = synthetic_bigram_corpus(vocab, n, 1234);
  std::vector<int64_t> count(size_t(vocab), 0);
  for (uint16_t t : tokens) count[t]++;
  const double max_share = double(*std::max_element(count.begin() + 1, count.end())) / double(n);
  EXPECT_LT(max_share, 0.05) << "a dominant token";
  EXPECT_GT(max_share, 0.002) << "the head should be Zipf-like, not flat";
  EXPECT_LT(double(count[0]) / double(n), 0.01) << "separator share";
  EXPECT_GT(count[0], 0) << "400k tokens span several documents";
  int64_t distinct = std::count_if(count.begin(), count.end(), [](int64_t c) { return c > 0; });
  EXPECT_GT(distinct, 2000) << "distinct tokens";

  std::map<int, std::set<int>> next;
  std::map<std::pair<int, int>, double> pair_count;
  std::vector<double> prev_count(size_t(vocab), 0);
  for (size_t i = 1; i < tokens.size(); ++i) {
    if (tokens[i] == 0 || tokens[i - 1] == 0) continue;  // document boundaries
    next[tokens[i - 1]].insert(tokens[i]);
    pair_count[{tokens[i - 1], tokens[i]}] += 1;
    prev_count[tokens[i - 1]] += 1;
  }
  size_t most = 0;
  for (const auto& [t, s] : next) most = std::max(most, s.size());
  EXPECT_LE(most, 16u) << "a token has more than 16 distinct successors: not the bigram chain";
  EXPECT_GE(most, 8u);
  double h = 0, m = 0;
  for (const auto& [pair, cnt] : pair_count) m += cnt;
  for (const auto& [pair, cnt] : pair_count) h -= cnt / m * std::log(cnt / prev_count[size_t(pair.first)]);
  // The true conditional entropy is 2.36 nats; repeated successors and sampling pull the empirical one a little lower.
  EXPECT_GT(h, 1.5) << "conditional entropy";
  EXPECT_LT(h, 2.6) << "conditional entropy";
}

TEST(DataLoader, TargetsAreShiftedInputs) {
  std::vector<uint16_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = uint16_t(i % 97);
  DataLoader dl(tokens, 97, 16, 0.1, 5, "test");
  Batch b = dl.next_train(4);
  ASSERT_EQ(b.inputs.shape(), (Shape{4, 16}));
  auto in = ints(b.inputs), tg = ints(b.targets);
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(tg[i], (in[i] + 1) % 97) << "element " << i;
}

// Tokens are their own positions (mod 2^16), so every window names where it came from.
TEST(DataLoader, EpochVisitsEveryWindowOnceAndValIsHeldOut) {
  const int64_t n = 4000, seq = 32;
  std::vector<uint16_t> tokens(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tokens[size_t(i)] = uint16_t(i);
  DataLoader dl(tokens, 65536, seq, 0.25, 11, "positions");
  const int64_t train_end = n - int64_t(double(n) * 0.25);
  EXPECT_EQ(dl.num_train_windows(), (train_end - 1) / seq);
  std::set<int64_t> starts;
  for (int64_t i = 0; i < dl.num_train_windows(); ++i) {
    auto in = ints(dl.next_train(1).inputs), tg = ints(dl.next_train(0).inputs);
    EXPECT_EQ(in[0] % seq, 0) << "windows start on a multiple of seq_len";
    EXPECT_LE(in[0] + seq, train_end - 1) << "a training target reaches into the validation split";
    EXPECT_TRUE(starts.insert(in[0]).second) << "window " << in[0] << " twice in one epoch";
  }
  EXPECT_EQ(dl.position().epoch, 0u);
  dl.next_train(1);
  EXPECT_EQ(dl.position().epoch, 1u);
  EXPECT_EQ(dl.position().cursor, 1u);
  for (int64_t b = 0; b < dl.num_val_windows() + 2; ++b) {
    auto in = ints(dl.val_batch(b, 1).inputs);
    EXPECT_GE(in[0], train_end) << "validation batch " << b << " overlaps training data";
  }
}

// Each epoch reads every window once in an order of its own: epoch 1 does not repeat epoch 0's.
TEST(DataLoader, EachEpochShufflesAnew) {
  const int64_t n = 4000, seq = 32;
  std::vector<uint16_t> tokens(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tokens[size_t(i)] = uint16_t(i);
  DataLoader dl(tokens, 65536, seq, 0.0, 11, "positions");
  std::vector<int64_t> order[2];
  for (std::vector<int64_t>& o : order) {
    for (int64_t i = 0; i < dl.num_train_windows(); ++i) o.push_back(ints(dl.next_train(1).inputs)[0] / seq);
    std::vector<int64_t> sorted = o;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < dl.num_train_windows(); ++i) ASSERT_EQ(sorted[size_t(i)], i) << "not every window once";
  }
  EXPECT_EQ(dl.position().epoch, 1u);
  EXPECT_NE(order[0], order[1]) << "epoch 1 repeats epoch 0's order";
}

// A batch's parts (data-parallel ranks) are its slices: part p of P reads sequences [p B / P, (p + 1) B / P) of
// the batch one process reads, every part advancing the position by the whole batch; the same for validation.
TEST(DataLoader, PartsOfABatchAreItsSlices) {
  const int64_t n = 4000, seq = 16;
  std::vector<uint16_t> tokens(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) tokens[size_t(i)] = uint16_t(i);
  for (const auto& [batch, parts] : {std::pair<int64_t, int64_t>{8, 2}, {7, 3}, {4, 4}}) {
    SCOPED_TRACE(std::to_string(batch) + " sequences in " + std::to_string(parts) + " parts");
    DataLoader whole(tokens, 65536, seq, 0.1, 3, "positions");
    std::vector<DataLoader> part(size_t(parts), whole);
    for (int step = 0; step < 3; ++step) {
      const std::vector<int64_t> want = ints(whole.next_train(batch).inputs),
                                 want_val = ints(whole.val_batch(step, batch).inputs);
      std::vector<int64_t> got, got_val;
      for (int64_t p = 0; p < parts; ++p) {
        const std::vector<int64_t> rows = ints(part[size_t(p)].next_train(batch, p, parts).inputs);
        EXPECT_EQ(int64_t(rows.size()), ((p + 1) * batch / parts - p * batch / parts) * seq) << "part " << p;
        got.insert(got.end(), rows.begin(), rows.end());
        const std::vector<int64_t> val = ints(part[size_t(p)].val_batch(step, batch, p, parts).inputs);
        got_val.insert(got_val.end(), val.begin(), val.end());
      }
      EXPECT_EQ(got, want) << "step " << step;
      EXPECT_EQ(got_val, want_val) << "validation batch " << step;
    }
  }
}

TEST(DataLoader, OrderDependsOnlyOnSeed) {
  auto tokens = synthetic_corpus(64, 20000, 3);
  auto run = [&](uint64_t seed) {
    DataLoader dl(tokens, 64, 24, 0.1, seed, "s");
    std::vector<int64_t> all;
    for (int i = 0; i < 50; ++i) {  // crosses several epochs
      auto v = ints(dl.next_train(8).inputs);
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  EXPECT_EQ(run(1), run(1));
  EXPECT_NE(run(1), run(2));
}

TEST(DataLoader, PositionRestoresTheSameBatches) {
  auto tokens = synthetic_corpus(64, 8000, 3);
  DataLoader a(tokens, 64, 20, 0.1, 9, "s");
  for (int i = 0; i < 130; ++i) a.next_train(3);  // into the second epoch (359 windows)
  DataPosition pos = a.position();
  EXPECT_GE(pos.epoch, 1u);
  DataLoader b(tokens, 64, 20, 0.1, 9, "s");
  b.set_position(pos);
  for (int i = 0; i < 40; ++i) {
    Batch x = a.next_train(3), y = b.next_train(3);
    ASSERT_EQ(ints(x.inputs), ints(y.inputs)) << "batch " << i << " after restore";
    ASSERT_EQ(ints(x.targets), ints(y.targets));
  }
  DataPosition bad = pos;
  bad.cursor = uint64_t(a.num_train_windows()) + 1;
  EXPECT_THROW(b.set_position(bad), IoError);
}

TEST(DataLoader, RejectsBadCorpora) {
  std::vector<uint16_t> tokens(500, 3);
  tokens[123] = 300;
  try {
    DataLoader dl(tokens, 256, 16, 0.1, 1, "corpus.bin");
    FAIL() << "no error";
  } catch (const IoError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("corpus.bin"), std::string::npos) << m;
    EXPECT_NE(m.find("token 300 at position 123"), std::string::npos) << m;
  }
  EXPECT_THROW(DataLoader(std::vector<uint16_t>(10, 1), 256, 16, 0.0, 1, "short"), IoError);
  EXPECT_THROW(DataLoader(std::vector<uint16_t>(100, 1), 256, 16, 0.05, 1, "no val"), IoError);
  EXPECT_NO_THROW(DataLoader(std::vector<uint16_t>(100, 1), 256, 16, 0.0, 1, "no val needed"));
}

TEST(DataLoader, FromConfigReadsEachSource) {
  fs::path d = temp_dir("sources");
  std::string text;
  for (int i = 0; i < 300; ++i) text += "the quick brown fox " + std::to_string(i) + "\n";
  std::ofstream(d / "c.txt") << text;
  std::string bin = (d / "c.bin").string();
  prepare_token_file({(d / "c.txt").string()}, bin);

  Config cfg = parse_config("data:\n  seq_len: 64\n", "t.yaml");
  cfg.data.source = DataSource::text;
  cfg.data.path = (d / "c.txt").string();
  DataLoader from_text = DataLoader::from_config(cfg);
  cfg.data.source = DataSource::tokens;
  cfg.data.path = bin;
  DataLoader from_tokens = DataLoader::from_config(cfg);
  EXPECT_EQ(from_text.num_tokens(), int64_t(text.size()));
  EXPECT_EQ(ints(from_text.next_train(4).inputs), ints(from_tokens.next_train(4).inputs));
  cfg.data.source = DataSource::synthetic;
  cfg.data.path.clear();
  DataLoader words = DataLoader::from_config(cfg);
  EXPECT_EQ(words.num_tokens(), cfg.data.synthetic_tokens);
  cfg.data.synthetic_kind = SyntheticKind::bigram;
  DataLoader bigram = DataLoader::from_config(cfg);
  EXPECT_EQ(bigram.num_tokens(), cfg.data.synthetic_tokens);
  EXPECT_NE(ints(words.next_train(4).inputs), ints(bigram.next_train(4).inputs));
  cfg.data.synthetic_tokens = 100;  // the corpus is named in the loader's messages
  EXPECT_TRUE(test::throws_naming<IoError>([&] { DataLoader::from_config(cfg); }, {"synthetic corpus (bigram)"}));
  fs::remove_all(d);
}
