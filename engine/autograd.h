// A small reverse-mode autograd graph.
//
// Ops are Primitives in the MLX style: eval_cpu, eval_gpu and vjp. apply() runs a primitive on the
// inputs' device and, when gradients are wanted, records a Node that keeps only what the primitive
// says its vjp needs. Variable::backward() walks the graph in topological order (of the ready nodes, the one
// recorded last first, as the forward's reverse; nodes marked backward_first before the others), adds up
// gradients where a value is used twice, and accumulates into leaf .grad(). checkpoint() drops a subgraph's
// activations in forward and re-runs it in backward (the base of `recompute: [moe_expert]`).
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/tensor.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

// ---- primitives -------------------------------------------------------------------------------

class Primitive {
 public:
  virtual ~Primitive() = default;
  virtual const char* name() const = 0;
  virtual std::vector<Tensor> eval_cpu(const std::vector<Tensor>& inputs) = 0;
  virtual std::vector<Tensor> eval_gpu(const std::vector<Tensor>& inputs) = 0;
  // Gradients for each input, given the cotangents of each output. An entry may be left undefined
  // where needs_grad is false. inputs/outputs hold only what saves_inputs/saves_outputs kept.
  virtual std::vector<Tensor> vjp(const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs,
                                  const std::vector<Tensor>& d_outputs, const std::vector<bool>& needs_grad) = 0;
  virtual bool saves_inputs() const { return true; }
  virtual bool saves_outputs() const { return false; }
  // Of what saves_inputs / saves_outputs keep, whether input / output i is kept (all by default): an op whose
  // backward needs one tensor of several keeps that one alone, and its vjp sees the others undefined.
  virtual bool keeps_input(size_t i) const { return true; }
  virtual bool keeps_output(size_t i) const { return true; }
  // Floating-point operations of one call on these inputs, for the step profiler's TFLOP/s
  // (engine/profiler.h); 0 where an op does not count them. Its vjp's: by default twice the
  // forward's, a GEMM's dgrad and wgrad. Either may be asked with no inputs (a vjp that saves none).
  virtual double flops(const std::vector<Tensor>& inputs) const { return 0; }
  virtual double vjp_flops(const std::vector<Tensor>& inputs) const { return 2 * flops(inputs); }
  // Whether the backward walk runs this op's vjp as soon as it is ready, before the nodes recorded after it
  // (an exchange on the comm lane, engine/stream_lane.h, whose transfer then overlaps them).
  virtual bool backward_first() const { return false; }
};

// A primitive that computes another op's gradient (e.g. rmsnorm_backward): run through eval() so
// the device picks the backend, but not differentiable itself.
class BackwardPrimitive : public Primitive {
 public:
  std::vector<Tensor> vjp(const std::vector<Tensor>&, const std::vector<Tensor>&, const std::vector<Tensor>&,
                          const std::vector<bool>&) override {
    FLOWMOE_THROW(Error, name(), ": second-order gradients are not implemented");
  }
};

// A Primitive or BackwardPrimitive whose CPU and GPU paths share one body (it picks its kernels from
// the `cuda` flag or the tensors' device): subclasses implement run(). In a CPU-only build no tensor
// can live on a device, and the CUDA launchers it would reach throw (kernels/cuda_none.cpp).
template <class Base>
class SharedBodyPrimitive : public Base {
 public:
  std::vector<Tensor> eval_cpu(const std::vector<Tensor>& in) final { return run(in, false); }
  std::vector<Tensor> eval_gpu(const std::vector<Tensor>& in) final { return run(in, true); }

 protected:
  virtual std::vector<Tensor> run(const std::vector<Tensor>& in, bool cuda) = 0;
};

// Runs the primitive on the device of its inputs (all defined inputs must share one device).
std::vector<Tensor> eval(Primitive& p, const std::vector<Tensor>& inputs);

// ---- gradient mode ----------------------------------------------------------------------------

bool grad_enabled();
class NoGradGuard {  // ops run inside record no graph
 public:
  NoGradGuard();
  ~NoGradGuard();

 private:
  bool prev_;
};
class EnableGradGuard {
 public:
  EnableGradGuard();
  ~EnableGradGuard();

 private:
  bool prev_;
};

// ---- variables --------------------------------------------------------------------------------

struct Node;
struct VariableImpl {
  Tensor data;
  Tensor grad;
  bool requires_grad = false;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  int output_nr = 0;
  std::string name;
  uint64_t version = 0;  // bumped whenever data changes in place (optimizer step, checkpoint load)
  // A leaf stored in another dtype than its gradient (Variable::store_as): each gradient that arrives is
  // cast to this one first. Unset: gradients are kept as they arrive.
  std::optional<DType> grad_dtype;
};

class Variable {
 public:
  Variable() = default;
  explicit Variable(Tensor data, bool requires_grad = false, std::string name = {});

  bool defined() const { return impl_ != nullptr; }
  const Tensor& data() const { return impl()->data; }
  void set_data(const Tensor& t);  // e.g. the optimizer's update; shape/dtype/device must match
  // A leaf's values from now on in t's dtype (the bf16 model weights of precision.param_dtype, their f32
  // masters in the optimizer), its gradients still in the dtype it had: each one that reaches it is cast back to
  // that, so a weight used twice sums its gradients as the f32 weight would. Shape and device must match.
  void store_as(const Tensor& t);
  // Caches derived from the data (the FP8 copy of an expert weight) compare versions to stay fresh.
  // Whoever edits data() in place must call bump_version(); set_data() does it.
  uint64_t version() const { return impl()->version; }
  void bump_version() const { ++impl()->version; }
  const Tensor& grad() const { return impl()->grad; }
  void set_grad(const Tensor& g) { impl()->grad = g; }
  void zero_grad() { impl()->grad = Tensor(); }
  bool requires_grad() const { return impl()->requires_grad; }
  bool is_leaf() const { return impl()->grad_fn == nullptr; }
  const std::string& name() const { return impl()->name; }
  Variable detach() const;  // same data, no history, no grad

  const Shape& shape() const { return data().shape(); }
  int64_t size(int d) const { return data().size(d); }
  DType dtype() const { return data().dtype(); }
  Device device() const { return data().device(); }

  // Backpropagates from this value. `d` defaults to 1 for a one-element output.
  void backward(const Tensor& d = Tensor(), bool retain_graph = false) const;

  VariableImpl* impl() const;
  const std::shared_ptr<VariableImpl>& shared_impl() const { return impl_; }

 private:
  std::shared_ptr<VariableImpl> impl_;
};

// Backpropagates from several outputs at once (used by checkpoint). Both vectors are taken by value
// and dropped once the graph is seeded, so a caller that moves them in frees them early.
void backward(std::vector<Variable> outputs, std::vector<Tensor> d_outputs, bool retain_graph = false);

// Called once per leaf in a backward, right after the last gradient that backward brings it has been
// accumulated into .grad(): the walk counts the edges into each leaf from the nodes it will run, and a
// leaf used inside a checkpoint is finished by the recompute's own walk. Data parallelism starts a
// gradient's reduction from here while the backward goes on (parallel/grad_reducer.h). The hook is this
// thread's while the guard lives; without one the walk counts nothing.
using LeafGradHook = std::function<void(VariableImpl& leaf)>;
class LeafGradHookGuard {
 public:
  explicit LeafGradHookGuard(LeafGradHook hook);
  ~LeafGradHookGuard();
  LeafGradHookGuard(const LeafGradHookGuard&) = delete;
  LeafGradHookGuard& operator=(const LeafGradHookGuard&) = delete;

 private:
  LeafGradHook prev_;
};

// ---- graph nodes ------------------------------------------------------------------------------

struct Edge {
  std::shared_ptr<Node> fn;            // producing node, or
  std::shared_ptr<VariableImpl> leaf;  // the leaf that receives the gradient
  int output_nr = 0;
};

struct Node {
  virtual ~Node() = default;
  virtual std::string name() const = 0;
  // Gradients for each entry of `next`, given the gradients of this node's outputs (moved in, so a
  // node may release them before it returns, as checkpoint does).
  virtual std::vector<Tensor> backward(std::vector<Tensor> d_outputs) = 0;
  virtual void release() {}  // drop saved tensors once backward ran
  std::vector<Edge> next;    // one per input
  std::vector<Shape> out_shapes;
  std::vector<DType> out_dtypes;
  Device device;
  bool on_side = false;  // recorded in a side branch (engine/stream_lane.h): its backward runs there too
  std::string scope;     // the profiler's scope when the node was recorded (kept only while profiling)
  // The walk's order among ready nodes: backward_first ones first, then the later recorded (higher sequence).
  bool backward_first = false;
  uint64_t sequence = 0;
};

// Nodes recorded while one lives are walked as soon as they are ready (a side branch's, engine/stream_lane.h,
// whether or not its stream is on, so that the order and so the sums do not depend on it).
class BackwardFirstGuard {
 public:
  BackwardFirstGuard();
  ~BackwardFirstGuard();
  BackwardFirstGuard(const BackwardFirstGuard&) = delete;
  BackwardFirstGuard& operator=(const BackwardFirstGuard&) = delete;

 private:
  bool prev_;
};

// Runs a primitive and records it. Outputs of integer dtype never require grad.
std::vector<Variable> apply(std::shared_ptr<Primitive> p, const std::vector<Variable>& inputs);

// Recomputation: runs fn without recording, and in backward re-runs it with recording on and
// backpropagates through the fresh graph. Parameters fn captures get their gradients there.
// fn must be deterministic (same outputs for the same inputs).
using CheckpointFn = std::function<std::vector<Variable>(const std::vector<Variable>&)>;
std::vector<Variable> checkpoint(CheckpointFn fn, const std::vector<Variable>& inputs);

}  // namespace flowmoe
