// Stopping a multi-process run, through the built command under mpirun as a user launches it: the stop
// file during an evaluation stops both ranks at that step with a checkpoint that resumes bit for bit; a
// signal to mpirun stops with a checkpoint once Open MPI gives the ranks time (odls_base_sigkill_timeout);
// and a rank that stops answering (SIGSTOP) ends the job after parallel.timeout_s with one line, its last
// checkpoint intact. Each script runs under run_shell's time limit, so a hang fails instead of waiting.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "tests/mpi/train_launch.h"

using namespace flowmoe;
using namespace flowmoe::test;
namespace fs = std::filesystem;

namespace {

// Runs `script` (sh) in dir under run_shell's limit; its launches write their own logs.
Launch run_script(const fs::path& dir, const std::string& name, const std::string& script, int limit_s) {
  const fs::path file = dir / (name + ".sh");
  std::ofstream(file) << "set -u\n" << script;
  return run_shell(dir, "sh '" + file.string() + "'", limit_s);
}

// The shell lines that wait (at most a minute) until `file` holds `text`.
std::string wait_for_text(const fs::path& file, const std::string& text) {
  return "for i in $(seq 1 1200); do grep -qF -- '" + text + "' '" + file.string() +
         "' 2>/dev/null && break; sleep 0.05; done\n";
}

// The longest validation pass these runs allow (390 batches of 8 sequences held out of 2M tokens): seconds
// on two ranks, against a few hundredths of a second for a step.
const std::string kLongEval = " --set data.synthetic_tokens=2000000 --set train.eval_batches=390";

}  // namespace

// The stop file touched while step 10 is evaluated: both ranks finish the evaluation, agree on the stop, write
// step 10's checkpoint and exit with status 0, and the file is gone. The run resumed from that checkpoint
// repeats the uninterrupted run bit for bit (2 ranks sum in the same order every time).
TEST(StopUnderMpirun, TheStopFileDuringAnEvaluationStopsWithACheckpointThatResumesBitForBit) {
  const fs::path d = fresh_dir("mpi_stop_file");
  const std::vector<StepMetrics> straight = train_run(d, 2, "straight", kLongEval);
  ASSERT_EQ(straight.size(), 20u);

  const fs::path run = d / "stopped", log = d / "stopped.log", err = d / "stopped.err";
  const std::string script = launcher(2) + kBinary + " " + train_args(run, kLongEval) + " > '" + log.string() +
                             "' 2> '" + err.string() + "' & m=$!\n" + wait_for_text(log, " 9/20 | loss") +
                             "sleep 1\n"  // step 10 takes a few hundredths of a second: its evaluation, seconds
                             "grep -qF 'step 10: val loss' '" +
                             log.string() + "' && echo 'evaluation already over'\n" + "touch '" +
                             (run / "stop").string() + "'\nwait $m\n";
  const Launch r = run_script(d, "stop_file", script, 300);
  const std::string out = read_text(log);
  ASSERT_EQ(r.status, 0) << r.out << out << read_text(err);
  EXPECT_EQ(count(r.out, "evaluation already over"), 0u) << "the file came after the evaluation:\n" << out;
  EXPECT_EQ(count(out, "interrupted at step 10 (asked by " + (run / "stop").string() + ", now removed): checkpoint " +
                           (run / "checkpoints" / "step_00000010").string()),
            1u)
      << out;
  EXPECT_FALSE(fs::exists(run / "stop"));
  const std::vector<StepMetrics> rows = read_metrics((run / "metrics.jsonl").string());
  ASSERT_FALSE(rows.empty());
  EXPECT_EQ(rows.back().step, 10);
  EXPECT_FALSE(std::isnan(rows.back().val_loss)) << "step 10 was evaluated";

  const std::vector<StepMetrics> resumed =
      train_run(d, 2, "stopped", kLongEval + " --resume " + (run / "checkpoints" / "step_00000010").string());
  ASSERT_EQ(resumed.size(), 20u);  // the metrics file keeps steps 1-10
  for (size_t i = 0; i < resumed.size(); ++i) {
    EXPECT_EQ(resumed[i].loss, straight[i].loss) << "step " << resumed[i].step;
    if (!std::isnan(straight[i].val_loss)) {
      EXPECT_EQ(resumed[i].val_loss, straight[i].val_loss) << "step " << resumed[i].step;
    }
  }
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    EXPECT_EQ(read_text(d / "straight" / "checkpoints" / "step_00000020" / f),
              read_text(run / "checkpoints" / "step_00000020" / f))
        << f;
  fs::remove_all(d);
}

// SIGTERM to mpirun, with odls_base_sigkill_timeout giving the ranks 5 s: Open MPI passes it on 5 s later and
// kills 5 s after that, time enough for the ranks to finish their step and write its checkpoint.
TEST(StopUnderMpirun, ASignalToMpirunSavesACheckpointWhenTheRanksAreGivenTime) {
  const fs::path d = fresh_dir("mpi_stop_signal");
  const fs::path run = d / "run", log = d / "run.log";
  const std::string script = "OMPI_MCA_odls_base_sigkill_timeout=5 " + launcher(2) + kBinary + " " +
                             train_args(run, "--set train.steps=100000 --set checkpoint.every=0") + " > '" +
                             log.string() + "' 2>&1 & m=$!\n" + wait_for_text(log, " 3/100000 | loss") +
                             "kill -TERM $m\nwait $m\necho \"mpirun status $?\"\n";
  const Launch r = run_script(d, "signal", script, 120);
  const std::string out = read_text(log);
  EXPECT_EQ(r.status, 0) << r.out << out;
  EXPECT_EQ(count(r.out, "mpirun status 0"), 0u) << "mpirun reports the stop as a failure:\n" << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex(R"(interrupted at step ([0-9]+): checkpoint (\S+) )"))) << out;
  EXPECT_TRUE(fs::exists(fs::path(m[2].str()) / "meta.json")) << m[2];
  fs::remove_all(d);
}

// Rank 1 paused (SIGSTOP) mid-run: rank 0 waits in its next collective, and after parallel.timeout_s = 3 its
// watchdog prints one line naming it and the collective and ends it; mpirun then ends rank 1. Without the
// watchdog the job waits forever (here: until run_shell's limit). The last checkpoint on disk loads.
TEST(StopUnderMpirun, ARankThatStopsAnsweringEndsTheJobAfterTheTimeout) {
  const fs::path d = fresh_dir("mpi_watchdog");
  const fs::path run = d / "run", log = d / "run.log", err = d / "run.err";
  const std::string args = train_args(run,
                                      "--set train.steps=100000 --set checkpoint.every=5 --set train.eval_every=0"
                                      " --set parallel.timeout_s=3");
  // Rank 0 writes its pid into run.lock; mpirun's other child is rank 1.
  const std::string script = launcher(2) + kBinary + " " + args + " > '" + log.string() + "' 2> '" + err.string() +
                             "' & m=$!\n" + wait_for_text(log, " 7/100000 | loss") + "r0=$(cat '" +
                             (run / "run.lock").string() +
                             "')\n"
                             "for p in $(pgrep -P $m); do [ \"$p\" != \"$r0\" ] && r1=$p; done\n"
                             "kill -STOP $r1\nt0=$(date +%s.%N)\nwait $m\necho \"mpirun status $?\"\n"
                             "echo \"ended after $(awk -v a=$t0 -v b=$(date +%s.%N) 'BEGIN { print b - a }') s\"\n"
                             "kill -CONT $r1 2>/dev/null\n";
  const Launch r = run_script(d, "watchdog", script, 90);
  const std::string errors = read_text(err);
  ASSERT_EQ(r.status, 0) << "the job hung: " << r.out << errors;
  EXPECT_EQ(count(r.out, "mpirun status 0"), 0u) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex(R"(ended after ([0-9.]+) s)"))) << r.out;
  EXPECT_LT(std::stod(m[1]), 3 + 15.0) << "the timeout is 3 s";
  EXPECT_EQ(lines_starting(errors, "flowmoe: error: "), 1u) << errors;
  EXPECT_TRUE(std::regex_search(errors, std::regex(R"(flowmoe: error: rank 0 has waited [0-9]+ s in [a-z_ ]+ over 2 )"
                                                   R"(ranks \(mpi\), more than parallel.timeout_s = 3: another )"
                                                   R"(rank stopped answering)")))
      << errors;
  const std::string last = latest_checkpoint((run / "checkpoints").string());
  ASSERT_FALSE(last.empty());
  const std::string eval = "eval --config " + kConfig +
                           " --set train.device=cpu --set data.seq_len=64 --set data.synthetic_tokens=200000"
                           " --checkpoint " +
                           last;
  const Launch loaded = run_shell(d, kBinary + " " + eval, 120);
  EXPECT_EQ(loaded.status, 0) << loaded.err;
  fs::remove_all(d);
}
