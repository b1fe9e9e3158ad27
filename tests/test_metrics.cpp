// The metrics file's writer as a run uses it: a write the OS refuses stops the run with the file and the
// reason (/dev/full refuses every write with ENOSPC, as a full disk does), a resume that cannot rewrite
// the earlier rows leaves them as they were, and a resume drops a last line the earlier run left torn,
// saying so, so that the file reads back (and plots) whole. Rows read back as written, and rows from before a
// column existed (tflops, mfu) read back without it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/error.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// The format a metrics file's extension names.
MetricsFormat metrics_format(const std::string& name) {
  return parse_enum(kMetricsFormatNames, name, "logging.metrics_format");
}

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
    MetricsWriter jsonl("/dev/full", MetricsFormat::jsonl, -1);  // nothing is written before the first row
    try {
      jsonl.write(row(1));
      ADD_FAILURE() << "a row written to /dev/full went unnoticed";
    } catch (const IoError& e) {
      EXPECT_EQ(std::string(e.what()), "cannot write metrics file '/dev/full': No space left on device");
    }
  }
  try {
    MetricsWriter csv("/dev/full", MetricsFormat::csv, -1);  // the header
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
      "aux_loss,exchange_ms,tflops,mfu,mtp_loss\n";
  const std::string c1 = "1,2.5,,0.001,1,10,0,0,,0,,,,,,\n";
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
      MetricsWriter w(file.string(), metrics_format(c.format), 3);
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
    MetricsWriter w(file.string(), MetricsFormat::jsonl, 20);
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

// Every column reads back as written, in both formats; tflops and mfu too, and an absent MFU (no peak known)
// stays absent: null in JSONL, an empty cell in CSV.
TEST(MetricsWriter, RowsReadBackAsWritten) {
  const fs::path d = fresh_dir("metrics_round_trip");
  StepMetrics a = row(1);
  a.val_loss = 2.25;
  a.grad_norm = 0.5;
  a.tokens_per_s = 353000.5;
  a.peak_mem_bytes = 123456789;
  a.host_syncs = 3;
  a.moe_casts = 2;
  a.moe_max_over_mean = {1.25, 1.5};
  a.aux_loss = 0.0125;
  a.exchange_ms = 1.5;
  a.tflops = 412.345;
  a.mfu = 0.416763;
  a.mtp_loss = 2.875;
  StepMetrics b = row(2);
  b.skipped = true;
  b.tokens_per_s = 3400;
  b.tflops = 0.0102345;  // a CPU's: no peak, no MFU
  for (const char* format : {"jsonl", "csv"}) {
    SCOPED_TRACE(format);
    const fs::path file = d / (std::string("metrics.") + format);
    {
      MetricsWriter w(file.string(), metrics_format(format), -1);
      w.write(a);
      w.write(b);
    }
    const std::vector<StepMetrics> back = read_metrics(file.string());
    ASSERT_EQ(back.size(), 2u);
    const StepMetrics &x = back[0], &y = back[1];
    EXPECT_EQ(x.step, 1);
    EXPECT_EQ(x.loss, 2.5);
    EXPECT_EQ(x.val_loss, 2.25);
    EXPECT_EQ(x.lr, 1e-3);
    EXPECT_EQ(x.grad_norm, 0.5);
    EXPECT_EQ(x.tokens_per_s, 353000.5);
    EXPECT_EQ(x.peak_mem_bytes, 123456789);
    EXPECT_EQ(x.host_syncs, 3);
    EXPECT_EQ(x.moe_casts, 2);
    EXPECT_EQ(x.moe_max_over_mean, (std::vector<double>{1.25, 1.5}));
    EXPECT_EQ(x.aux_loss, 0.0125);
    EXPECT_EQ(x.exchange_ms, 1.5);
    EXPECT_EQ(x.tflops, 412.345);
    EXPECT_EQ(x.mfu, 0.416763);
    EXPECT_EQ(x.mtp_loss, 2.875);
    EXPECT_FALSE(x.skipped);
    EXPECT_EQ(y.step, 2);
    EXPECT_TRUE(y.skipped);
    EXPECT_TRUE(std::isnan(y.val_loss));
    EXPECT_EQ(y.tflops, 0.0102345);
    EXPECT_TRUE(std::isnan(y.mfu));
    EXPECT_TRUE(std::isnan(y.exchange_ms));
    EXPECT_TRUE(std::isnan(y.mtp_loss));  // no MTP modules: null / empty
  }
  EXPECT_TRUE(has(read_bytes(d / "metrics.jsonl"), "\"tflops\": 0.0102345, \"mfu\": null, \"mtp_loss\": null}\n"));
  EXPECT_TRUE(has(read_bytes(d / "metrics.csv"), ",0.0102345,,\n"));
  fs::remove_all(d);
}

// A run resumed on a metrics file from before the tflops and mfu columns keeps its rows, which read back
// without them (NaN), beside the new rows with them; the CSV gets the new header, its old rows padded.
TEST(MetricsWriter, AResumeKeepsRowsWrittenBeforeTheFlopsColumns) {
  const fs::path d = fresh_dir("metrics_old_columns");
  const std::string old_head =
      "step,loss,val_loss,lr,grad_norm,tokens_per_s,peak_mem_bytes,host_syncs,moe_casts,skipped,moe_max_over_mean,"
      "aux_loss,exchange_ms\n";
  const std::vector<std::pair<std::string, std::string>> files = {
      {"jsonl",
       "{\"step\": 1, \"loss\": 2.5, \"tokens_per_s\": 10.0, \"exchange_ms\": null}\n"
       "{\"step\": 2, \"loss\": 2.4, \"tokens_per_s\": 11.0, \"exchange_ms\": null}\n"},
      {"csv", old_head + "1,2.5,,0.001,1,10.0,0,0,,0,,,\n2,2.4,,0.001,1,11.0,0,0,,0,,,\n"},
  };
  for (const auto& [format, text] : files) {
    SCOPED_TRACE(format);
    const fs::path file = d / ("metrics." + format);
    write_text(file, text);
    EXPECT_EQ(read_metrics(file.string()).size(), 2u);  // the old file reads as it is
    {
      MetricsWriter w(file.string(), metrics_format(format), 2);
      StepMetrics m = row(3);
      m.tokens_per_s = 12;
      m.tflops = 0.25;
      m.mfu = 0.5;
      w.write(m);
    }
    const std::vector<StepMetrics> rows = read_metrics(file.string());
    ASSERT_EQ(rows.size(), 3u);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(rows[size_t(i)].step, i + 1);
      EXPECT_EQ(rows[size_t(i)].tokens_per_s, 10.0 + i);
      EXPECT_TRUE(std::isnan(rows[size_t(i)].tflops));
      EXPECT_TRUE(std::isnan(rows[size_t(i)].mfu));
    }
    EXPECT_EQ(rows[2].tflops, 0.25);
    EXPECT_EQ(rows[2].mfu, 0.5);
    if (format == "csv") {
      const std::string kept =
          old_head.substr(0, old_head.size() - 1) +
          ",tflops,mfu,mtp_loss\n1,2.5,,0.001,1,10.0,0,0,,0,,,,,,\n2,2.4,,0.001,1,11.0,0,0,,0,,,,,,\n";
      EXPECT_EQ(read_bytes(file).substr(0, kept.size()), kept);
    }
  }
  fs::remove_all(d);
}
