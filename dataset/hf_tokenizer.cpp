// tokenizer.json for flowmoe's byte-level BPE, written and read back (see hf_tokenizer.h).
#include "dataset/hf_tokenizer.h"

#include <array>
#include <map>
#include <sstream>

#include "io/file_io.h"
#include "io/json.h"
#include "kernels/common/error.h"

namespace flowmoe {

namespace {

// GPT-2's bytes_to_unicode, which ByteLevel applies: the printable bytes stand for themselves, the others
// (space, controls, ...) for the characters from U+0100 on, in byte order. As UTF-8.
std::array<std::string, 256> byte_chars() {
  std::array<std::string, 256> out;
  int next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const int cp = printable ? b : next++;
    std::string s;
    if (cp < 0x80) {
      s += char(cp);
    } else {  // below 0x800: two bytes
      s += char(0xC0 | (cp >> 6));
      s += char(0x80 | (cp & 0x3F));
    }
    out[size_t(b)] = s;
  }
  return out;
}

const std::array<std::string, 256>& mapped_bytes() {
  static const std::array<std::string, 256> table = byte_chars();
  return table;
}

std::string mapped(const std::string& bytes) {
  std::string s;
  for (unsigned char b : bytes) s += mapped_bytes()[b];
  return s;
}

// Every token's mapped string, by id.
std::vector<std::string> token_strings(const BpeTokenizer& bpe) {
  std::vector<std::string> out;
  for (int64_t t = 0; t < bpe.vocab_size(); ++t) out.push_back(mapped(bpe.decode({uint16_t(t)})));
  return out;
}

std::string pre_tokenizer_json() {
  return std::string("{\"type\": \"Sequence\", \"pretokenizers\": [") +
         "{\"type\": \"Split\", \"pattern\": {\"Regex\": " + json_escape(kHfWordPattern) +
         "}, \"behavior\": \"Isolated\", \"invert\": false}, "
         "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, \"use_regex\": false}]}";
}

}  // namespace

std::string hf_tokenizer_json(const BpeTokenizer& bpe) {
  const std::vector<std::string> tokens = token_strings(bpe);
  std::map<std::string, int64_t> seen;
  for (int64_t t = 0; t < int64_t(tokens.size()); ++t) {
    const auto [it, fresh] = seen.emplace(tokens[size_t(t)], t);
    FLOWMOE_CHECK(fresh, Error, "the BPE tokenizer's tokens ", it->second, " and ", t, " are the same bytes ",
                  json_escape(bpe.decode({uint16_t(t)})),
                  " (made by different merges): a Hugging Face tokenizer's vocab gives each string one id");
  }
  std::ostringstream j;
  j << "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n  \"added_tokens\": [],\n"
    << "  \"normalizer\": null,\n  \"pre_tokenizer\": " << pre_tokenizer_json() << ",\n  \"post_processor\": null,\n"
    << "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, "
       "\"use_regex\": false},\n"
    << "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": null,\n"
    << "    \"continuing_subword_prefix\": null,\n    \"end_of_word_suffix\": null,\n    \"fuse_unk\": false,\n"
    << "    \"byte_fallback\": false,\n    \"ignore_merges\": false,\n    \"vocab\": {";
  for (size_t t = 0; t < tokens.size(); ++t) j << (t ? ", " : "") << json_escape(tokens[t]) << ": " << t;
  j << "},\n    \"merges\": [";
  for (size_t i = 0; i < bpe.merges().size(); ++i) {
    const BpeTokenizer::Merge& m = bpe.merges()[i];
    j << (i ? ", " : "") << json_escape(tokens[m.left] + " " + tokens[m.right]);
  }
  j << "]\n  }\n}\n";
  return j.str();
}

std::string hf_tokenizer_config_json(int64_t model_max_length) {
  return "{\n  \"tokenizer_class\": \"PreTrainedTokenizerFast\",\n  \"model_max_length\": " +
         std::to_string(model_max_length) +
         ",\n  \"clean_up_tokenization_spaces\": false,\n  \"add_bos_token\": false,\n  \"add_eos_token\": false,\n"
         "  \"added_tokens_decoder\": {}\n}\n";
}

namespace {

bool is_null(const YAML::Node& n) { return !n || n.IsNull(); }

// Why the parsed file is not hf_tokenizer_json's form, or "" when it is; fills bpe then.
std::string flowmoe_bpe_of(const YAML::Node& j, const std::map<std::string, int64_t>& vocab, BpeTokenizer* bpe) {
  if (!is_null(j["normalizer"])) return "it has a normalizer";
  if (j["added_tokens"] && j["added_tokens"].size() > 0) return "it has added tokens";
  const YAML::Node pre = j["pre_tokenizer"];
  if (is_null(pre) || !pre.IsMap() || pre["type"].as<std::string>("") != "Sequence" || !pre["pretokenizers"] ||
      pre["pretokenizers"].size() != 2 || pre["pretokenizers"][0]["type"].as<std::string>("") != "Split" ||
      pre["pretokenizers"][0]["pattern"]["Regex"].as<std::string>("") != kHfWordPattern ||
      pre["pretokenizers"][1]["type"].as<std::string>("") != "ByteLevel" ||
      pre["pretokenizers"][1]["use_regex"].as<std::string>("") != "false")
    return "its pre-tokenizer is not flowmoe's word split";
  for (int64_t b = 0; b < kBpeByteTokens; ++b) {
    const auto it = vocab.find(mapped_bytes()[size_t(b)]);
    if (it == vocab.end() || it->second != b) return "token " + std::to_string(b) + " is not byte " + std::to_string(b);
  }
  const YAML::Node merges = j["model"]["merges"];
  std::vector<BpeTokenizer::Merge> out;
  for (size_t i = 0; merges && i < merges.size(); ++i) {
    std::string left, right;
    if (merges[i].IsSequence() && merges[i].size() == 2) {
      left = merges[i][0].as<std::string>();
      right = merges[i][1].as<std::string>();
    } else {
      const std::string pair = merges[i].as<std::string>("");
      const size_t space = pair.find(' ');
      if (space == std::string::npos) return "merge " + std::to_string(i) + " is not a pair";
      left = pair.substr(0, space);
      right = pair.substr(space + 1);
    }
    const auto l = vocab.find(left), r = vocab.find(right), made = vocab.find(left + right);
    if (l == vocab.end() || r == vocab.end() || made == vocab.end() || made->second != kBpeByteTokens + int64_t(i) ||
        l->second >= kBpeMaxVocab || r->second >= kBpeMaxVocab)
      return "merge " + std::to_string(i) + " does not make token " + std::to_string(kBpeByteTokens + int64_t(i));
    out.push_back({uint16_t(l->second), uint16_t(r->second)});
  }
  if (int64_t(vocab.size()) != kBpeByteTokens + int64_t(out.size())) return "it has tokens no merge makes";
  try {
    *bpe = BpeTokenizer(std::move(out));
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

HfTokenizerInfo read_hf_tokenizer(const std::string& json_text, const std::string& path) {
  const YAML::Node j = parse_json(json_text, "'" + path + "'");
  FLOWMOE_CHECK(j.IsMap() && j["model"] && j["model"].IsMap() && j["model"]["vocab"] && j["model"]["vocab"].IsMap(),
                IoError, "'", path, "' is not a tokenizers file (no model.vocab object)");
  HfTokenizerInfo info;
  std::map<std::string, int64_t> vocab;
  try {
    for (auto it = j["model"]["vocab"].begin(); it != j["model"]["vocab"].end(); ++it) {
      const int64_t id = it->second.as<int64_t>();
      vocab[it->first.as<std::string>()] = id;
      info.vocab_size = std::max(info.vocab_size, id + 1);
    }
    for (const YAML::Node& added : j["added_tokens"])
      info.vocab_size = std::max(info.vocab_size, added["id"].as<int64_t>() + 1);
  } catch (const YAML::Exception& e) {
    FLOWMOE_THROW(IoError, "'", path, "': malformed vocab (", e.msg, ")");
  }
  const std::string type = j["model"]["type"].as<std::string>("");
  info.why_not = type != "BPE" ? "its model is " + (type.empty() ? std::string("untyped") : type) + ", not BPE"
                               : flowmoe_bpe_of(j, vocab, &info.bpe);
  info.flowmoe_form = info.why_not.empty();
  return info;
}

}  // namespace flowmoe
