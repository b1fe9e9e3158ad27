#include "engine/autograd.h"

#include <atomic>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>

// Above autograd, but kept: gradients are summed by tensor_add, the add primitive, on their device.
#include "engine/backward_streams.h"
#include "engine/ops/ops.h"
#include "engine/profiler.h"
#include "engine/stream_lane.h"
#include "kernels/common/device_api.h"

namespace flowmoe {

// ---- eval -------------------------------------------------------------------------------------

std::vector<Tensor> eval(Primitive& p, const std::vector<Tensor>& inputs) {
  const Tensor* first = nullptr;
  for (const Tensor& t : inputs) {
    if (!t.defined()) continue;
    if (!first)
      first = &t;
    else
      FLOWMOE_CHECK(t.device() == first->device(), DeviceError, p.name(), ": inputs on different devices (",
                    first->device().str(), " vs ", t.device().str(), ")");
  }
  FLOWMOE_CHECK(first != nullptr, Error, p.name(), ": no defined input");
  const Device device = first->device();
  if (device.is_cuda() && cuda_current_device() != device.index) cuda_set_device(device.index);
  if (!profiling()) return device.is_cpu() ? p.eval_cpu(inputs) : p.eval_gpu(inputs);
  OpTimer timer(p.name(), forward_phase(), profile_scope(), device, p.flops(inputs), tensor_bytes(inputs));
  std::vector<Tensor> outs = device.is_cpu() ? p.eval_cpu(inputs) : p.eval_gpu(inputs);
  timer.add_bytes(tensor_bytes(outs));
  return outs;
}

// ---- grad mode --------------------------------------------------------------------------------

static thread_local bool g_grad_enabled = true;
bool grad_enabled() { return g_grad_enabled; }
NoGradGuard::NoGradGuard() : prev_(g_grad_enabled) { g_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { g_grad_enabled = prev_; }
EnableGradGuard::EnableGradGuard() : prev_(g_grad_enabled) { g_grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { g_grad_enabled = prev_; }

// ---- Variable ---------------------------------------------------------------------------------

Variable::Variable(Tensor data, bool requires_grad, std::string name) : impl_(std::make_shared<VariableImpl>()) {
  FLOWMOE_CHECK(!requires_grad || is_floating(data.dtype()), DTypeError, "a ", data.describe(),
                " cannot require grad (integer dtype)");
  impl_->data = std::move(data);
  impl_->requires_grad = requires_grad;
  impl_->name = std::move(name);
}

VariableImpl* Variable::impl() const {
  FLOWMOE_CHECK(impl_ != nullptr, Error, "use of an undefined Variable");
  return impl_.get();
}

void Variable::set_data(const Tensor& t) {
  const Tensor& d = impl()->data;
  check_same_shape(d, t, "Variable::set_data");
  check_same_dtype(d, t, "Variable::set_data");
  check_same_device(d, t, "Variable::set_data");
  impl()->data = t;
  bump_version();
}

void Variable::store_as(const Tensor& t) {
  const Tensor& d = impl()->data;
  FLOWMOE_CHECK(is_leaf(), Error, "Variable::store_as: '", name(), "' is not a leaf");
  check_same_shape(d, t, "Variable::store_as");
  check_same_device(d, t, "Variable::store_as");
  if (!impl()->grad_dtype) impl()->grad_dtype = d.dtype();
  impl()->data = t;
  bump_version();
}

Variable Variable::detach() const { return Variable(data(), false, name()); }

// A gradient as a leaf keeps it (VariableImpl::grad_dtype).
static Tensor as_leaf_grad(const VariableImpl& leaf, Tensor g) {
  if (!g.defined() || !leaf.grad_dtype || g.dtype() == *leaf.grad_dtype) return g;
  return g.to(*leaf.grad_dtype);
}

// Adds g into `into` (or sets it when undefined). Gradients of one value must agree in shape/dtype.
static void accumulate(Tensor& into, const Tensor& g) {
  if (!g.defined()) return;
  if (!into.defined()) {
    into = g;
    return;
  }
  check_same_shape(into, g, "gradient accumulation");
  check_same_dtype(into, g, "gradient accumulation");
  into = tensor_add(into, g);
}

// Nodes that are recorded but whose saved tensors were released must not run twice.
struct PrimitiveNode : Node {
  std::shared_ptr<Primitive> prim;
  std::vector<Tensor> saved_inputs, saved_outputs;
  std::vector<bool> needs_grad;
  bool released = false;
  std::string name() const override { return prim->name(); }
  std::vector<Tensor> backward(std::vector<Tensor> d_outputs) override {
    FLOWMOE_CHECK(!released, Error, "backward through ", prim->name(),
                  " a second time: its saved tensors were freed (pass retain_graph = true)");
    if (!profiling()) return prim->vjp(saved_inputs, saved_outputs, d_outputs, needs_grad);
    OpTimer timer(prim->name(), OpPhase::backward, scope, device, prim->vjp_flops(saved_inputs),
                  tensor_bytes(saved_inputs) + tensor_bytes(d_outputs));
    std::vector<Tensor> d_in = prim->vjp(saved_inputs, saved_outputs, d_outputs, needs_grad);
    timer.add_bytes(tensor_bytes(d_in));
    return d_in;
  }
  void release() override {
    saved_inputs.clear();
    saved_outputs.clear();
    released = true;
  }
};

static Edge edge_of(const Variable& v) {
  Edge e;
  if (!v.defined() || !v.requires_grad()) return e;
  if (v.is_leaf())
    e.leaf = v.shared_impl();
  else
    e.fn = v.impl()->grad_fn, e.output_nr = v.impl()->output_nr;
  return e;
}

static thread_local bool g_backward_first = false;
BackwardFirstGuard::BackwardFirstGuard() : prev_(g_backward_first) { g_backward_first = true; }
BackwardFirstGuard::~BackwardFirstGuard() { g_backward_first = prev_; }

// Where a node sits in the walk's order (Node::sequence, backward_first).
static void mark_order(Node& node, bool backward_first) {
  static std::atomic<uint64_t> next_sequence{0};
  node.sequence = ++next_sequence;
  node.backward_first = backward_first || g_backward_first;
  node.on_side = in_side_branch();
}

static std::vector<Variable> wrap_outputs(const std::vector<Tensor>& outs, const std::shared_ptr<Node>& node) {
  std::vector<Variable> result;
  for (size_t i = 0; i < outs.size(); ++i) {
    bool diff = node && outs[i].defined() && is_floating(outs[i].dtype());
    Variable v(outs[i], diff);
    if (diff) {
      v.impl()->grad_fn = node;
      v.impl()->output_nr = int(i);
    }
    result.push_back(v);
  }
  if (node) {
    for (const Tensor& t : outs) {
      node->out_shapes.push_back(t.shape());
      // Gradients of FP8 values come back in a wider type; bf16 is what a zero-fill should use.
      node->out_dtypes.push_back(is_fp8(t.dtype()) ? DType::bf16 : t.dtype());
    }
  }
  return result;
}

std::vector<Variable> apply(std::shared_ptr<Primitive> p, const std::vector<Variable>& inputs) {
  std::vector<Tensor> in;
  bool any_grad = false;
  for (const Variable& v : inputs) {
    in.push_back(v.defined() ? v.data() : Tensor());
    any_grad = any_grad || (v.defined() && v.requires_grad());
  }
  std::vector<Tensor> outs = eval(*p, in);
  if (!(any_grad && grad_enabled())) return wrap_outputs(outs, nullptr);

  auto node = std::make_shared<PrimitiveNode>();
  node->prim = p;
  for (const Variable& v : inputs) {
    node->next.push_back(edge_of(v));
    node->needs_grad.push_back(v.defined() && v.requires_grad());
  }
  if (p->saves_inputs()) node->saved_inputs = in;
  if (p->saves_outputs()) node->saved_outputs = outs;
  for (size_t i = 0; i < node->saved_inputs.size(); ++i)
    if (!p->keeps_input(i)) node->saved_inputs[i] = Tensor();
  for (size_t i = 0; i < node->saved_outputs.size(); ++i)
    if (!p->keeps_output(i)) node->saved_outputs[i] = Tensor();
  if (profiling()) node->scope = profile_scope();
  mark_order(*node, p->backward_first());
  for (const Tensor& t : in)
    if (t.defined()) {
      node->device = t.device();
      break;
    }
  return wrap_outputs(outs, node);
}

// ---- backward ---------------------------------------------------------------------------------

static thread_local LeafGradHook g_leaf_hook;
LeafGradHookGuard::LeafGradHookGuard(LeafGradHook hook) : prev_(std::move(g_leaf_hook)) {
  g_leaf_hook = std::move(hook);
}
LeafGradHookGuard::~LeafGradHookGuard() { g_leaf_hook = std::move(prev_); }

namespace {

// The walk's order of ready nodes: backward_first ones first, then the one recorded last.
struct WalkOrder {
  bool operator()(const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) const {
    return std::tie(a->backward_first, a->sequence) < std::tie(b->backward_first, b->sequence);
  }
};

}  // namespace

void backward(std::vector<Variable> outputs, std::vector<Tensor> d_outputs, bool retain_graph) {
  FLOWMOE_CHECK(outputs.size() == d_outputs.size(), Error, "backward: ", outputs.size(), " outputs but ",
                d_outputs.size(), " gradients");
  NoGradGuard no_grad;                      // gradients are values, not new graph
  EvalPhaseGuard phase(OpPhase::backward);  // the profiler charges the walk's own ops (gradient sums) to it
  std::unordered_map<Node*, std::vector<Tensor>> grads;  // per node: one slot per output
  std::unordered_map<Node*, int> deps;                   // incoming edges from unfinished nodes
  std::vector<std::shared_ptr<Node>> roots;

  for (size_t i = 0; i < outputs.size(); ++i) {
    const Variable& v = outputs[i];
    if (!v.defined() || !v.requires_grad() || !d_outputs[i].defined()) continue;
    check_same_shape(v.data(), d_outputs[i], "backward (output vs its gradient)");
    if (v.is_leaf()) {
      const Tensor g = as_leaf_grad(*v.impl(), d_outputs[i]);
      if (!v.impl()->grad.defined())
        v.impl()->grad = g.is_sole_owner() ? g : g.clone();
      else
        accumulate(v.impl()->grad, g);
      continue;
    }
    Node* n = v.impl()->grad_fn.get();
    auto& slot = grads[n];
    slot.resize(n->out_shapes.size());
    accumulate(slot[size_t(v.impl()->output_nr)], d_outputs[i]);
    roots.push_back(v.impl()->grad_fn);
  }
  // Seeded: what the caller moved in is not needed any more (checkpoint's recomputed outputs and
  // their incoming gradients would otherwise live through the whole backward).
  outputs.clear();
  d_outputs.clear();

  // Count dependencies over the reachable graph (iterative DFS: graphs can be deep).
  // With a leaf hook, the edges into each leaf too: its gradient is final when the last has run.
  const bool hooked = static_cast<bool>(g_leaf_hook);
  std::unordered_map<VariableImpl*, int> leaf_deps;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (auto& r : roots)
    if (seen.insert(r.get()).second) stack.push_back(r.get());
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next) {
      if (hooked && e.leaf) leaf_deps[e.leaf.get()]++;
      if (!e.fn) continue;
      deps[e.fn.get()]++;
      if (seen.insert(e.fn.get()).second) stack.push_back(e.fn.get());
    }
  }

  BackwardStreams streams;
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, WalkOrder> ready;
  std::unordered_set<Node*> queued;
  for (auto& r : roots)
    if (deps[r.get()] == 0 && queued.insert(r.get()).second) ready.push(r);
  while (!ready.empty()) {
    std::shared_ptr<Node> n = ready.top();
    ready.pop();
    std::vector<Tensor> d_out = std::move(grads[n.get()]);
    grads.erase(n.get());
    d_out.resize(n->out_shapes.size());
    streams.before_run(*n, d_out);
    for (size_t i = 0; i < d_out.size(); ++i)  // outputs nobody used get zero cotangents
      if (!d_out[i].defined()) d_out[i] = Tensor::zeros(n->out_shapes[i], n->out_dtypes[i], n->device);
    std::vector<Tensor> d_in = n->backward(std::move(d_out));
    streams.after_run(*n);
    if (!retain_graph) streams.release(n);
    FLOWMOE_CHECK(d_in.size() == n->next.size(), Error, n->name(), ": vjp returned ", d_in.size(), " gradients for ",
                  n->next.size(), " inputs");
    for (size_t i = 0; i < d_in.size(); ++i) {
      const Edge& e = n->next[i];
      if (e.leaf) {
        // A leaf's first gradient is copied unless nothing else refers to it: vjps may hand the same
        // tensor to several inputs, and optimizers may change .grad() in place. A fresh result (an
        // expert weight's wgrad) is taken as is, saving a full copy of it.
        if (d_in[i].defined()) streams.before_accumulate(e.leaf.get(), e.leaf->grad.defined(), true);
        d_in[i] = as_leaf_grad(*e.leaf, std::move(d_in[i]));
        if (!e.leaf->grad.defined() && d_in[i].defined())
          e.leaf->grad = d_in[i].is_sole_owner() ? std::move(d_in[i]) : d_in[i].clone();
        else
          accumulate(e.leaf->grad, d_in[i]);
        if (hooked && --leaf_deps[e.leaf.get()] == 0) g_leaf_hook(*e.leaf);
      } else if (e.fn) {
        auto& slot = grads[e.fn.get()];
        slot.resize(e.fn->out_shapes.size());
        if (d_in[i].defined()) streams.before_accumulate(e.fn.get(), slot[size_t(e.output_nr)].defined(), false);
        accumulate(slot[size_t(e.output_nr)], d_in[i]);
        if (--deps[e.fn.get()] == 0) ready.push(e.fn);
      }
    }
  }
}

void Variable::backward(const Tensor& d, bool retain_graph) const {
  Tensor g = d;
  if (!g.defined()) {
    FLOWMOE_CHECK(data().numel() == 1, ShapeError, "backward() without a gradient needs a one-element output, got ",
                  data().describe());
    g = Tensor::full(shape(), 1.0, dtype(), device());
  }
  flowmoe::backward({*this}, {g}, retain_graph);
}

// ---- checkpoint -------------------------------------------------------------------------------

struct CheckpointNode : Node {
  CheckpointFn fn;
  std::vector<Tensor> saved_inputs;
  std::vector<bool> input_requires_grad;  // the recompute's ops take the forward's scope (Node::scope)
  bool released = false;
  std::string name() const override { return "checkpoint"; }
  std::vector<Tensor> backward(std::vector<Tensor> d_outputs) override {
    FLOWMOE_CHECK(!released, Error, "backward through a checkpoint a second time (pass retain_graph = true)");
    EnableGradGuard grad_on;  // recompute with recording on, then backprop the fresh graph
    std::vector<Variable> fresh;
    for (size_t i = 0; i < saved_inputs.size(); ++i)
      fresh.push_back(saved_inputs[i].defined() ? Variable(saved_inputs[i], input_requires_grad[i]) : Variable());
    std::vector<Variable> outs;
    {
      ProfileScope in_scope(scope, /*nested=*/false);
      EvalPhaseGuard phase(OpPhase::recompute);
      outs = fn(fresh);
    }
    FLOWMOE_CHECK(outs.size() == d_outputs.size(), Error, "checkpoint: recompute gave ", outs.size(),
                  " outputs, forward gave ", d_outputs.size());
    flowmoe::backward(std::move(outs), std::move(d_outputs), false);
    std::vector<Tensor> d_in;
    for (auto& v : fresh) d_in.push_back(v.defined() ? v.grad() : Tensor());
    return d_in;
  }
  void release() override {
    saved_inputs.clear();
    released = true;
  }
};

std::vector<Variable> checkpoint(CheckpointFn fn, const std::vector<Variable>& inputs) {
  std::vector<Tensor> outs;
  {
    NoGradGuard no_grad;
    for (auto& v : fn(inputs)) outs.push_back(v.data());
  }
  if (!grad_enabled()) return wrap_outputs(outs, nullptr);
  // Recorded even when no input requires grad: fn may use parameters that do.
  auto node = std::make_shared<CheckpointNode>();
  node->fn = std::move(fn);
  if (profiling()) node->scope = profile_scope();
  mark_order(*node, false);
  for (const Variable& v : inputs) {
    node->next.push_back(edge_of(v));
    node->saved_inputs.push_back(v.defined() ? v.data() : Tensor());
    node->input_requires_grad.push_back(v.defined() && v.requires_grad());
    if (v.defined()) node->device = v.device();
  }
  if (!outs.empty()) node->device = outs[0].device();
  return wrap_outputs(outs, node);
}

}  // namespace flowmoe
