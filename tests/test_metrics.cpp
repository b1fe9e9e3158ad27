// The metrics file's writer as a run uses it: a write the OS refuses stops the run with the file and the
// reason (/dev/full refuses every write with ENOSPC, as a full disk does), a resume that cannot rewrite
// the earlier rows leaves them as they were, and a resume drops a last line the earlier run left torn,
// saying so, so that the file reads back (and plots) whole.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/common/error.h"
#include "tests/train_test_util.h"
#include "train/metrics.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

Config small_config(const fs::path& out_dir, const std::vector<std::string>& sets = {}) {
  Config c = parse_config(
      "model: {vocab_size: 64, hidden_size: 32, num_hidden_layers: 2, num_attention_heads: 2,"
      " intermediate_size: 64, max_position_embeddings: 16}\n"
      "data: {seq_len: 16, synthetic_tokens: 20000, val_fraction: 0.1}\n"
      "train: {device: cpu, steps: 4, batch_size: 4, eval_every: 0}\n"
      "optimizer: {warmup_steps: 1}\n"
      "checkpoint: {every: 2}\n"
      "logging: {progress: plain, log_every: 1}\n",
      "small_test.yaml", sets);
  c.logging.out_dir = out_dir.string();
  return c;
}

StepMetrics row(int64_t step) {
  StepMetrics m;
  m.step = step;
  m.loss = 2.5;
  m.lr = 1e-3;
  return m;
}

void write_text(const fs::path& p, const std::string& text) { std::ofstream(p, std::ios::binary) << text; }

// What a run printed: its TrainOptions::out is a temporary file, read back here.
struct Captured {
  std::FILE* file = std::tmpfile();
  ~Captured() { std::fclose(file); }
  std::string text() const {
    std::fflush(file);
    std::rewind(file);
    std::string out;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, file)) > 0;) out.append(buf, n);
    return out;
  }
};

}  // namespace

TEST(MetricsWriter, AWriteTheOsRefusesThrowsNamingTheFileAndTheReason) {
  {
    MetricsWriter jsonl("/dev/full", "jsonl", -1);  // nothing is written before the first row
    try {
      jsonl.write(row(1));
      ADD_FAILURE() << "a row written to /dev/full went unnoticed";
    } catch (const IoError& e) {
      EXPECT_EQ(std::string(e.what()), "cannot write metrics file '/dev/full': No space left on device");
    }
  }
  try {
    MetricsWriter csv("/dev/full", "csv", -1);  // the header
    ADD_FAILURE() << "the CSV header written to /dev/full went unnoticed";
  } catch (const IoError& e) {
    EXPECT_EQ(std::string(e.what()), "cannot write metrics file '/dev/full': No space left on device");
  }
}

// A run whose metrics file cannot take its rows stops at the first one, instead of finishing with an
// empty file; the file is the run's own metrics.jsonl, here a link to /dev/full.
TEST(MetricsWriter, ARunStopsAtTheFirstRowItCannotWrite) {
  const fs::path d = fresh_dir("metrics_full");
  fs::create_directories(d / "run");
  fs::create_symlink("/dev/full", d / "run" / "metrics.jsonl");
  try {
    train(small_config(d / "run"), quiet());
    ADD_FAILURE() << "the run finished without its metrics";
  } catch (const IoError& e) {
    EXPECT_EQ(std::string(e.what()),
              "cannot write metrics file '" + (d / "run" / "metrics.jsonl").string() + "': No space left on device");
  }
  EXPECT_FALSE(fs::exists(d / "run" / "checkpoints" / "step_00000002")) << "the run went on past step 1";
  fs::remove_all(d);
}

// A torn last line, cut without its line end or ended but not a row, is dropped on resume with a note;
// the rows before it and the CSV header stay.
TEST(MetricsWriter, AResumeDropsATornLastLine) {
  const fs::path d = fresh_dir("metrics_torn");
  const std::string a = "{\"step\": 1, \"loss\": 2.5}\n", b = "{\"step\": 2, \"loss\": 2.4}\n";
  const std::string head =
      "step,loss,val_loss,lr,grad_norm,tokens_per_s,peak_mem_bytes,host_syncs,moe_casts,skipped,moe_max_over_mean,"
      "aux_loss,exchange_ms\n";
  const std::string c1 = "1,2.5,,0.001,1,10,0,0,,0,,,\n";
  const std::string unfinished = "unfinished (no line end)", unreadable = "unreadable (not a metrics row)";
  struct Case {
    std::string format, text, kept;
    int dropped_line;  // 0: none
    std::string why;
  };
  const std::vector<Case> cases = {
      {"jsonl", a + b + "{\"step\": 3, \"lo", a + b, 3, unfinished},
      {"jsonl", a + b + "{\"step\": 3, \"loss\": \n", a + b, 3, unreadable},
      {"jsonl", a + "{\"step\": 2, \"loss\": 2.4}", a, 2, unfinished},
      {"jsonl", a + b, a + b, 0, ""},
      {"csv", head + c1 + "2,2.4,", head + c1, 3, unfinished},
      {"csv", head + c1 + "2,2.4\n", head + c1, 3, unreadable},
      {"csv", head + c1, head + c1, 0, ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    const fs::path file = d / ("metrics." + c.format);
    write_text(file, c.text);
    std::string note;
    {
      MetricsWriter w(file.string(), c.format, 3);
      note = w.note();
    }
    EXPECT_EQ(read_bytes(file), c.kept);
    EXPECT_EQ(note, c.dropped_line == 0 ? ""
                                        : "metrics: dropped line " + std::to_string(c.dropped_line) + " of " +
                                              file.string() + ", which the earlier run left " + c.why);
  }
  fs::remove_all(d);
}

// A resume whose rewrite of the kept rows fails (the file size limit here, a full disk in use) leaves the
// earlier file as it was, for the next resume, and no temporary file beside it.
TEST(MetricsWriter, AResumeThatCannotRewriteTheRowsLeavesThemAsTheyWere) {
  const fs::path d = fresh_dir("metrics_rewrite");
  const fs::path file = d / "metrics.jsonl";
  std::string rows;
  for (int step = 1; step <= 20; ++step) rows += "{\"step\": " + std::to_string(step) + ", \"loss\": 2.5}\n";
  write_text(file, rows);
  try {
    FileSizeLimit limit(64);
    MetricsWriter w(file.string(), "jsonl", 20);
    ADD_FAILURE() << "the rows were rewritten past the limit";
  } catch (const IoError& e) {
    EXPECT_TRUE(has(e.what(), "cannot write metrics file '" + file.string() + "': File too large")) << e.what();
  }
  EXPECT_EQ(read_bytes(file), rows);
  EXPECT_FALSE(fs::exists(d / "metrics.jsonl.tmp"));
  fs::remove_all(d);
}

// A run whose row of step 2 was cut off before the checkpoint of step 2 (the disk filled, then had room
// again): the resumed run says so and continues after it, and the file reads back, step 2 missing.
TEST(MetricsWriter, AResumedRunReadsBackWholeAfterATornRow) {
  const fs::path d = fresh_dir("metrics_torn_run");
  const Config cfg = small_config(d / "run");
  TrainOptions first = quiet();
  first.stop_after = 2;
  const TrainResult r = train(cfg, first);
  std::string text = read_bytes(r.metrics_file);
  ASSERT_EQ(text.back(), '\n');
  write_text(r.metrics_file, text.substr(0, text.size() - 12));
  Captured out;
  TrainOptions again = quiet();
  again.out = out.file;
  const TrainResult resumed = train(small_config(d / "run", {"checkpoint.resume=true"}), again);
  EXPECT_EQ(resumed.first_step, 3);
  EXPECT_TRUE(has(out.text(), "metrics: dropped line 2 of " + r.metrics_file +
                                  ", which the earlier run left unfinished (no line end)\n"))
      << out.text();
  std::vector<int64_t> steps;
  for (const StepMetrics& m : read_metrics(r.metrics_file)) steps.push_back(m.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{1, 3, 4}));
  fs::remove_all(d);
}
