// `flowmoe walkthrough`: one small fp8_flow MoE layer on the CPU, forward then backward, printed step
// by step (docs/WALKTHROUGH.md follows its output). The steps call the engine's ops in the order
// MoeLayer::forward does (layers/moe.cpp), each on fresh leaf Variables so that the gradient between
// two steps can be printed; the "check" step then runs MoeLayer::forward and backward itself on the
// same weights and inputs and compares every output and gradient bit for bit.
// Files: examples/walkthrough.cpp (options, set-up, formatting), examples/walkthrough_forward.cpp,
// examples/walkthrough_backward.cpp (with the layer check and the recipes' casts).
// Test: tests/test_walkthrough.cpp.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/ops/permute.h"
#include "engine/ops/quantize.h"
#include "engine/ops/router.h"
#include "layers/moe.h"
#include "parallel/dispatch.h"

namespace flowmoe {

int cmd_walkthrough(int argc, char** argv);

namespace walk {

constexpr int64_t kTokens = 8;

// Everything the steps hand to each other. Forward values are Variables on leaves of their own
// (suffix _in): a step's backward fills the grad() of its _in leaves, which the step before reads.
struct State {
  uint64_t seed = 1;
  ModelConfig cfg;
  MoeOptions options;
  std::unique_ptr<ParamFactory> factory;  // the layer's parameters, in creation order
  std::unique_ptr<MoeLayer> layer;
  Variable gate, fc1, fc2;  // mlp.gate.weight, mlp.experts.fc1.weight, mlp.experts.fc2.weight
  Tensor x, dy;             // the batch and the gradient that arrives from above
  RouterConfig router;
  QuantizedWeight w1q, w2q;

  // forward
  Variable x_router, x_quant, x_shared;  // three leaves holding x, one per consumer
  RouterOutput r;
  Variable xq, xq_in, prob_in;
  PermuteResult p;
  std::vector<int64_t> counts;  // padded tokens per expert, on the host
  Dispatched d;                 // what dispatch handed to the experts (its routing is p)
  Variable rows_in, h, h_in, probs_in, a, a_in, out, out_in, y_routed, y_combined, y_routed_in, y_shared, y;

  // backward
  Tensor dx_shared, d_out, d_a, d_h, d_probs, d_rows, dx_routed, d_topk_prob, dx_router, dx;
  std::vector<Tensor> grads;  // each parameter's gradient after the walk's backward
};

// Output of one step, printed only when the step was asked for.
class Printer {
 public:
  explicit Printer(bool on) : on_(on) {}
  bool on() const { return on_; }
  void line(const char* fmt, ...) const __attribute__((format(printf, 2, 3)));
  // head, then the items joined by "; ", wrapped at 100 columns under a 7-space indent.
  void list(const std::string& head, const std::vector<std::string>& items) const;

 private:
  bool on_;
};

// ---- formatting -------------------------------------------------------------------------------
void append(std::string& s, const char* sep, const std::string& item);         // sep first unless s is empty
std::string dims(const Tensor& t);                                             // "e4m3 [80,256]"
std::string num(double v);                                                     // "%.4g"
std::string fixed(double v);                                                   // "%.4f"
std::string pow2(float s);                                                     // "2^-7", "1", "NaN"
std::string values(const Tensor& t, int64_t row, int64_t col = 0, int n = 4);  // row's entries col.. col+n-1
std::string codes(const Tensor& q, int64_t row, int n = 4);                    // "0x3a 0xb4 ..." of an FP8 row
std::string scales_of_row(const Tensor& q, int64_t row);  // the scale_inv of one row as powers of two
std::string ints(const Tensor& t);                        // all entries of an integer tensor
std::string cast_summary();                               // "2 (quantize dispatch: x; ...)"
int site_order(const std::string& where);                 // rank of a cast site in one step's order
bool same_bits(const Tensor& a, const Tensor& b);         // same dtype, shape, bytes and scales
Variable leaf(const Tensor& t);                           // a fresh leaf that wants a gradient
int64_t row0(const State& s);                             // the permuted row of token 0's first expert
int64_t pad_row(const State& s);                          // the last pad row of the first padded expert
bool all_zero(const Tensor& t, int64_t row);              // every value of the row is zero

// ---- the steps (forward in walkthrough_forward.cpp, backward in walkthrough_backward.cpp) ------
void router(State& s, const Printer& out);
void quantize(State& s, const Printer& out);
void dispatch(State& s, const Printer& out);
void permute(State& s, const Printer& out);
void fc1(State& s, const Printer& out);
void swiglu(State& s, const Printer& out);
void fc2(State& s, const Printer& out);
void unpermute(State& s, const Printer& out);
void combine(State& s, const Printer& out);
void shared(State& s, const Printer& out);
void dy_split(State& s, const Printer& out);
void combine_backward(State& s, const Printer& out);
void fc2_backward(State& s, const Printer& out);
void swiglu_backward(State& s, const Printer& out);
void fc1_backward(State& s, const Printer& out);
void permute_backward(State& s, const Printer& out);
void quantize_backward(State& s, const Printer& out);
void router_backward(State& s, const Printer& out);
void dx_sum(State& s, const Printer& out);
void layer_check(State& s, const Printer& out);
void recipe_casts(State& s, const Printer& out);

}  // namespace walk
}  // namespace flowmoe
