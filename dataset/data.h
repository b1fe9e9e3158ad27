// Training data: three token sources and a deterministic, resumable batch order.
//
// Sources: two built-in synthetic corpora (no download), the bytes of text files (byte-level tokens),
// and llm.c/nanoGPT-style token files: a 256 x int32 header (magic 20240520, version 1, token
// count), then the tokens as little-endian uint16. The tail val_fraction of the corpus is held out.
// Training windows of seq_len + 1 tokens tile the rest; each epoch visits them in a permutation
// drawn from (seed, epoch), so the order depends on the seed alone and a (epoch, cursor) pair is
// the whole data position a checkpoint needs.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "engine/tensor.h"

namespace flowmoe {

constexpr int32_t kTokenFileMagic = 20240520;
constexpr int32_t kTokenFileVersion = 1;
constexpr int64_t kTokenFileHeaderInts = 256;

// Token files. read throws IoError naming the file on a bad header or a truncated body.
std::vector<uint16_t> read_token_file(const std::string& path);
void write_token_file(const std::string& path, const std::vector<uint16_t>& tokens);  // temp file, then rename

// The bytes of a file, or of every regular file directly in a directory (sorted by name), one token
// each (data.source: text).
std::vector<uint16_t> read_text_tokens(const std::string& path);

// What prepare_token_file read and wrote: the files whose bytes it encoded, in that order, the files
// of its input directories it left out as binary or by an exclude pattern, and the tokens.
struct PreparedInputs {
  struct File {
    std::string path;
    int64_t bytes = 0;
  };
  std::vector<File> files;
  std::vector<std::string> skipped_binary;
  std::vector<std::string> excluded;
  int64_t vocab_size = 256;                     // of the tokens written
  std::string tokenizer;                        // the BPE tokenizer written or read; "" for byte-level tokens
  int64_t num_words = 0, num_unique_words = 0;  // of the corpus a BPE tokenizer was trained on

  int64_t bytes() const;
  // One line: "read 12 files (3.4 MB), skipped 2 binary files: data/a.bin, data/b.png; excluded
  // 1 file: data/translations/x.txt".
  std::string summary() const;
};

// prepare-data's choices beyond the inputs and the output.
struct PrepareOptions {
  // Glob patterns (fnmatch, where * also matches /) over the path of a file below an input
  // directory, relative to it; a file matches when its path or one of its folders' does.
  std::vector<std::string> exclude;
  int64_t bpe_vocab = 0;  // > 0: train a BPE tokenizer of this vocab on the inputs and encode with it
  std::string tokenizer;  // encode with this saved BPE tokenizer (dataset/bpe.h)
};

// Where prepare-data writes the BPE tokenizer of a token file: its path with the extension replaced
// by ".bpe" (data/books.bin -> data/books.bpe).
std::string bpe_tokenizer_path(const std::string& token_file);

// Why prepare-data must not write `output` (and the tokenizer --bpe-vocab writes beside it, and either's
// PATH.tmp), as one line, or "" when it may: output_file_problem's reasons (config/output_check.h: not a
// regular file, an input file or the --tokenizer file, in a run or checkpoint folder, no such folder), or
// a file an input directory would read under another path. Files are compared by device and inode, so
// "./x", a symlink and a hard link count as the file itself. The output's own path inside an input
// directory is allowed (the directory's reading skips it).
std::string prepare_output_problem(const std::vector<std::string>& inputs, const std::string& output,
                                   const PrepareOptions& opts = {});

// prepare-data: the tokens of the inputs, in order, written as one token file; byte-level, or BPE
// with opts.bpe_vocab (the tokenizer is saved at bpe_tokenizer_path(output)) or opts.tokenizer.
// Each file is encoded on its own, so no BPE word spans two files. A directory is read recursively,
// its files in byte order of their path below it ("a.txt" before "a/b.txt"); a file there with a
// NUL byte in its first 8 KiB is binary and skipped, and so are the output file, its tokenizer and
// the files opts.exclude matches. A file named as an input is read whatever it holds. Returns the
// number of tokens written; `read`, when given, receives what was read, skipped and written. Throws
// ConfigError with prepare_output_problem's line before reading anything when it names one.
int64_t prepare_token_file(const std::vector<std::string>& inputs, const std::string& output,
                           PreparedInputs* read = nullptr, const PrepareOptions& opts = {});

// A seeded "language": a few dozen words (3-8 random tokens each, separated by token 0) that follow
// each other by a sparse Markov chain. A bigram model already gets well under ln(vocab)/2, and
// attention can learn more (which word comes next depends on the previous word).
std::vector<uint16_t> synthetic_corpus(int64_t vocab_size, int64_t num_tokens, uint64_t seed);

// A seeded bigram chain with the token statistics of BPE-tokenized text: Zipf-Mandelbrot
// popularity (weight 1/(rank+10), no dominant token), 16 successors per token taken with
// probability ~ 1/(slot+1) (next-token entropy at most 2.36 nats, about 2.3 measured, so the loss
// falls smoothly toward it), documents of 1024+ tokens separated by token 0 (0.09% of tokens).
// For MoE load-balance and precision-parity studies; the words corpus above stays the default.
std::vector<uint16_t> synthetic_bigram_corpus(int64_t vocab_size, int64_t num_tokens, uint64_t seed);

struct DataPosition {
  uint64_t epoch = 0;   // passes over the training windows completed
  uint64_t cursor = 0;  // windows of this epoch already handed out
};

struct Batch {
  Tensor inputs;   // [batch, seq_len] i32 on the CPU
  Tensor targets;  // [batch, seq_len] i32: inputs shifted by one token
};

class DataLoader {
 public:
  // `name` stands for the corpus in messages. Throws IoError when a token is >= vocab_size or the
  // corpus is too short for one training (and, with val_fraction > 0, one validation) window.
  DataLoader(std::vector<uint16_t> tokens, int64_t vocab_size, int64_t seq_len, double val_fraction, uint64_t seed,
             std::string name);
  static DataLoader from_config(const Config& cfg);

  // Data parallelism: of each batch, part p of `parts` reads sequences [p*B/parts, (p+1)*B/parts);
  // the position advances by the whole batch, so it is the same on every rank and for any world size.
  Batch next_train(int64_t batch_size, int64_t part = 0, int64_t parts = 1);  // advances the position
  // Fixed windows, in order, wrapping; the same slicing.
  Batch val_batch(int64_t batch_idx, int64_t batch_size, int64_t part = 0, int64_t parts = 1) const;

  int64_t num_train_windows() const { return num_train_; }
  int64_t num_val_windows() const { return num_val_; }
  int64_t num_tokens() const { return int64_t(tokens_.size()); }
  int64_t seq_len() const { return seq_len_; }
  DataPosition position() const { return pos_; }
  void set_position(const DataPosition& pos);

 private:
  std::vector<uint16_t> tokens_;
  int64_t seq_len_;
  uint64_t seed_;
  int64_t train_end_ = 0;  // tokens [0, train_end_) train, the rest validate
  int64_t num_train_ = 0, num_val_ = 0;
  DataPosition pos_;
  std::vector<int64_t> order_;  // window indices of the current epoch

  void shuffle_epoch();
  Batch make_batch(const std::vector<int64_t>& starts) const;
};

}  // namespace flowmoe
