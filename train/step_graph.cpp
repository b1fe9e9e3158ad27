// train.cuda_graph: the step's capture and replays (see step_graph.h).
#include "train/step_graph.h"

#include <exception>
#include <string>

#include "kernels/common/error.h"
#include "parallel/distributed.h"
#include "train/run.h"
#include "train/train_step.h"

namespace flowmoe {

GraphDecision agree_on_capture(Communicator& world, bool captured_here, bool insist) {
  if (on_every_rank(world, captured_here)) return GraphDecision::replay;
  return insist ? GraphDecision::abort : GraphDecision::eager;
}

bool StepGraph::use(const TrainRun& run, bool profiled) const {
  const AutoOnOff mode = run.cfg.train.cuda_graph;
  if (mode == AutoOnOff::off || failed_ || profiled) return false;
  if (graph_ && graph_->captured()) return true;
  // Several ranks: nccl's collectives, the reducer's stream and the zero-sync exchange's device puts are
  // captured with the step. A sync exchange reads counts to the host, which no replay could repeat.
  const bool possible = step_scalars_on_device(run) && !run.opts.after_backward;
  FLOWMOE_CHECK(possible || mode != AutoOnOff::on, ConfigError, "train.cuda_graph: on (",
                run.cfg.origin("train.cuda_graph"),
                ") needs a GPU, one process or collectives on the device (nccl), and no test hooks");
  // The first step of a run is eager: it creates the cuBLASLt plans and tells whether the step syncs.
  if (!possible || eager_steps_ == 0) return false;
  const bool no_syncs = on_every_rank(*run.setup.world, last_eager_host_syncs_ == 0);
  FLOWMOE_CHECK(no_syncs || mode != AutoOnOff::on, ConfigError, "train.cuda_graph: on (",
                run.cfg.origin("train.cuda_graph"), "), but the eager step made host synchronisations (",
                last_eager_host_syncs_,
                " on this rank), which a graph cannot replay (expert parallelism needs "
                "parallel.ep_dispatch: zero_sync on GPUs that reach each other's memory)");
  return no_syncs;
}

std::vector<Tensor> StepGraph::step(TrainRun& run, const std::vector<Batch>& batches, IssuedStep& issued,
                                    const StepBody& body) {
  RunSetup& setup = run.setup;
  GradientReducer* reducer = setup.reducer();
  // A weight gather an eager step left in flight (the last before the capture, or the profiled one):
  // neither the capture nor a replay may wait on an event from outside the graph, whose own gathers
  // are joined inside it.
  if (reducer) reducer->wait_weights();
  if (!graph_) {
    graph_ = std::make_unique<CudaGraphCapture>(setup.device);
    inputs_.clear();
    for (const Batch& b : batches)
      inputs_.push_back({Tensor::empty(b.inputs.shape(), b.inputs.dtype(), setup.device),
                         Tensor::empty(b.targets.shape(), b.targets.dtype(), setup.device)});
  }
  for (size_t a = 0; a < batches.size(); ++a) {
    run.loop.step_state.upload_into(batches[a].inputs, inputs_[a].inputs);
    run.loop.step_state.upload_into(batches[a].targets, inputs_[a].targets);
  }
  if (!graph_->captured()) {
    std::exception_ptr failure;
    std::string why = "another rank could not capture it";
    try {
      graph_->capture([&] { return body(inputs_, issued_); });
    } catch (const Error& e) {
      failure = std::current_exception();
      why = e.what();
    }
    const GraphDecision decision =
        agree_on_capture(*setup.world, failure == nullptr, run.cfg.train.cuda_graph == AutoOnOff::on);
    if (decision != GraphDecision::replay) {
      // Nothing of a capture ran, here or elsewhere; FP8 weight caches made during it are dropped (their
      // versions move), and so is a graph this rank did capture.
      for (const Variable& p : setup.model().parameters()) p.bump_version();
      // The gathered copies hold the weights still (nothing ran); their f32 weights are stale outside this
      // rank's segments, so the forward must not quantize them again.
      if (reducer && reducer->sharded()) reducer->mark_fp8_current();
      graph_.reset();
      if (decision == GraphDecision::abort && failure) std::rethrow_exception(failure);
      FLOWMOE_CHECK(decision != GraphDecision::abort, Error, "train.cuda_graph: on (",
                    run.cfg.origin("train.cuda_graph"), "), but the step could not be captured: ", why);
      failed_ = true;
      run.progress.message("train.cuda_graph: the step could not be captured, so it runs eagerly (" + why + ")");
      return body(inputs_, issued);
    }
    casts_ = run.loop.last_casts;
    run.progress.message("train.cuda_graph: step " + std::to_string(run.loop.step) +
                         " captured; it and later steps replay it");
  }
  graph_->replay();
  // What the captured host code did once, each replay does on the device; the versions move as an
  // eager AdamW step moves them, and the FP8 copies the update wrote are current for the new versions.
  for (const Variable& p : setup.model().parameters()) p.bump_version();
  setup.optimizer().mark_fp8_copies_current();
  if (reducer && reducer->sharded()) reducer->mark_fp8_current();
  issued = issued_;
  run.loop.last_casts = casts_;
  return graph_->outputs();
}

}  // namespace flowmoe
