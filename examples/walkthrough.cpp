// `flowmoe walkthrough` (see examples/walkthrough.h): the options, the layer and the batch (the
// setup step), the table of steps and the formatting functions the steps print with.
#include "examples/walkthrough.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "engine/cast_stats.h"
#include "kernels/common/error.h"

namespace flowmoe {
namespace walk {

// ---- formatting -------------------------------------------------------------------------------

void Printer::line(const char* fmt, ...) const {
  if (!on_) return;
  va_list ap;
  va_start(ap, fmt);
  std::vprintf(fmt, ap);
  va_end(ap);
  std::putchar('\n');
}

void Printer::list(const std::string& head, const std::vector<std::string>& items) const {
  std::string l = head;
  if (l.size() < 6) l.resize(6, ' ');
  for (size_t i = 0; i < items.size(); ++i) {
    const std::string item = items[i] + (i + 1 < items.size() ? ";" : "");
    if (l.size() > 7 && l.size() + 1 + item.size() > 100) {
      line("%s", l.c_str());
      l = std::string(6, ' ');
    }
    l += ' ';
    l += item;
  }
  line("%s", l.c_str());
}

void append(std::string& s, const char* sep, const std::string& item) {
  if (!s.empty()) s += sep;
  s += item;
}

std::string dims(const Tensor& t) {
  std::string s;
  for (int d = 0; d < t.dim(); ++d) append(s, ",", std::to_string(t.size(d)));
  return std::string(dtype_name(t.dtype())) + " [" + s + "]";
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4g", v);
  return b;
}

std::string fixed(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.4f", v);
  return b;
}

std::string pow2(float s) {
  if (s != s) return "NaN";
  if (s == 1.f) return "1";
  return "2^" + std::to_string(std::ilogb(s));
}

std::string values(const Tensor& t, int64_t row, int64_t col, int n) {
  const std::vector<float> v = (is_fp8(t.dtype()) ? dequantize_tensor(t, DType::f32, "") : t).to_floats();
  const int64_t width = t.size(-1);
  std::string s;
  for (int i = 0; i < n; ++i) append(s, " ", num(v[size_t(row * width + col + i)]));
  return s;
}

std::string codes(const Tensor& q, int64_t row, int n) {
  const auto* b = static_cast<const uint8_t*>(q.raw_data()) + row * q.size(-1);
  std::string s;
  char c[8];
  for (int i = 0; i < n; ++i) {
    std::snprintf(c, sizeof c, "%s0x%02x", i ? " " : "", b[i]);
    s += c;
  }
  return s;
}

std::string scales_of_row(const Tensor& q, int64_t row) {
  const Tensor& si = q.fp8_scales()->scale_inv;
  const std::vector<float> v = si.to_floats();
  std::string s;
  for (int64_t b = 0; b < si.size(-1); ++b) append(s, " ", pow2(v[size_t(row * si.size(-1) + b)]));
  return s;
}

std::string ints(const Tensor& t) {
  std::string s;
  for (int64_t v : t.to_ints()) append(s, " ", std::to_string(v));
  return s;
}

int site_order(const std::string& where) {
  static const char* const kOrder[] = {"dispatch: x",       "fprop: x", "combine backward: dy", "dgrad: dy rowwise",
                                       "wgrad: dy colwise", "wgrad: x", "wgrad: x colwise"};
  int i = 0;
  while (i < 7 && where != kOrder[i]) ++i;
  return i;
}

std::string cast_summary() {
  const CastCounts c = cast_counts();
  std::vector<std::pair<int, std::string>> sites;
  for (const auto& [site, n] : c.by_site)
    if (site.rfind("weight_quantize", 0) != 0) sites.push_back({site_order(site.substr(site.find(' ') + 1)), site});
  std::sort(sites.begin(), sites.end());
  std::string list;
  for (const auto& site : sites) append(list, "; ", site.second);
  return std::to_string(c.activation_casts()) + (list.empty() ? "" : " (" + list + ")");
}

bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  if (std::memcmp(ca.raw_data(), cb.raw_data(), ca.nbytes()) != 0) return false;
  const bool scaled = a.fp8_scales() != nullptr;
  if (scaled != (b.fp8_scales() != nullptr)) return false;
  return !scaled || same_bits(a.fp8_scales()->scale_inv, b.fp8_scales()->scale_inv);
}

Variable leaf(const Tensor& t) { return Variable(t, true); }

// The permuted row of token 0's first expert, the row the steps below print.
int64_t row0(const State& s) { return s.p.row_map.to_ints()[0]; }

int64_t pad_row(const State& s) {
  const std::vector<int64_t> tokens = s.p.tokens_per_expert.to_ints(), seg = s.p.segment_starts.to_ints();
  for (size_t e = 0; e < tokens.size(); ++e)
    if (s.counts[e] > tokens[e]) return seg[e + 1] - 1;
  return seg.back();  // no pad row (every count a multiple of align_size): the first tail row
}

bool all_zero(const Tensor& t, int64_t row) {
  const std::vector<float> v = (is_fp8(t.dtype()) ? dequantize_tensor(t, DType::f32, "") : t).to_floats();
  for (int64_t j = 0; j < t.size(-1); ++j)
    if (v[size_t(row * t.size(-1) + j)] != 0.f) return false;
  return true;
}

namespace {

// ---- the layer and the batch ------------------------------------------------------------------

void setup(State& s, const Printer& out) {
  ModelConfig& c = s.cfg;
  c.hidden_size = 256, c.n_routed_experts = 4, c.num_experts_per_tok = 2, c.moe_intermediate_size = 128;
  c.n_shared_experts = 1, c.num_hidden_layers = 1;
  s.options = MoeOptions(16);
  s.options.recipe = MoeRecipe::fp8_flow;
  s.options.recompute_expert = true;
  s.factory = std::make_unique<ParamFactory>(s.seed, Device::cpu());
  s.layer = std::make_unique<MoeLayer>(*s.factory, c, "mlp", s.options, Device::cpu());
  const std::vector<Variable>& params = s.factory->params();
  s.gate = params[0], s.fc1 = params[1], s.fc2 = params[2];
  // A bias as balancing leaves it after some steps: it only steers which experts win.
  float* bias = s.layer->expert_bias().data().data<float>();
  const float kBias[] = {0.02f, 0.f, -0.02f, 0.f};
  std::memcpy(bias, kBias, sizeof kBias);
  Rng rng(s.seed + 1);
  s.x = rng.normal({kTokens, c.hidden_size}, 0.0, 1.0);
  s.dy = rng.normal({kTokens, c.hidden_size}, 0.0, 1.0);
  s.router = router_config(c);
  reset_cast_counts();
  out.line("flowmoe walkthrough: one fp8_flow MoE layer on the CPU, seed %llu", (unsigned long long)s.seed);
  out.line("layer  T %lld tokens, H %lld, E %lld routed experts, top-%lld, F %lld, %lld shared expert, align_size %d,",
           (long long)kTokens, (long long)c.hidden_size, (long long)c.n_routed_experts,
           (long long)c.num_experts_per_tok, (long long)c.moe_intermediate_size, (long long)c.n_shared_experts,
           s.options.align_size);
  out.line("       recompute moe_expert; high precision is f32 here (bf16 on a GPU); FP8 is e4m3");
  std::vector<std::string> items;
  for (const Variable& p : params) items.push_back(p.name() + " " + dims(p.data()));
  out.list("params", items);
  out.line("bias   %s %s = %s (a buffer: no gradient)", s.layer->expert_bias().name().c_str(),
           dims(s.layer->expert_bias().data()).c_str(), values(s.layer->expert_bias().data(), 0).c_str());
  out.line("x      %s ~ N(0,1), x[0,0:4] = %s", dims(s.x).c_str(), values(s.x, 0).c_str());
  out.line("dy     %s ~ N(0,1), the gradient from above, dy[0,0:4] = %s", dims(s.dy).c_str(), values(s.dy, 0).c_str());
}

struct Step {
  const char* name;
  const char* title;
  void (*run)(State&, const Printer&);
};

const Step kSteps[] = {
    {"setup", "the layer and the batch", setup},
    {"router", "forward 1 [router]: scores and top-2", router},
    {"quantize", "forward 2 [quantize]: x quantized once (cast 1)", quantize},
    {"dispatch", "forward 3 [dispatch]", dispatch},
    {"permute", "forward 4 [permute]: permute + pad", permute},
    {"fc1", "forward 5 [fc1]: FP8 grouped GEMM, under checkpoint", fc1},
    {"swiglu", "forward 6 [swiglu]: SwiGLU x prob + quantize, under checkpoint", swiglu},
    {"fc2", "forward 7 [fc2]: FP8 grouped GEMM", fc2},
    {"unpermute", "forward 8 [unpermute]: unpermute + unpad", unpermute},
    {"combine", "forward 9 [combine]", combine},
    {"shared", "forward 10 [shared]: + shared expert", shared},
    {"dy", "backward 1 [dy]: dy splits; the shared expert's backward", dy_split},
    {"combine-bwd", "backward 2 [combine-bwd]: dy quantized once (cast 2) and dispatched", combine_backward},
    {"fc2-bwd", "backward 3 [fc2-bwd]: fc2's wgrad and dgrad", fc2_backward},
    {"swiglu-bwd", "backward 4 [swiglu-bwd]: SwiGLU x prob's backward", swiglu_backward},
    {"fc1-bwd", "backward 5 [fc1-bwd]: recompute, then fc1's wgrad and dgrad", fc1_backward},
    {"permute-bwd", "backward 6 [permute-bwd]: permute's backward", permute_backward},
    {"quantize-bwd", "backward 7 [quantize-bwd]: straight through", quantize_backward},
    {"router-bwd", "backward 8 [router-bwd]: the router's backward", router_backward},
    {"dx", "backward 9 [dx]: x's gradient", dx_sum},
    {"check", "[check] MoeLayer itself on the same batch", layer_check},
    {"casts", "[casts] casts per layer per step in each recipe", recipe_casts},
};

// The step names, comma-separated; with wrap, on lines of at most 6 names indented for the help text.
std::string step_names(bool wrap = false) {
  std::string s;
  int n = 0;
  for (const Step& st : kSteps) {
    append(s, wrap && n % 6 == 0 ? ",\n                " : ", ", st.name);
    ++n;
  }
  return s;
}

const char* kHelp = R"(usage: flowmoe walkthrough [--step NAME] [--seed N]

Builds one small fp8_flow MoE layer on the CPU (8 tokens, hidden 256, 4 routed experts, top-2,
expert width 128, 1 shared expert, align_size 16, recompute moe_expert), runs its forward and
backward on a seeded batch with the engine's ops, and prints each step: the math, the code that runs
it, shapes, dtypes and scales, a few values and the cast counter. Then it runs MoeLayer itself on the
same batch and checks that every output and gradient is bit-identical. docs/WALKTHROUGH.md explains
the output. The same seed gives the same output on every run.

options:
  --step NAME   print one step only (all steps still run); NAME is one of
                %s
  --seed N      weights and batch seed (default 1)
  -h, --help    this text
)";

}  // namespace
}  // namespace walk

int cmd_walkthrough(int argc, char** argv) {
  using namespace walk;
  std::string only;
  State s;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i], v;
    const size_t eq = a.find('=');
    const bool inline_value = a.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) v = a.substr(eq + 1), a = a.substr(0, eq);
    if (a == "-h" || a == "--help") {
      std::printf(kHelp, step_names(true).c_str());
      return 0;
    }
    if (a != "--step" && a != "--seed")
      FLOWMOE_THROW(ConfigError, "walkthrough: unknown argument '", a, "' (see flowmoe walkthrough --help)");
    if (!inline_value) {
      if (i + 1 >= argc) FLOWMOE_THROW(ConfigError, "walkthrough: ", a, " needs a value");
      v = argv[++i];
    }
    if (a == "--step") {
      only = v;
      bool known = false;
      for (const Step& st : kSteps) known = known || only == st.name;
      if (!known) FLOWMOE_THROW(ConfigError, "walkthrough: unknown step '", only, "' (steps: ", step_names(), ")");
    } else {
      char* end = nullptr;
      errno = 0;
      s.seed = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || v[0] == '-' || errno == ERANGE)
        FLOWMOE_THROW(ConfigError, "walkthrough: --seed needs a non-negative integer, got '", v, "'");
    }
  }
  bool first = true;
  for (const Step& st : kSteps) {
    const Printer out(only.empty() || only == st.name);
    if (out.on() && std::strcmp(st.name, "setup") != 0) {
      if (only.empty() && !first) out.line("%s", "");
      out.line("== %s ==", st.title);
    }
    st.run(s, out);
    first = false;
  }
  return 0;
}

}  // namespace flowmoe
