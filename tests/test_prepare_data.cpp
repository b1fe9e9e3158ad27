// flowmoe prepare-data: the order it reads its inputs in, what it skips and says, and the outputs it
// refuses before reading anything: one of its inputs under any spelling (compared by device and
// inode), a directory, a device or FIFO, and the files its tokenizer would overwrite; no PATH.tmp
// stays behind.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "dataset/data.h"
#include "kernels/common/error.h"
#include "tests/support/checks.h"

using namespace flowmoe;
namespace fs = std::filesystem;

namespace {

fs::path temp_dir(const std::string& name) {
  fs::path d = fs::temp_directory_path() / ("flowmoe_test_prepare_" + name);
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// The ConfigError prepare_token_file raises, or "" (with a failure) when it raises none.
std::string refusal(const std::vector<std::string>& inputs, const std::string& output,
                    const PrepareOptions& opts = {}) {
  try {
    prepare_token_file(inputs, output, nullptr, opts);
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "prepare-data wrote '" << output << "' without a ConfigError";
  return "";
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace

// A directory is read at every depth, in byte order of the path below it; binary files and the
// output file (when it lies inside) are skipped, and the summary says what was read and skipped.
TEST(PrepareData, RecursesInOrderSkippingBinaryFilesAndTheOutput) {
  fs::path d = temp_dir("recurse");
  const fs::path in = d / "corpus";
  fs::create_directories(in / "a" / "sub");
  std::ofstream(in / "b.txt") << "B";
  std::ofstream(in / "a" / "z.txt") << "AZ";
  std::ofstream(in / "a.txt") << "A.";
  std::ofstream(in / "a" / "sub" / "deep.txt") << "D";
  std::ofstream(in / "empty.txt") << "";
  std::ofstream(in / "img.png", std::ios::binary) << std::string("\x89PNG\0\0", 6) << "rest";
  std::string late(9000, 'n');  // a NUL past the first 8 KiB does not make a file binary
  late += '\0';
  std::ofstream(in / "late_nul.txt", std::ios::binary) << late;
  const std::string out = (in / "tokens.bin").string();  // the output inside the input directory

  std::vector<uint16_t> want;
  for (char c : std::string("A.DAZB") + late) want.push_back(uint16_t(static_cast<unsigned char>(c)));
  const std::vector<std::string> order = {"a.txt", "a/sub/deep.txt", "a/z.txt", "b.txt", "empty.txt", "late_nul.txt"};
  for (int run = 0; run < 2; ++run) {  // the second run finds its earlier output in the directory
    PreparedInputs read;
    EXPECT_EQ(prepare_token_file({in.string()}, out, &read), int64_t(want.size()));
    EXPECT_EQ(read_token_file(out), want) << "run " << run;
    ASSERT_EQ(read.files.size(), order.size());
    for (size_t i = 0; i < order.size(); ++i)
      EXPECT_EQ(fs::path(read.files[i].path).lexically_relative(in).generic_string(), order[i]);
    EXPECT_EQ(read.files[5].bytes, int64_t(late.size()));
    EXPECT_EQ(read.skipped_binary, std::vector<std::string>{(in / "img.png").string()});
    EXPECT_EQ(read.summary(), "read 6 files (9.0 kB), skipped 1 binary file: " + (in / "img.png").string());
  }
  // A file named on its own is read whatever it holds; a directory with only binary files is an error.
  PreparedInputs read;
  EXPECT_EQ(prepare_token_file({(in / "img.png").string()}, (d / "png.bin").string(), &read), 10);
  EXPECT_EQ(read.summary(), "read 1 file (10 bytes)");
  fs::create_directories(d / "bin_only");
  std::ofstream(d / "bin_only" / "x.bin", std::ios::binary) << std::string(3, '\0');
  EXPECT_TRUE(test::throws_naming<IoError>([&] { prepare_token_file({(d / "bin_only").string()}, out); },
                                           {"holds no text files (1 binary file skipped)"}));
  fs::remove_all(d);
}

TEST(PrepareData, SummaryNamesSizesAndSkippedFiles) {
  PreparedInputs r;
  for (char i = 0; i < 12; ++i) r.files.push_back({std::string{'f', char('a' + i)}, 283334});
  for (char i = 0; i < 13; ++i) r.skipped_binary.push_back(std::string{'b', char('0' + i)});
  EXPECT_EQ(r.bytes(), 3400008);
  EXPECT_EQ(r.summary(),
            "read 12 files (3.4 MB), skipped 13 binary files: b0, b1, b2, b3, b4, b5, b6, b7, b8, b9 "
            "and 3 more");
}

TEST(PrepareData, BytesOfFilesInOrder) {
  fs::path d = temp_dir("prepare");
  fs::create_directories(d / "dir");
  std::ofstream(d / "a.txt") << "hi\n";
  std::ofstream(d / "dir" / "2.txt") << "yz";
  std::ofstream(d / "dir" / "1.txt") << "x\xff";  // sorted by name: 1.txt before 2.txt
  std::string out = (d / "out.bin").string();
  int64_t n = prepare_token_file({(d / "a.txt").string(), (d / "dir").string()}, out);
  std::vector<uint16_t> want = {'h', 'i', '\n', 'x', 255, 'y', 'z'};
  EXPECT_EQ(n, int64_t(want.size()));
  EXPECT_EQ(read_token_file(out), want);
  EXPECT_THROW(prepare_token_file({(d / "nope.txt").string()}, out), IoError);
  fs::remove_all(d);
}

// An output that is one of the inputs would be read, then replaced by its tokens: refused before
// anything is read or written, whatever path names it; the input is left as it was.
TEST(PrepareData, RefusesAnOutputThatIsAnInputUnderAnySpelling) {
  const fs::path d = temp_dir("same_file");
  const fs::path a = d / "a.txt";
  std::ofstream(a) << "the text";
  fs::create_symlink(a, d / "link.txt");
  fs::create_hard_link(a, d / "hard.txt");
  const std::string input = a.string();
  EXPECT_EQ(refusal({input}, input), "prepare-data: --output '" + input + "' is the input '" + input +
                                         "': writing it would overwrite what is read; name another file to write");
  for (const fs::path& spelling : {d / "." / "a.txt", d / "link.txt", d / "hard.txt"}) {
    const std::string m = refusal({input}, spelling.string());
    EXPECT_TRUE(has(m, "--output '" + spelling.string() + "' is the input '" + input + "' (the same file)")) << m;
  }
  // The other way round: the input named through the link, the output by its own name.
  EXPECT_TRUE(has(refusal({(d / "hard.txt").string()}, input), "is the input '" + (d / "hard.txt").string() + "'"));
  EXPECT_TRUE(read_text(a) == "the text") << "overwritten";
  for (const char* tmp : {"a.txt.tmp", "link.txt.tmp", "hard.txt.tmp"}) EXPECT_FALSE(fs::exists(d / tmp)) << tmp;
  fs::remove_all(d);
}

// A file an input directory would read, reached under another path (a hard link), is refused unless
// --exclude leaves it out; the output's own path inside the directory is skipped as before.
TEST(PrepareData, RefusesAnOutputThatAnInputDirectoryWouldRead) {
  const fs::path d = temp_dir("in_dir");
  fs::create_directories(d / "corpus");
  std::ofstream(d / "corpus" / "b.txt") << "b";
  std::ofstream(d / "corpus" / "c.txt") << "c";
  const fs::path out = d / "out.bin";
  fs::create_hard_link(d / "corpus" / "c.txt", out);
  const std::string m = refusal({(d / "corpus").string()}, out.string());
  EXPECT_TRUE(has(m, "is also '" + (d / "corpus" / "c.txt").string() + "' in the input directory")) << m;
  EXPECT_TRUE(read_text(out) == "c") << "overwritten";
  PrepareOptions opts;
  opts.exclude = {"c.txt"};
  EXPECT_EQ(prepare_token_file({(d / "corpus").string()}, out.string(), nullptr, opts), 1);
  EXPECT_EQ(read_token_file(out.string()), std::vector<uint16_t>{'b'});
  // The rename replaced the link, not the file.
  EXPECT_TRUE(read_text(d / "corpus" / "c.txt") == "c") << "overwritten";
  fs::remove_all(d);
}

// The tokenizer prepare-data reads (--tokenizer) or writes beside the output (--bpe-vocab) must not
// be an input or the output either.
TEST(PrepareData, RefusesToOverwriteTheTokenizerItReadsOrAnInputWithTheOneItWrites) {
  const fs::path d = temp_dir("tokenizer");
  std::ofstream(d / "a.txt") << "aa bb aa bb aa bb";
  std::ofstream(d / "books.bpe") << "a text file that happens to share the tokenizer's name";
  PrepareOptions opts;
  opts.bpe_vocab = 260;
  std::string m = refusal({(d / "a.txt").string(), (d / "books.bpe").string()}, (d / "books.bin").string(), opts);
  EXPECT_TRUE(has(m, "the tokenizer file '" + (d / "books.bpe").string() +
                         "' (--bpe-vocab writes it beside --output) is the input '" + (d / "books.bpe").string() + "'"))
      << m;
  EXPECT_FALSE(fs::exists(d / "books.bin"));
  opts = {};
  opts.tokenizer = (d / "books.bpe").string();
  m = refusal({(d / "a.txt").string()}, opts.tokenizer, opts);
  EXPECT_TRUE(has(m, "is the --tokenizer file")) << m;
  EXPECT_TRUE(read_text(d / "books.bpe") == "a text file that happens to share the tokenizer's name") << "overwritten";
  fs::remove_all(d);
}

// An output that is a directory is refused up front, naming it; a write that fails at the rename
// anyway (write_token_file called directly) removes its PATH.tmp.
TEST(PrepareData, RefusesADirectoryOutputAndLeavesNoTempFile) {
  const fs::path d = temp_dir("dir_out");
  std::ofstream(d / "a.txt") << "abc";
  fs::create_directories(d / "out");
  const std::string out = (d / "out").string();
  EXPECT_EQ(refusal({(d / "a.txt").string()}, out), "prepare-data: --output '" + out +
                                                        "' is a directory; name a file to write, e.g. '" +
                                                        (d / "out" / "tokens.bin").string() + "'");
  EXPECT_FALSE(fs::exists(out + ".tmp"));
  EXPECT_TRUE(test::throws_naming<IoError>([&] { write_token_file(out, {1, 2}); }, {"renaming", "out.tmp"}));
  EXPECT_FALSE(fs::exists(out + ".tmp"));
  EXPECT_TRUE(fs::is_directory(out));
  fs::create_directories(d / "books.bpe");  // where --bpe-vocab would save the tokenizer
  PrepareOptions opts;
  opts.bpe_vocab = 260;
  const std::string m = refusal({(d / "a.txt").string()}, (d / "books.bin").string(), opts);
  EXPECT_TRUE(has(m, "'" + (d / "books.bpe").string() + "' (--bpe-vocab writes it beside --output) is a directory"))
      << m;
  EXPECT_FALSE(fs::exists(d / "books.bin"));
  fs::remove_all(d);
}

// A device or a FIFO is not replaced by the token file: the rename would put a regular file in the
// node's place (as root, /dev/null itself; here a link to it, which the rename would replace) and a
// FIFO's reader would get nothing. Refused before anything is read, the node left in place; also the
// PATH.tmp the token file is written to first.
TEST(PrepareData, RefusesADeviceOrAFifoOutputAndLeavesItInPlace) {
  const fs::path d = temp_dir("nodes");
  std::ofstream(d / "a.txt") << "abc";
  const std::string input = (d / "a.txt").string();
  const fs::path fifo = d / "fifo.bin", null_link = d / "null.bin";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  fs::create_symlink("/dev/null", null_link);
  EXPECT_EQ(refusal({input}, fifo.string()), "prepare-data: --output '" + fifo.string() +
                                                 "' is a FIFO, not a regular file; name a regular file to write");
  EXPECT_EQ(refusal({input}, null_link.string()),
            "prepare-data: --output '" + null_link.string() +
                "' is a character device, not a regular file; name a regular file to write");
  ASSERT_EQ(::mkfifo((d / "out.bin.tmp").c_str(), 0644), 0);
  EXPECT_EQ(refusal({input}, (d / "out.bin").string()),
            "prepare-data: '" + (d / "out.bin.tmp").string() + "' (written first, then renamed to '" +
                (d / "out.bin").string() + "') is a FIFO, not a regular file; name a regular file to write");
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_TRUE(fs::is_symlink(null_link));
  EXPECT_FALSE(fs::exists(d / "fifo.bin.tmp"));
  EXPECT_FALSE(fs::exists(d / "null.bin.tmp"));
  EXPECT_FALSE(fs::exists(d / "out.bin"));
  fs::remove_all(d);
}

// The command: exit status 2 and one line naming the file, the input untouched, no .tmp.
TEST(PrepareData, TheCommandRefusesWithAUsageError) {
  const fs::path d = temp_dir("cli");
  std::ofstream(d / "a.txt") << "keep me";
  fs::create_directories(d / "out");
  int code = -1;
  std::string err;
  auto run = [&](const std::string& args) {
    const std::string cmd =
        "cd '" + d.string() + "' && " + FLOWMOE_BINARY_DIR + "/flowmoe prepare-data " + args + " >/dev/null 2>err.txt";
    const int status = std::system(cmd.c_str());
    code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    err = read_text(d / "err.txt");
  };
  run("--output a.txt a.txt");
  EXPECT_EQ(code, 2);
  EXPECT_EQ(err,
            "flowmoe: error: prepare-data: --output 'a.txt' is the input 'a.txt': writing it would overwrite what "
            "is read; name another file to write\n");
  run("--output ./a.txt a.txt");
  EXPECT_EQ(code, 2);
  EXPECT_TRUE(has(err, "--output './a.txt' is the input 'a.txt' (the same file)")) << err;
  run("--output out a.txt");
  EXPECT_EQ(code, 2);
  EXPECT_TRUE(has(err, "--output 'out' is a directory")) << err;
  EXPECT_TRUE(read_text(d / "a.txt") == "keep me") << "overwritten";
  EXPECT_FALSE(fs::exists(d / "a.txt.tmp"));
  EXPECT_FALSE(fs::exists(d / "out.tmp"));
  fs::remove_all(d);
}
