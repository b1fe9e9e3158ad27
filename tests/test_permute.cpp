// permute_pad: the CPU op against a plain per-expert loop reference (token ids encoded in the
// payload, so a wrong row is named), edge cases, bad input, gradient checks, and CUDA vs CPU
// (bit-identical buffers, with the device memory poisoned first so unwritten pad rows show), over
// shapes that reach every vector width and both routing-map paths of kernels/cuda/permute.cu.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>

#include "engine/ops/permute.h"
#include "tests/support/checks.h"

using namespace flowmoe;
using namespace flowmoe::test;

namespace {

// x[t,h] = t*1024 + h%1024: exact in f32, so any row names the token it came from.
Tensor token_payload(int64_t num_tokens, int64_t hidden) {
  std::vector<float> v;
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) v.push_back(float(t * 1024 + h % 1024));
  return Tensor::from_floats(v, {num_tokens, hidden});
}

// The reference: for each local expert, its (token, slot) pairs in ascending order, then pad rows.
struct RefRouting {
  std::vector<int64_t> row_map, tokens, padded, seg;
  std::vector<int64_t> src_entry;  // per buffer row: flat entry t*k+j, -1 for pad and tail rows
};
RefRouting reference_routing(const Tensor& topk_idx, int expert_offset, int num_local, int align, int64_t num_rows) {
  const std::vector<int64_t> idx = topk_idx.to_ints();
  RefRouting r;
  r.row_map.assign(idx.size(), -1);
  r.src_entry.assign(size_t(num_rows), -1);
  r.seg.push_back(0);
  for (int e = 0; e < num_local; ++e) {
    int64_t count = 0;
    for (size_t i = 0; i < idx.size(); ++i)
      if (idx[i] == expert_offset + e) {
        r.row_map[i] = r.seg.back() + count;
        r.src_entry[size_t(r.seg.back() + count)] = int64_t(i);
        ++count;
      }
    r.tokens.push_back(count);
    r.padded.push_back((count + align - 1) / align * align);
    r.seg.push_back(r.seg.back() + r.padded.back());
  }
  return r;
}

::testing::AssertionResult ints_equal(const Tensor& got, const std::vector<int64_t>& want, const char* what) {
  std::vector<int64_t> g = got.to_ints();
  if (g.size() != want.size())
    return ::testing::AssertionFailure() << what << ": " << g.size() << " entries, want " << want.size();
  for (size_t i = 0; i < g.size(); ++i)
    if (g[i] != want[i])
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << g[i] << ", want " << want[i];
  return ::testing::AssertionSuccess();
}

// Checks every output of a permute of token_payload(T,H) against the reference, naming wrong rows.
::testing::AssertionResult matches_reference(const PermuteResult& p, const Tensor& topk_idx, const Tensor& prob,
                                             int expert_offset, int num_local, int align, int64_t hidden) {
  const int64_t num_rows = p.rows.size(0), top_k = topk_idx.size(1);
  RefRouting ref = reference_routing(topk_idx, expert_offset, num_local, align, num_rows);
  for (auto r : {ints_equal(p.row_map, ref.row_map, "row_map"), ints_equal(p.tokens_per_expert, ref.tokens, "tokens"),
                 ints_equal(p.padded_tokens_per_expert, ref.padded, "padded"),
                 ints_equal(p.segment_starts, ref.seg, "segment_starts")})
    if (!r) return r;
  if (ref.seg.back() > num_rows)
    return ::testing::AssertionFailure() << "buffer of " << num_rows << " rows for " << ref.seg.back() << " padded";
  std::vector<float> rows = p.rows.data().to_floats(), probs = p.probs.data().to_floats(), pr = prob.to_floats();
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t entry = ref.src_entry[size_t(r)], want_token = entry >= 0 ? entry / top_k : -1;
    for (int64_t h = 0; h < hidden; ++h) {
      const float got = rows[size_t(r * hidden + h)];
      const float want = entry >= 0 ? float(want_token * 1024 + h % 1024) : 0.f;
      if (got != want) {
        auto f = ::testing::AssertionFailure() << "row " << r << " column " << h << " holds " << got << " (token "
                                               << std::floor(got / 1024) << "), want ";
        return entry >= 0 ? f << "token " << want_token : f << "a zero pad row";
      }
    }
    const float want_prob = entry >= 0 ? pr[size_t(entry)] : 0.f;
    if (probs[size_t(r)] != want_prob)
      return ::testing::AssertionFailure() << "probs[" << r << "] = " << probs[size_t(r)] << ", want " << want_prob;
  }
  return ::testing::AssertionSuccess();
}

struct Case {
  int64_t num_tokens;
  int top_k, num_experts, expert_offset, num_local, align;
  int64_t hidden;
};

void run_reference_case(std::mt19937_64& gen, Rng& rng, const Case& c, std::vector<int> allowed = {}) {
  SCOPED_TRACE(::testing::Message() << "T " << c.num_tokens << " k " << c.top_k << " E " << c.num_experts << " local ["
                                    << c.expert_offset << ", +" << c.num_local << ") align " << c.align << " H "
                                    << c.hidden);
  Tensor idx = random_topk(gen, c.num_tokens, c.top_k, c.num_experts, allowed);
  Tensor x = token_payload(c.num_tokens, c.hidden), prob = random_tensor(rng, {c.num_tokens, c.top_k});
  PermuteResult p = permute_pad(Variable(x), idx, Variable(prob), c.num_experts, c.align, c.expert_offset, c.num_local);
  EXPECT_EQ(p.rows.size(0), permute_worst_case_rows(c.num_tokens, c.top_k, c.num_local, c.align));
  EXPECT_TRUE(matches_reference(p, idx, prob, c.expert_offset, c.num_local, c.align, c.hidden));
}

}  // namespace

TEST(Permute, MatchesReference) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (Case c : {Case{37, 2, 5, 0, 5, 16, 24}, Case{100, 4, 8, 0, 8, 32, 130}, Case{64, 8, 16, 0, 16, 128, 64},
                 Case{200, 3, 12, 0, 12, 64, 5}, Case{1, 1, 1, 0, 1, 16, 3}})
    run_reference_case(gen, rng, c);
}

TEST(Permute, OnlyThisRanksExpertsAreRouted) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  run_reference_case(gen, rng, Case{90, 4, 12, 4, 4, 16, 8});                // rank 1 of 3
  run_reference_case(gen, rng, Case{50, 2, 12, 8, 4, 32, 8});                // last rank
  run_reference_case(gen, rng, Case{20, 2, 12, 0, 4, 16, 8}, {5, 6, 7, 8});  // nothing routed here
}

TEST(Permute, EdgeCases) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  run_reference_case(gen, rng, Case{0, 2, 4, 0, 4, 16, 8});                    // zero tokens
  run_reference_case(gen, rng, Case{40, 2, 6, 0, 6, 16, 8}, {0, 1, 3, 4, 5});  // expert 2 gets no token
  run_reference_case(gen, rng, Case{300, 1, 4, 0, 4, 32, 8}, {3});             // all tokens on one expert
  run_reference_case(gen, rng, Case{77, 1, 8, 0, 8, 16, 16});                  // k = 1
  run_reference_case(gen, rng, Case{33, 2, 4, 0, 4, 128, 200});                // H not a multiple of 128
  run_reference_case(gen, rng, Case{13, 3, 5, 0, 5, 16, 4});                   // T*k = 39, not a multiple of 16
}

TEST(Permute, ExactSizeFromCallerCounts) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  Tensor idx = random_topk(gen, 50, 2, 4), x = token_payload(50, 8), prob = random_tensor(rng, {50, 2});
  int64_t total = permute_pad(Variable(x), idx, Variable(prob), 4, 16).segment_starts.to_ints().back();
  PermuteResult p = permute_pad(Variable(x), idx, Variable(prob), 4, 16, 0, -1, total);
  EXPECT_EQ(p.rows.size(0), total);
  EXPECT_TRUE(matches_reference(p, idx, prob, 0, 4, 16, 8));
  EXPECT_THROW(permute_pad(Variable(x), idx, Variable(prob), 4, 16, 0, -1, total - 1), ShapeError);
}

TEST(Permute, SidePayloadMovesWithTheRows) {
  std::mt19937_64 gen(test_seed());
  const int64_t num_tokens = 45, side_cols = 3;
  Tensor idx = random_topk(gen, num_tokens, 2, 6), x = token_payload(num_tokens, 4);
  std::vector<float> s;
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t c = 0; c < side_cols; ++c) s.push_back(float(t * 10 + c));
  Tensor side = Tensor::from_floats(s, {num_tokens, side_cols});
  PermuteResult p = permute_pad(Variable(x), idx, Variable(), 6, 32, 0, -1, -1, side, -2.0);
  EXPECT_FALSE(p.probs.defined());
  RefRouting ref = reference_routing(idx, 0, 6, 32, p.rows.size(0));
  std::vector<float> got = p.side_rows.to_floats();
  ASSERT_EQ(p.side_rows.shape(), (Shape{p.rows.size(0), side_cols}));
  for (int64_t r = 0; r < p.rows.size(0); ++r)
    for (int64_t c = 0; c < side_cols; ++c) {
      const int64_t e = ref.src_entry[size_t(r)];
      const float want = e >= 0 ? float((e / 2) * 10 + c) : -2.f;
      ASSERT_EQ(got[size_t(r * side_cols + c)], want) << "side row " << r << " column " << c;
    }
}

TEST(Permute, PayloadOfAnyDtypeMovesAsBytes) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  Tensor idx = random_topk(gen, 30, 3, 5), x = random_tensor(rng, {30, 7});
  PermuteResult ref = permute_pad(Variable(x), idx, Variable(), 5, 16);
  for (DType dt : {DType::bf16, DType::e4m3, DType::f64}) {
    SCOPED_TRACE(dtype_name(dt));
    PermuteResult p = permute_pad(Variable(x.to(dt)), idx, Variable(), 5, 16);
    EXPECT_TRUE(bit_equal(p.rows.data(), ref.rows.data().to(dt)));
  }
}

TEST(Permute, BadInputThrows) {
  Tensor x = Tensor::zeros({4, 8}, DType::f32), prob = Tensor::zeros({4, 2}, DType::f32);
  Tensor bad = Tensor::from_ints({0, 1, 2, 3, 1, 0, 3, 7}, {4, 2});
  try {
    permute_pad(Variable(x), bad, Variable(prob), 4, 16);
    ADD_FAILURE() << "an expert id of 7 with 4 experts was accepted";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("token 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("= 7"), std::string::npos) << msg;
  }
  Tensor negative = Tensor::from_ints({0, 1, -1, 3, 1, 0, 3, 2}, {4, 2});
  EXPECT_THROW(permute_pad(Variable(x), negative, Variable(prob), 4, 16), Error);
  Tensor good = Tensor::from_ints({0, 1, 2, 3, 1, 0, 3, 2}, {4, 2});
  for (int align : {0, 8, 24, 256}) EXPECT_THROW(permute_pad(Variable(x), good, Variable(prob), 4, align), Error);
  EXPECT_THROW(permute_pad(Variable(x), good, Variable(prob), 4, 16, 2, 3), Error);  // experts [2, 5) of 4
  EXPECT_THROW(permute_pad(Variable(x), good.to(DType::i64), Variable(prob), 4, 16), DTypeError);
  EXPECT_THROW(permute_pad(Variable(x), good, Variable(Tensor::zeros({4, 3}, DType::f32)), 4, 16), ShapeError);
  EXPECT_THROW(permute_pad(Variable(Tensor::zeros({5, 8}, DType::f32)), good, Variable(prob), 4, 16), ShapeError);
}

TEST(Permute, BackwardMatchesLoop) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  const int64_t num_tokens = 29, hidden = 6;
  const int top_k = 3, num_experts = 7;
  Tensor idx = random_topk(gen, num_tokens, top_k, num_experts, {0, 1, 2, 4, 5, 6});
  Variable x(random_tensor(rng, {num_tokens, hidden}), true), prob(random_tensor(rng, {num_tokens, top_k}), true);
  PermuteResult p = permute_pad(x, idx, prob, num_experts, 16, 2, 4);  // experts [2, 6): some slots go elsewhere
  Tensor d_rows = random_tensor(rng, p.rows.shape()), d_probs = random_tensor(rng, p.probs.shape());
  backward({p.rows, p.probs}, {d_rows, d_probs});
  std::vector<int64_t> rm = p.row_map.to_ints();
  std::vector<float> dr = d_rows.to_floats(), dp = d_probs.to_floats(), want_x, want_p;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < hidden; ++h) {
      float s = 0;
      for (int j = 0; j < top_k; ++j)
        if (rm[size_t(t * top_k + j)] >= 0) s += dr[size_t(rm[size_t(t * top_k + j)] * hidden + h)];
      want_x.push_back(s);
    }
    for (int j = 0; j < top_k; ++j)
      want_p.push_back(rm[size_t(t * top_k + j)] >= 0 ? dp[size_t(rm[size_t(t * top_k + j)])] : 0.f);
  }
  EXPECT_TRUE(bit_equal(x.grad(), Tensor::from_floats(want_x, {num_tokens, hidden})));
  EXPECT_TRUE(bit_equal(prob.grad(), Tensor::from_floats(want_p, {num_tokens, top_k})));
}

TEST(Permute, Gradcheck) {
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  Tensor idx = random_topk(gen, 7, 2, 5);
  Tensor x = random_tensor(rng, {7, 3}, DType::f64), prob = random_tensor(rng, {7, 2}, DType::f64);
  auto rows = [](const std::vector<Variable>& v) { return permute_pad(v[0], v[1].data(), v[2], 5, 16).rows; };
  auto probs = [](const std::vector<Variable>& v) { return permute_pad(v[0], v[1].data(), v[2], 5, 16, 1, 3).probs; };
  EXPECT_TRUE(gradcheck(rows, {x, idx, prob}, 1e-6, 1e-5, {0}));
  EXPECT_TRUE(gradcheck(probs, {x, idx, prob}, 1e-6, 1e-5, {2}));
}

// ---- CUDA ---------------------------------------------------------------------------------------

namespace {

// Fills a device block of this many bytes with NaN and frees it: the caching allocator hands it to the
// next allocation of the same size, so rows a kernel forgets to write show up.
void poison_device_block(const Shape& shape, DType dtype) {
  const int64_t bytes = shape_numel(shape) * int64_t(dtype_size(dtype));
  Tensor t = Tensor::full({(bytes + 3) / 4}, NAN, DType::f32, Device::cuda());
}

struct CudaCase {
  int64_t num_tokens;
  int top_k, num_experts, expert_offset, num_local, align;
  int64_t hidden;
  DType dtype;
  int64_t side_cols;
};

// permute_pad_cuda with an explicit row kernel, on the buffers the op allocates for cpu's routing
// (cpu.dims); the rows are allocated first, so a block poisoned just before becomes them.
PermuteResult permute_with_row_kernel(const PermuteResult& cpu, const Tensor& gx, const Tensor& gidx,
                                      const Tensor& gprob, const Tensor& gside, float side_pad_value,
                                      PermuteRowKernel row_kernel) {
  const RoutingDims& d = cpu.dims;
  const Device dev = gx.device();
  PermuteResult r;
  r.dims = d;
  Tensor rows = Tensor::empty({d.num_rows, gx.size(1)}, gx.dtype(), dev);
  Tensor probs = Tensor::empty({d.num_rows}, DType::f32, dev);
  r.row_map = Tensor::empty(gidx.shape(), DType::i32, dev);
  r.tokens_per_expert = Tensor::empty({d.num_local_experts}, DType::i32, dev);
  r.padded_tokens_per_expert = Tensor::empty({d.num_local_experts}, DType::i32, dev);
  r.segment_starts = Tensor::empty({d.num_local_experts + 1}, DType::i32, dev);
  Tensor workspace = Tensor::empty({int64_t(permute_workspace_bytes(d))}, DType::u8, dev);
  PermuteBuffers b;
  b.topk_idx = gidx.data<int32_t>();
  b.x = gx.raw_data();
  b.row_bytes = size_t(gx.size(1)) * dtype_size(gx.dtype());
  b.topk_prob = gprob.data<float>();
  b.probs = probs.data<float>();
  if (gside.defined()) {
    r.side_rows = Tensor::empty({d.num_rows, gside.size(1)}, DType::f32, dev);
    b.side = gside.data<float>();
    b.side_cols = int(gside.size(1));
    b.side_pad_value = side_pad_value;
    b.side_rows = r.side_rows.data<float>();
  }
  b.rows = rows.raw_data();
  b.row_map = r.row_map.data<int32_t>();
  b.tokens_per_expert = r.tokens_per_expert.data<int32_t>();
  b.padded_tokens_per_expert = r.padded_tokens_per_expert.data<int32_t>();
  b.segment_starts = r.segment_starts.data<int32_t>();
  b.workspace = workspace.raw_data();
  permute_pad_cuda(d, b, current_stream(dev.index), row_kernel);
  r.rows = Variable(rows);
  r.probs = Variable(probs);
  return r;
}

}  // namespace

TEST(PermuteCuda, BitIdenticalToCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  const CudaCase cases[] = {
      {0, 2, 4, 0, 4, 16, 64, DType::bf16, 0},  // zero tokens
      {1, 1, 1, 0, 1, 16, 8, DType::f32, 1},
      {37, 2, 5, 0, 5, 16, 100, DType::bf16, 0},      // H not a multiple of 128
      {333, 4, 16, 4, 8, 32, 37, DType::f32, 2},      // 4-byte vectors, experts of another rank
      {5000, 1, 3, 0, 3, 64, 33, DType::bf16, 0},     // 2-byte vectors, many chunks, k = 1
      {3000, 2, 8, 0, 8, 16, 48, DType::e4m3, 3},     // FP8 payload with scale rows
      {1000, 6, 64, 16, 16, 128, 7, DType::e4m3, 1},  // 1-byte vectors
      {2048, 8, 64, 0, 64, 128, 384, DType::bf16, 3},
      {700, 8, 300, 0, 300, 16, 16, DType::f32, 0},      // many experts
      {4096, 8, 64, 0, 64, 128, 2048, DType::bf16, 16},  // a benchmark-like shape
      {500, 4, 2000, 0, 2000, 16, 8, DType::f32, 0},     // shared-memory histogram above 48 KiB
      {40000, 8, 16, 0, 16, 16, 8, DType::f32, 1},       // 157 chunks: more than one per SM; many tokens per group
      {110000, 8, 16, 0, 16, 16, 8, DType::f32, 0},      // 430 chunks: several route_map blocks per SM
      {64, 4, 8, 0, 8, 16, 17000, DType::bf16, 2},       // rows of 2125 vectors: several passes per token
      // The routing map's fallback (route_count + route_scan + route_finalize): with L = 4096, route_map's
      // block takes 160 KiB of shared memory, so one fits per SM, and 300 chunks cannot all be resident
      // on a GPU of fewer than 300 SMs.
      {76800, 8, 4096, 0, 4096, 16, 8, DType::f32, 1},
  };
  for (const CudaCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "T " << c.num_tokens << " k " << c.top_k << " E " << c.num_experts << " align "
                                      << c.align << " H " << c.hidden << " " << dtype_name(c.dtype));
    Tensor idx = random_topk(gen, c.num_tokens, c.top_k, c.num_experts);
    Tensor x = random_tensor(rng, {c.num_tokens, c.hidden}).to(c.dtype),
           prob = random_tensor(rng, {c.num_tokens, c.top_k});
    Tensor side = c.side_cols ? random_tensor(rng, {c.num_tokens, c.side_cols}) : Tensor();
    PermuteResult cpu = permute_pad(Variable(x), idx, Variable(prob), c.num_experts, c.align, c.expert_offset,
                                    c.num_local, -1, side, 0.5);
    Tensor gx = x.to(Device::cuda()), gidx = idx.to(Device::cuda()), gprob = prob.to(Device::cuda());
    Tensor gside = side.defined() ? side.to(Device::cuda()) : Tensor();
    poison_device_block(cpu.rows.shape(), c.dtype);  // the next allocation (the rows) gets NaN bytes
    PermuteResult gpu = permute_pad(Variable(gx), gidx, Variable(gprob), c.num_experts, c.align, c.expert_offset,
                                    c.num_local, -1, gside, 0.5);
    EXPECT_TRUE(bit_equal(gpu.row_map, cpu.row_map));
    EXPECT_TRUE(bit_equal(gpu.tokens_per_expert, cpu.tokens_per_expert));
    EXPECT_TRUE(bit_equal(gpu.padded_tokens_per_expert, cpu.padded_tokens_per_expert));
    EXPECT_TRUE(bit_equal(gpu.segment_starts, cpu.segment_starts));
    EXPECT_TRUE(bit_equal(gpu.rows.data(), cpu.rows.data()));
    EXPECT_TRUE(bit_equal(gpu.probs.data(), cpu.probs.data()));
    if (side.defined()) {
      EXPECT_TRUE(bit_equal(gpu.side_rows, cpu.side_rows));
    }
  }
}

TEST(PermuteCuda, ExactSizeAndTokenPayload) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  Tensor idx = random_topk(gen, 900, 4, 12), x = token_payload(900, 130), prob = random_tensor(rng, {900, 4});
  const int64_t total = permute_pad(Variable(x), idx, Variable(prob), 12, 64).segment_starts.to_ints().back();
  Tensor gx = x.to(Device::cuda()), gidx = idx.to(Device::cuda()), gprob = prob.to(Device::cuda());
  poison_device_block({total, 130}, DType::f32);
  PermuteResult p = permute_pad(Variable(gx), gidx, Variable(gprob), 12, 64, 0, -1, total);
  PermuteResult host{Variable(p.rows.data().to(Device::cpu())),
                     Variable(p.probs.data().to(Device::cpu())),
                     p.row_map.to(Device::cpu()),
                     p.tokens_per_expert.to(Device::cpu()),
                     p.padded_tokens_per_expert.to(Device::cpu()),
                     p.segment_starts.to(Device::cpu()),
                     Tensor(),
                     64,
                     p.dims};
  EXPECT_TRUE(matches_reference(host, idx, prob, 0, 12, 64, 130));
}

TEST(PermuteCuda, BackwardMatchesCpu) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int64_t hidden : {int64_t(5), int64_t(256), int64_t(1000)}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " H " << hidden);
      const int64_t num_tokens = 300;
      Tensor idx = random_topk(gen, num_tokens, 4, 10);
      Tensor x = random_tensor(rng, {num_tokens, hidden}).to(dt).to(DType::f32);
      Tensor prob = random_tensor(rng, {num_tokens, 4});
      auto grads = [&](Device d, DType t) {
        Variable xv(x.to(t).to(d), true), pv(prob.to(d), true);
        PermuteResult p = permute_pad(xv, idx.to(d), pv, 10, 32, 2, 6);
        Rng r2(7);
        Tensor d_rows = r2.uniform(p.rows.shape(), -1, 1, DType::f32).to(dt).to(DType::f32).to(t).to(d);
        Tensor d_probs = r2.uniform(p.probs.shape(), -1, 1, DType::f32).to(d);
        backward({p.rows, p.probs}, {d_rows, d_probs});
        return std::make_pair(xv.grad(), pv.grad());
      };
      auto [cx, cp] = grads(Device::cpu(), DType::f32);
      auto [gx, gp] = grads(Device::cuda(), dt);
      EXPECT_TRUE(bit_equal(gx, cx.to(dt)));  // same order of fp32 adds, one rounding
      EXPECT_TRUE(bit_equal(gp, cp));
    }
  }
}

// Both row-move kernels of kernels/permute.h (classic; tma, sm_90 bulk copies), and automatic's choice between
// them, against the CPU reference, bit for bit, with the device rows poisoned first. The shapes reach
// every TMA block geometry: 8, 4 and 2 tokens per block, rows cut into 2 and 5 chunks (the stage ring
// refills), tokens routed to other ranks only, a wide top-k, a side payload, the worst-case tail, zero
// tokens, and rows that are not a multiple of 16 bytes (tma falls back to classic).
TEST(PermuteCuda, RowKernelsBitIdentical) {
  FLOWMOE_REQUIRE_CUDA();
  std::mt19937_64 gen(test_seed());
  Rng rng(test_seed());
  struct RowCase {
    CudaCase c;
    std::vector<int> allowed;  // experts drawn from (all when empty)
  };
  const RowCase cases[] = {
      {{0, 2, 4, 0, 4, 16, 64, DType::bf16, 0}, {}},               // zero tokens: only tail rows
      {{1, 1, 1, 0, 1, 16, 8, DType::f32, 1}, {}},                 // one 32-byte row
      {{37, 2, 5, 0, 5, 16, 100, DType::bf16, 0}, {}},             // 200-byte rows: classic either way
      {{1000, 6, 64, 16, 16, 128, 7, DType::e4m3, 1}, {}},         // 7-byte rows: classic either way
      {{333, 4, 16, 4, 8, 32, 36, DType::f32, 2}, {}},             // 144-byte rows, experts of other ranks
      {{3000, 2, 8, 0, 8, 16, 48, DType::e4m3, 3}, {}},            // FP8 payload with scale rows
      {{200, 32, 64, 0, 64, 16, 64, DType::f32, 0}, {}},           // k = 32: 8 tokens x 32 destinations
      {{2048, 8, 64, 0, 64, 128, 7168, DType::bf16, 56}, {}},      // 14 KiB rows: 2 tokens per block
      {{513, 8, 64, 16, 16, 128, 4096, DType::bf16, 0}, {}},       // 8 KiB rows, most slots elsewhere
      {{64, 4, 8, 0, 8, 16, 17000, DType::bf16, 2}, {}},           // 34000-byte rows: 2 chunks
      {{41, 3, 6, 2, 3, 64, 40000, DType::f32, 1}, {}},            // 160000-byte rows: 5 chunks, 2 stages
      {{29, 2, 8, 0, 4, 16, 40000, DType::f32, 0}, {4, 5, 6, 7}},  // nothing routed here: loads, no stores
      {{300, 1, 4, 0, 4, 32, 1024, DType::bf16, 1}, {3}},          // one hot expert, three empty
  };
  for (const RowCase& rc : cases) {
    const CudaCase& c = rc.c;
    SCOPED_TRACE(::testing::Message() << "T " << c.num_tokens << " k " << c.top_k << " E " << c.num_experts
                                      << " local [" << c.expert_offset << ", +" << c.num_local << ") align " << c.align
                                      << " H " << c.hidden << " " << dtype_name(c.dtype));
    Tensor idx = random_topk(gen, c.num_tokens, c.top_k, c.num_experts, rc.allowed);
    Tensor x = random_tensor(rng, {c.num_tokens, c.hidden}).to(c.dtype),
           prob = random_tensor(rng, {c.num_tokens, c.top_k});
    Tensor side = c.side_cols ? random_tensor(rng, {c.num_tokens, c.side_cols}) : Tensor();
    PermuteResult cpu = permute_pad(Variable(x), idx, Variable(prob), c.num_experts, c.align, c.expert_offset,
                                    c.num_local, -1, side, 0.5);
    Tensor gx = x.to(Device::cuda()), gidx = idx.to(Device::cuda()), gprob = prob.to(Device::cuda());
    Tensor gside = side.defined() ? side.to(Device::cuda()) : Tensor();
    for (PermuteRowKernel k : {PermuteRowKernel::classic, PermuteRowKernel::tma, PermuteRowKernel::automatic}) {
      SCOPED_TRACE(k == PermuteRowKernel::tma ? "tma" : k == PermuteRowKernel::classic ? "classic" : "automatic");
      poison_device_block(cpu.rows.shape(), c.dtype);
      PermuteResult gpu = permute_with_row_kernel(cpu, gx, gidx, gprob, gside, 0.5f, k);
      EXPECT_TRUE(bit_equal(gpu.row_map, cpu.row_map));
      EXPECT_TRUE(bit_equal(gpu.rows.data(), cpu.rows.data()));
      EXPECT_TRUE(bit_equal(gpu.probs.data(), cpu.probs.data()));
      if (side.defined()) {
        EXPECT_TRUE(bit_equal(gpu.side_rows, cpu.side_rows));
      }
    }
  }
}
