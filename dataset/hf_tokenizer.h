// flowmoe's byte-level BPE (dataset/bpe.h) as a Hugging Face tokenizers tokenizer.json, and back.
//
// The form: no normalizer; a pre-tokenizer that splits words exactly as bpe_words does (a Split on
// kHfWordPattern, then ByteLevel without its own regex, which maps each byte to GPT-2's printable
// character); a BPE model whose vocab gives token id i the mapped bytes of its piece (ids 0-255 the bytes
// themselves) and whose merges are flowmoe's, in rank order; the ByteLevel decoder. Encoding a text with
// it gives flowmoe's tokens (tests/interop/check_hf_export.py checks it against transformers' AutoTokenizer).
#pragma once
#include <cstdint>
#include <string>

#include "dataset/bpe.h"

namespace flowmoe {

constexpr const char* kHfTokenizerFile = "tokenizer.json";
constexpr const char* kHfTokenizerConfigFile = "tokenizer_config.json";
// bpe_words as an Oniguruma regex over characters (a UTF-8 character's bytes are all >= 0x80, letters there):
// an optional space and a run of letters, digits or other characters; a whitespace run that leaves its last
// space to the word after it; any other whitespace run.
constexpr const char* kHfWordPattern =
    " ?[A-Za-z\\x{80}-\\x{10FFFF}]+| ?[0-9]+| ?[^A-Za-z0-9 \\t\\n\\r\\x0B\\x0C\\x{80}-\\x{10FFFF}]+|"
    "[ \\t\\n\\r\\x0B\\x0C]+(?= [^ \\t\\n\\r\\x0B\\x0C])|[ \\t\\n\\r\\x0B\\x0C]+";

// tokenizer.json of `bpe`. Throws Error naming both tokens when two tokens have the same bytes (merges that
// meet in one string): a Hugging Face vocab maps each string to one id.
std::string hf_tokenizer_json(const BpeTokenizer& bpe);
// tokenizer_config.json: the fast tokenizer of tokenizer.json, no special tokens, model_max_length positions.
std::string hf_tokenizer_config_json(int64_t model_max_length);

// What a tokenizer.json holds, as far as flowmoe reads it.
struct HfTokenizerInfo {
  int64_t vocab_size = 0;  // the largest token id + 1, added tokens included
  bool flowmoe_form = false;
  std::string why_not;  // flowmoe_form false: what differs from hf_tokenizer_json's form
  BpeTokenizer bpe;     // flowmoe_form: the same tokenizer
};
// Reads tokenizer.json text (`path` names it in messages); IoError when it is not a tokenizers file.
HfTokenizerInfo read_hf_tokenizer(const std::string& json_text, const std::string& path);

}  // namespace flowmoe
