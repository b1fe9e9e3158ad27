// train.cuda_graph: the training step captured once as a CUDA graph and replayed from then on (StepGraph), and the
// ranks' agreement on a capture (agree_on_capture). train_step.cpp asks it, step by step, whether to replay and
// gives it the step's body to capture.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dataset/data.h"
#include "engine/cast_stats.h"
#include "engine/cuda_graph.h"
#include "engine/tensor.h"
#include "parallel/communicator.h"
#include "train/loop_state.h"

namespace flowmoe {

struct TrainRun;

// train.cuda_graph over several ranks: what every rank does once each has tried to capture the step,
// decided by all of them together. NCCL's collectives are captured on every rank or on none: a rank that
// ran the step eagerly while the others replayed a graph would hang them or sum the wrong buffers.
// replay: every rank captured it. eager: some rank could not, and every rank runs its steps eagerly
// from then on (auto). abort: some rank could not and `insist` (train.cuda_graph: on): every rank stops.
// captured_here: this rank's capture succeeded. Collective over the world's host side (on_every_rank).
enum class GraphDecision : uint8_t { replay, eager, abort };
GraphDecision agree_on_capture(Communicator& world, bool captured_here, bool insist);

// The step on the device from its micro-batches (here the graph's static inputs) to the expert-bias update, as
// train_step.cpp runs it: returns the MoE layers' loads and fills in what the host knows of the step.
using StepBody = std::function<std::vector<Tensor>(const std::vector<Batch>& inputs, IssuedStep& issued)>;

class StepGraph {
 public:
  // Whether this step replays (or first captures) the graph. auto takes it once an eager step of this run made
  // no host synchronisation on any rank; on insists, and says why when it cannot (ConfigError). Every rank
  // decides alike: what it reads is the same on every rank, or agreed over the world.
  bool use(const TrainRun& run, bool profiled) const;
  // The graph step: the batches go into the captured step's static inputs, then one launch runs it all; the first
  // call captures `body` (a capture that fails on some rank runs the step eagerly instead, or stops the run under
  // train.cuda_graph: on). `issued` becomes what the capture's host code knew. Returns the MoE layers' loads.
  std::vector<Tensor> step(TrainRun& run, const std::vector<Batch>& batches, IssuedStep& issued, const StepBody& body);
  // An eager step ran with `host_syncs` host synchronisations (use() reads the last one's).
  void count_eager_step(int64_t host_syncs) {
    ++eager_steps_;
    last_eager_host_syncs_ = host_syncs;
  }
  // The exchange buffers changed shape: the graph holding the old ones is dropped. The next step runs eagerly (an
  // exchange window grows there, which a capture could not do) and the one after it is captured anew.
  void drop() {
    graph_.reset();
    eager_steps_ = 0;
  }

 private:
  std::unique_ptr<CudaGraphCapture> graph_;
  std::vector<Batch> inputs_;  // the captured step's static inputs
  IssuedStep issued_;          // what the capture's host code knew
  CastCounts casts_;
  bool failed_ = false;                 // a capture failed under auto: eager from then on
  int64_t eager_steps_ = 0;             // steps this call ran without the graph
  int64_t last_eager_host_syncs_ = -1;  // the host synchronisations the last of them made
};

}  // namespace flowmoe
