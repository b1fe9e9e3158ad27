// flowmoe's byte-level BPE as a tokenizers tokenizer.json and back (dataset/hf_tokenizer.h). That the
// tokenizers package encodes text with it as flowmoe does is checked by tests/interop/check_hf_export.py.
#include <gtest/gtest.h>

#include <regex>

#include "dataset/hf_tokenizer.h"
#include "io/json.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

const char* kText =
    "The quick brown fox jumps over 12 lazy dogs, again and again!  Naïve café owners   count 3.14159 coins\n\n"
    "\tthen sleep... Über-fast résumé writing (2024) isn't hard: x = y + 42; the the the quick quick brown";

BpeTokenizer trained(int64_t vocab) {
  BpeWordCounts words;
  for (int i = 0; i < 4; ++i) words.add_text(kText);
  return BpeTokenizer::train(words, vocab);
}

}  // namespace

TEST(HfTokenizer, JsonRoundTripGivesTheSameTokenizer) {
  for (int64_t vocab : {300, 330}) {
    BpeTokenizer bpe = trained(vocab);
    const std::string json = hf_tokenizer_json(bpe);
    HfTokenizerInfo info = read_hf_tokenizer(json, "tokenizer.json");
    ASSERT_TRUE(info.flowmoe_form) << info.why_not;
    EXPECT_EQ(info.vocab_size, bpe.vocab_size());
    EXPECT_EQ(info.bpe.merges(), bpe.merges());
    EXPECT_EQ(info.bpe.encode(kText), bpe.encode(kText));
    EXPECT_EQ(hf_tokenizer_json(info.bpe), json);
  }
  HfTokenizerInfo bytes = read_hf_tokenizer(hf_tokenizer_json(BpeTokenizer()), "tokenizer.json");
  EXPECT_TRUE(bytes.flowmoe_form);
  EXPECT_EQ(bytes.vocab_size, 256);
}

// Byte 32 (space) is GPT-2's "Ġ", byte 10 "Ċ", a printable byte itself; a merge is "left right" of those.
TEST(HfTokenizer, VocabUsesGpt2ByteCharacters) {
  const BpeTokenizer bpe(std::vector<BpeTokenizer::Merge>{{' ', 't'}, {256, 'h'}});
  const YAML::Node j = parse_json(hf_tokenizer_json(bpe), "tokenizer.json");
  EXPECT_EQ(j["model"]["vocab"]["\xC4\xA0"].as<int>(), 32);  // Ġ
  EXPECT_EQ(j["model"]["vocab"]["\xC4\x8A"].as<int>(), 10);  // Ċ
  EXPECT_EQ(j["model"]["vocab"]["a"].as<int>(), 'a');
  EXPECT_EQ(j["model"]["vocab"]["\xC4\xA0th"].as<int>(), 257);
  EXPECT_EQ(j["model"]["merges"][1].as<std::string>(), "\xC4\xA0t h");
  EXPECT_EQ(j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].as<std::string>(), kHfWordPattern);
}

TEST(HfTokenizer, OtherTokenizersAreReadForTheirVocabOnly) {
  const std::string json = hf_tokenizer_json(trained(300));
  const auto why_not = [](const std::string& text) { return read_hf_tokenizer(text, "t.json").why_not; };
  EXPECT_EQ(
      why_not(std::regex_replace(json, std::regex("\"normalizer\": null"), "\"normalizer\": {\"type\": \"NFC\"}")),
      "it has a normalizer");
  EXPECT_EQ(why_not(std::regex_replace(json, std::regex("\"type\": \"BPE\""), "\"type\": \"WordPiece\"")),
            "its model is WordPiece, not BPE");
  EXPECT_EQ(why_not(std::regex_replace(json, std::regex("\"type\": \"Split\""), "\"type\": \"Whitespace\"")),
            "its pre-tokenizer is not flowmoe's word split");
  const HfTokenizerInfo added = read_hf_tokenizer(
      std::regex_replace(json, std::regex("\"added_tokens\": \\[\\]"),
                         "\"added_tokens\": [{\"id\": 400, \"content\": \"<eos>\", \"special\": true}]"),
      "t.json");
  EXPECT_FALSE(added.flowmoe_form);
  EXPECT_EQ(added.vocab_size, 401);  // an added token counts: its id indexes the embedding too
  EXPECT_TRUE(throws_naming<IoError>([] { read_hf_tokenizer("{\"version\": \"1.0\"}", "t.json"); },
                                     {"'t.json' is not a tokenizers file"}));
}
