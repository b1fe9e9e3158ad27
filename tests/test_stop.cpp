// Stopping a run of one process early (train/stop_request.h): a request that comes during an evaluation or
// a checkpoint ends the run at that step, with no step after it; the stop file stops a run between two
// micro-batches, drops the step in progress, and the resumed run repeats the uninterrupted one bit for bit;
// a stop file already there stops a run before its first step. The requests are made at points the run's
// own progress output marks (a stream that watches what the run prints), so each lands where it is meant to.
// Signals through the built command: tests/test_cli.cpp; several ranks: tests/mpi/test_stop_train.cpp.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "tests/support/train_fixtures.h"
#include "train/metrics.h"
#include "train/trainer.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// tiny_config (tests/support/train_fixtures.h) with a progress line per step, and `extra` overrides.
Config stop_config(const fs::path& out_dir, const std::vector<std::string>& extra = {}) {
  Config c = tiny_config(out_dir);
  apply_override(c, "logging.log_every=1");
  for (const std::string& o : extra) apply_override(c, o);
  validate(c);
  return c;
}

// A progress stream that calls `react` once, when the text the run has printed first contains `mark`.
class WatchedOutput {
 public:
  WatchedOutput(std::string mark, std::function<void()> react) : mark_(std::move(mark)), react_(std::move(react)) {
    cookie_io_functions_t io{nullptr, &WatchedOutput::write, nullptr, nullptr};
    file_ = fopencookie(this, "w", io);
    std::setvbuf(file_, nullptr, _IONBF, 0);  // each write reaches `react` as the run makes it
  }
  ~WatchedOutput() { std::fclose(file_); }
  WatchedOutput(const WatchedOutput&) = delete;
  WatchedOutput& operator=(const WatchedOutput&) = delete;
  std::FILE* file() const { return file_; }
  bool reacted() const { return reacted_; }
  const std::string& text() const { return text_; }

 private:
  static ssize_t write(void* self, const char* data, size_t size) {
    auto* w = static_cast<WatchedOutput*>(self);
    w->text_.append(data, size);
    if (!w->reacted_ && w->text_.find(w->mark_) != std::string::npos) {
      w->reacted_ = true;
      w->react_();
    }
    return ssize_t(size);
  }
  std::string mark_;
  std::function<void()> react_;
  std::string text_;
  bool reacted_ = false;
  std::FILE* file_ = nullptr;
};

std::string step_dir(const fs::path& run, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
  return (run / "checkpoints" / name).string();
}

// The run of `cfg`, resumed from its newest checkpoint to train.steps, repeats `straight`'s losses bit for
// bit from where it resumed, and ends with the same weights and optimizer state.
void expect_resume_repeats(Config cfg, const TrainResult& straight, int64_t resumed_at) {
  apply_override(cfg, "checkpoint.resume=true");
  const TrainResult r = train(cfg, quiet());
  EXPECT_EQ(r.first_step, resumed_at + 1);
  ASSERT_EQ(r.losses.size(), straight.losses.size() - size_t(resumed_at));
  for (size_t i = 0; i < r.losses.size(); ++i)
    EXPECT_EQ(std::memcmp(&r.losses[i], &straight.losses[size_t(resumed_at) + i], sizeof(double)), 0)
        << "step " << resumed_at + 1 + int64_t(i) << ": " << r.losses[i] << " vs "
        << straight.losses[size_t(resumed_at) + i];
  const int64_t last = cfg.train.steps;
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_bytes(fs::path(step_dir(straight.out_dir, last)) / f),
              read_bytes(fs::path(step_dir(r.out_dir, last)) / f))
        << f;
}

// A stop requested when the run prints `mark` (after the evaluation or the checkpoint of step `at`) ends
// the run at that step: no step after it, its checkpoint the one to resume from, and the resume repeats
// the straight run.
void expect_stop_at(const std::string& name, const std::string& mark, int64_t at) {
  const fs::path d = fresh_dir(name);
  const TrainResult straight = train(stop_config(d / "straight"), quiet());
  ASSERT_EQ(straight.losses.size(), 12u);

  const Config cfg = stop_config(d / "stopped");
  WatchedOutput out(mark, [] { request_stop(); });
  TrainOptions opts;
  opts.out = out.file();
  const TrainResult r = train(cfg, opts);
  ASSERT_TRUE(out.reacted()) << out.text();
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.last_step, at) << out.text();
  EXPECT_EQ(r.last_checkpoint, step_dir(d / "stopped", at));
  EXPECT_EQ(read_metrics(r.metrics_file).back().step, at);
  EXPECT_FALSE(fs::exists(step_dir(d / "stopped", at + 1)));
  EXPECT_NE(out.text().find("interrupted at step " + std::to_string(at) + ": checkpoint "), std::string::npos)
      << out.text();
  expect_resume_repeats(cfg, straight, at);
  fs::remove_all(d);
}

}  // namespace

// The request comes after step 4's evaluation has run: the ranks' agreement comes after the evaluation.
TEST(Stop, DuringAnEvaluationEndsTheRunAtThatStep) { expect_stop_at("stop_eval", "step 4: val loss", 4); }

// The request comes after step 6's checkpoint is written: the run ends there, on that checkpoint.
TEST(Stop, DuringACheckpointEndsTheRunAtThatStep) { expect_stop_at("stop_save", "step 6: checkpoint", 6); }

// The stop file, made while step 4 accumulates its 200 micro-batches: the step is dropped at its next
// micro-batch, the checkpoint is step 3's, the file is removed, and the resumed run takes step 4 again
// and repeats the straight run bit for bit (its partial gradients were never applied, its batches not
// consumed).
// A run of cfg whose stop file (in its out_dir) is made `delay` after its output first shows `mark`.
struct StoppedRun {
  TrainResult result;
  double seconds = 0;  // the run's wall time
  bool touched = false;
  std::string text;  // what it printed
};
static StoppedRun train_with_stop_file(const Config& cfg, const std::string& mark, std::chrono::milliseconds delay) {
  const fs::path stop_file = fs::path(cfg.logging.out_dir) / "stop";
  std::thread touch;
  WatchedOutput out(mark, [&] {
    touch = std::thread([&] {
      std::this_thread::sleep_for(delay);
      std::ofstream(stop_file).put('\n');
    });
  });
  TrainOptions opts;
  opts.out = out.file();
  StoppedRun run;
  const auto started = std::chrono::steady_clock::now();
  run.result = train(cfg, opts);
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  if (touch.joinable()) touch.join();
  run.touched = out.reacted();
  run.text = out.text();
  return run;
}

TEST(Stop, TheStopFileDropsTheStepInProgressAndResumeRepeatsTheRun) {
  const fs::path d = fresh_dir("stop_file_accum");
  const std::vector<std::string> sets = {"train.steps=6", "train.grad_accum_steps=200", "train.eval_every=0",
                                         "checkpoint.every=0"};
  const TrainResult straight = train(stop_config(d / "straight", sets), quiet());
  ASSERT_EQ(straight.losses.size(), 6u);

  const Config cfg = stop_config(d / "stopped", sets);
  const fs::path stop_file = d / "stopped" / "stop";
  // Step 3's line is printed as step 4 begins; the file comes a few micro-batches into it.
  const StoppedRun run = train_with_stop_file(cfg, " 3/6 | loss", std::chrono::milliseconds(5));
  const TrainResult& r = run.result;
  const double seconds = run.seconds;
  ASSERT_TRUE(run.touched) << run.text;
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.last_step, 3) << run.text;
  EXPECT_EQ(r.last_checkpoint, step_dir(d / "stopped", 3));
  EXPECT_EQ(read_metrics(r.metrics_file).back().step, 3);
  EXPECT_FALSE(fs::exists(stop_file)) << "a resume would stop at once";
  EXPECT_NE(run.text.find("interrupted at step 3 (asked by " + stop_file.string() + ", now removed): checkpoint "),
            std::string::npos)
      << run.text;
  // Steps 1-3 and a few micro-batches: well under the 6 whole steps of the straight run.
  std::printf("stopped after %.2f s\n", seconds);
  expect_resume_repeats(cfg, straight, 3);
  fs::remove_all(d);
}

// A step of 2^20 micro-batches (the most train.grad_accum_steps takes) holds one micro-batch at a time, so it
// starts at once and a stop file made as it begins ends the run within seconds: nothing is applied, no
// checkpoint written. Taking every micro-batch of the step before the first one ran held them all (about a
// gigabyte here) and kept the stop waiting until they were made.
TEST(Stop, AStepOfAMillionMicroBatchesHoldsOneAtATimeAndStopsAtOnce) {
  const fs::path d = fresh_dir("stop_million");
  const Config cfg = stop_config(
      d / "run", {"train.steps=4", "train.grad_accum_steps=1048576", "train.eval_every=0", "checkpoint.every=0"});
  const StoppedRun run = train_with_stop_file(cfg, "data:", std::chrono::milliseconds(200));
  ASSERT_TRUE(run.touched) << run.text;
  EXPECT_TRUE(run.result.interrupted);
  EXPECT_EQ(run.result.last_step, 0) << run.text;
  EXPECT_LT(run.seconds, 20.0) << run.text;
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  EXPECT_LT(usage.ru_maxrss, 512L << 10) << "peak resident KiB";
  fs::remove_all(d);
}

// A stop file already there (its run ended before it looked) stops the next run before its first step and is
// removed; a resumed run keeps the checkpoint it resumed from as it was.
TEST(Stop, AStopFileLeftBehindStopsTheNextRunBeforeItsFirstStep) {
  const fs::path d = fresh_dir("stop_file_left");
  const Config cfg = stop_config(d / "run", {"train.steps=4", "checkpoint.every=2", "train.eval_every=0"});
  fs::create_directories(d / "run");
  std::ofstream(d / "run" / "stop").put('\n');
  const TrainResult none = train(cfg, quiet());
  EXPECT_TRUE(none.interrupted);
  EXPECT_TRUE(none.losses.empty());
  EXPECT_EQ(none.last_checkpoint, "");
  EXPECT_FALSE(fs::exists(d / "run" / "stop"));
  EXPECT_EQ(latest_checkpoint((d / "run" / "checkpoints").string()), "");

  TrainOptions two = quiet();
  two.stop_after = 2;
  ASSERT_EQ(train(cfg, two).last_step, 2);
  const fs::path meta = fs::path(step_dir(d / "run", 2)) / "meta.json";
  const auto written = fs::last_write_time(meta);
  std::ofstream(d / "run" / "stop").put('\n');
  Config resume = cfg;
  apply_override(resume, "checkpoint.resume=true");
  const TrainResult kept = train(resume, quiet());
  EXPECT_TRUE(kept.interrupted);
  EXPECT_TRUE(kept.losses.empty());
  EXPECT_EQ(kept.last_step, 2);
  EXPECT_EQ(kept.last_checkpoint, step_dir(d / "run", 2));
  EXPECT_EQ(fs::last_write_time(meta), written) << "the checkpoint was written again";
  EXPECT_FALSE(fs::exists(d / "run" / "stop"));
  EXPECT_EQ(train(resume, quiet()).last_step, 4);  // no file: the run goes on
  fs::remove_all(d);
}
