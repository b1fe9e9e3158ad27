// Expert-parallel dispatch and combine across the ranks of test_comm's world (parallel/dispatch.h,
// parallel/exchange.h), on CPU tensors and, with a GPU, CUDA tensors (staged by the mpi backend); with
// a GPU per rank, every check again through an nccl communicator, each rank on its own GPU.
// Every rank draws every rank's tokens and routes from one shared seed, so it can build the exact
// buffer it must receive: each row value names its source rank and token, and a wrong row is named.
// Routings: random, skewed to one expert, all to one rank, a rank with no tokens, an expert with none.
// Each check runs on the one-sync path and on the zero-sync one (DispatchOptions::zero_sync), whose
// worst-case buffer must hold the same rows as the sync buffer; its tail is unspecified, and NaN bytes
// wherever the rows moved through the host (so that a reader of the tail fails these tests).
// Then the MoE layer itself at expert-parallel size n against one process on the whole batch.
#include <cmath>
#include <cstring>
#include <random>

#include "engine/ops/ops.h"
#include "engine/ops/quantize.h"
#include "kernels/common/device_api.h"
#include "layers/moe.h"
#include "parallel/backends.h"
#include "tests/mpi/comm_test_util.h"
#include "tests/support/checks.h"
#include "tests/support/moe_config.h"

namespace flowmoe::test {
namespace {

constexpr int kLocalExperts = 3, kTopK = 2, kAlign = 16;

// One seed for every rank (test_seed() differs per process unless FLOWMOE_TEST_SEED fixes it): rank 0's.
uint64_t shared_seed() {
  Tensor seed = Tensor::from_ints({int64_t(test_seed() >> 1)}, {1}, DType::i64, test_world().native_device());
  test_world().broadcast(seed, 0);
  return uint64_t(seed.to_ints()[0]);
}

struct Routing {
  std::string name;
  std::function<int64_t(int rank, int n)> num_tokens;
  std::function<std::vector<int>(int n)> allowed;  // the experts tokens may pick (empty: all)
};

std::vector<Routing> routings() {
  auto all = [](int) { return std::vector<int>{}; };
  return {
      {"random", [](int r, int) { return int64_t(5 + 7 * r); }, all},
      {"skewed to experts 0 and 1", [](int r, int) { return int64_t(9 + r); },
       [](int) {
         return std::vector<int>{0, 1};
       }},
      {"all to the last rank", [](int r, int) { return int64_t(4 + 3 * r); },
       [](int n) {
         return std::vector<int>{(n - 1) * kLocalExperts, (n - 1) * kLocalExperts + 1};
       }},
      {"rank 1 sends nothing", [](int r, int) { return r == 1 ? int64_t(0) : int64_t(6); }, all},
      {"expert 2 gets none", [](int r, int) { return int64_t(8 + r); },
       [](int n) {
         std::vector<int> a;
         for (int g = 0; g < n * kLocalExperts; ++g)
           if (g != 2) a.push_back(g);
         return a;
       }},
  };
}

// x[t, h] = rank·1000 + t + h/256: exact in f32 and bf16-free, decodable.
float token_code(int rank, int64_t t, int64_t h) { return float(rank * 1000 + t) + float(h % 256) / 256.f; }
std::string decode_token(float v) {
  const int64_t whole = int64_t(std::floor(v));
  return "rank " + std::to_string(whole / 1000) + "'s token " + std::to_string(whole % 1000);
}

struct RankData {
  Tensor x;    // [T, H] f32 on the CPU
  Tensor idx;  // [T, k] i32
};

RankData rank_data(const Routing& r, int rank, int n, int64_t hidden, uint64_t seed) {
  std::mt19937_64 gen(seed + uint64_t(rank) * 7919);
  const int64_t T = r.num_tokens(rank, n);
  std::vector<float> v(size_t(T * hidden));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < hidden; ++h) v[size_t(t * hidden + h)] = token_code(rank, t, h);
  return {Tensor::from_floats(v, {T, hidden}), random_topk(gen, T, kTopK, n * kLocalExperts, r.allowed(n))};
}

// The rows rank `me` must receive: for each local expert, each peer's copies in token order, then
// zero pad rows up to kAlign. Entries are (rank, token), (-1, -1) for a pad row.
std::vector<std::pair<int, int64_t>> expected_rows(const std::vector<RankData>& all, int me) {
  std::vector<std::pair<int, int64_t>> rows;
  for (int e = 0; e < kLocalExperts; ++e) {
    const int g = me * kLocalExperts + e;
    const size_t start = rows.size();
    for (size_t p = 0; p < all.size(); ++p) {
      const std::vector<int64_t> idx = all[p].idx.to_ints();
      for (int64_t t = 0; t < all[p].idx.size(0); ++t)
        for (int j = 0; j < kTopK; ++j)
          if (idx[size_t(t * kTopK + j)] == g) rows.push_back({int(p), t});
    }
    while ((rows.size() - start) % kAlign) rows.push_back({-1, -1});
  }
  return rows;
}

// Where a check runs: the expert-parallel group and this rank's device. The world moves CPU tensors,
// and CUDA ones through host staging (every rank on cuda:0); nccl moves those of each rank's own GPU.
struct Ranks {
  std::shared_ptr<Communicator> comm;
  Device device;
  bool zero_sync = false;
};
Ranks on_cpu(bool zero_sync = false) { return {test_runtime().world, Device::cpu(), zero_sync}; }
Ranks on_staged_gpu(bool zero_sync = false) { return {test_runtime().world, Device::cuda(0), zero_sync}; }

// The host syncs a dispatch makes: one on the sync path with a GPU; none with zero_sync where the
// tables stay on the device (CPU, nccl between reachable GPUs); -1 where it is not promised (staged mpi).
int dispatch_syncs(const Ranks& ranks) {
  if (!ranks.device.is_cuda()) return 0;
  if (!ranks.zero_sync) return 1;
  return std::string(ranks.comm->backend_name()) == "nccl" ? 0 : -1;
}

// Every rank's zero-sync buffer holds the most tokens any rank routes.
int64_t max_tokens(const Routing& r, int n) {
  int64_t most = 0;
  for (int p = 0; p < n; ++p) most = std::max(most, r.num_tokens(p, n));
  return most;
}

DispatchOptions group_options(const Ranks& ranks, const Routing& r) {
  DispatchOptions o;
  o.num_experts = ranks.comm->size() * kLocalExperts;
  o.align_size = kAlign;
  o.expert_parallel = ranks.comm;
  o.zero_sync = ranks.zero_sync;
  o.tokens_per_rank = max_tokens(r, ranks.comm->size());
  return o;
}

// The rows a dispatch must return: the sync buffer's, or the zero-sync worst case.
int64_t dispatched_rows(const Ranks& ranks, const Routing& r, size_t sync_rows) {
  if (!ranks.zero_sync) return int64_t(sync_rows);
  return zero_sync_padded_rows(ranks.comm->size(), max_tokens(r, ranks.comm->size()), kTopK, kLocalExperts, kAlign, 1);
}

// A zero-sync dispatch against the sync one on the same tokens: the device counts equal the host ones,
// and the first rows (every expert segment) are the sync buffer's, bit for bit.
void check_counts_match_sync(const Dispatched& z, const RankData& mine, const Ranks& ranks, const Routing& r) {
  Ranks sync = ranks;
  sync.zero_sync = false;
  Dispatched s =
      dispatch(Variable(mine.x.to(ranks.device)), mine.idx.to(ranks.device), Variable(), group_options(sync, r));
  EXPECT_EQ(z.tokens_per_expert.to_ints(), s.tokens_per_expert.to_ints()) << "tokens_per_expert";
  ASSERT_TRUE(z.plan && z.plan->on_device);
  EXPECT_EQ(z.plan->device_padded_tokens_per_expert.to_ints(), s.counts.host) << "padded_tokens_per_expert";
  // On a GPU the counts stay where the exchange left them; on the CPU they are read (no sync there).
  EXPECT_EQ(z.counts.on_device(), z.rows.device().is_cuda()) << "where the GEMMs read the counts";
  const int64_t rows = s.rows.size(0);
  EXPECT_TRUE(
      bit_equal(z.rows.data().slice(0, 0, rows).to(Device::cpu()).contiguous(), s.rows.data().to(Device::cpu())))
      << "the zero-sync buffer's segments differ from the sync buffer";
}

// Past the sync buffer's rows, a zero-sync buffer's tail: NaN where the rows moved through the host
// (nccl's device puts leave it unwritten).
void check_tail(const std::vector<float>& got, size_t first, const Ranks& ranks) {
  if (!ranks.zero_sync || !put_rows_through_host(*ranks.comm)) return;
  size_t finite = 0;
  for (size_t i = first; i < got.size(); ++i) finite += std::isfinite(got[i]) ? 1 : 0;
  EXPECT_EQ(finite, size_t(0)) << "of the " << got.size() - first << " values of the zero-sync tail";
}

// Dispatch, then combine of the rows as they came (y = Σ_j row = k·x): every received row is named.
void check_round_trip(const Ranks& ranks) {
  const Device device = ranks.device;
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  const int64_t H = 256;
  const uint64_t seed = shared_seed();
  for (const Routing& r : routings()) {
    SCOPED_TRACE(r.name + " on " + device.str());
    std::vector<RankData> all;
    for (int p = 0; p < n; ++p) all.push_back(rank_data(r, p, n, H, seed));
    const auto want = expected_rows(all, me);
    const uint64_t syncs = num_host_syncs();
    Dispatched d = dispatch(Variable(all[size_t(me)].x.to(device)), all[size_t(me)].idx.to(device), Variable(),
                            group_options(ranks, r));
    if (dispatch_syncs(ranks) >= 0) {
      EXPECT_EQ(num_host_syncs() - syncs, uint64_t(dispatch_syncs(ranks))) << "host syncs of one dispatch";
    }
    const std::vector<float> got = d.rows.data().to_floats();
    EXPECT_EQ(d.rows.size(0), dispatched_rows(ranks, r, want.size()));
    check_tail(got, want.size() * size_t(H), ranks);
    for (size_t i = 0; i < want.size(); ++i) {
      const auto [p, t] = want[i];
      const float v = got[i * size_t(H) + 1];
      const float w = p < 0 ? 0.f : token_code(p, t, 1);
      EXPECT_EQ(v, w) << "rank " << me << " row " << i << ": expected " << (p < 0 ? "a zero pad row" : decode_token(w))
                      << ", got " << decode_token(v);
      if (v != w) break;
    }
    if (ranks.zero_sync) check_counts_match_sync(d, all[size_t(me)], ranks, r);
    Variable y = combine(d.rows, d, Variable());
    EXPECT_TRUE(all_close(y.data().to(Device::cpu()), tensor_scale(all[size_t(me)].x, double(kTopK)), 0, 0))
        << "combine did not bring every copy home";
  }
}

TEST(Exchange, RoundTripNamesEveryRow) { check_round_trip(on_cpu()); }
TEST(Exchange, ZeroSyncRoundTripNamesEveryRow) { check_round_trip(on_cpu(true)); }
TEST(Exchange, RoundTripNamesEveryRowCuda) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  check_round_trip(on_staged_gpu());
  check_round_trip(on_staged_gpu(true));
}

// FP8 rows and their scales arrive bit for bit: the received buffer equals the one built from every
// peer's quantized tokens.
void check_fp8_bits(const Ranks& ranks) {
  const Device device = ranks.device;
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  const int64_t H = 384;
  const uint64_t seed = shared_seed();
  for (const Routing& r : routings()) {
    SCOPED_TRACE(r.name + " on " + device.str());
    std::vector<RankData> all;
    std::vector<Tensor> q;
    for (int p = 0; p < n; ++p) {
      all.push_back(rank_data(r, p, n, H, seed + 1));
      q.push_back(quantize_rowwise_tensor(all.back().x, ""));
    }
    Dispatched d = dispatch(Variable(q[size_t(me)].to(device).with_scales(
                                q[size_t(me)].fp8_scales()->scale_inv.to(device), ScalingMode::rowwise_1x128)),
                            all[size_t(me)].idx.to(device), Variable(), group_options(ranks, r));
    const Tensor rows = d.rows.data().to(Device::cpu());
    const auto& scales = d.rows.data().fp8_scales();
    EXPECT_TRUE(scales != nullptr) << "the FP8 rows arrived without scales";
    if (!scales) continue;
    const Tensor s = scales->scale_inv.to(Device::cpu());
    const auto want = expected_rows(all, me);
    const int64_t cols = s.size(1);
    EXPECT_EQ(rows.size(0), dispatched_rows(ranks, r, want.size()));
    check_tail(s.to_floats(), want.size() * size_t(cols), ranks);
    for (size_t i = 0; i < want.size(); ++i) {
      const auto [p, t] = want[i];
      const auto* a = static_cast<const uint8_t*>(rows.raw_data()) + i * size_t(H);
      const float* sa = s.data<float>() + i * size_t(cols);
      bool same = true;
      for (int64_t h = 0; h < H; ++h)
        same = same && a[h] == (p < 0 ? 0 : static_cast<const uint8_t*>(q[size_t(p)].raw_data())[t * H + h]);
      for (int64_t c = 0; c < cols; ++c)
        same = same && sa[c] == (p < 0 ? 1.f : q[size_t(p)].fp8_scales()->scale_inv.data<float>()[t * cols + c]);
      EXPECT_TRUE(same) << "rank " << me << " row " << i << ": the FP8 bytes or scales of "
                        << (p < 0 ? "a pad row" : "rank " + std::to_string(p) + "'s token " + std::to_string(t))
                        << " differ";
      if (!same) break;
    }
    // And back (to_tokens): each routed copy's bytes and scales return to the sender's sorted row bit for bit.
    if (!d.plan) continue;
    const Tensor back = exchange(d.rows, Variable(), d.plan, ExchangeDirection::to_tokens)[0].data();
    ASSERT_TRUE(back.fp8_scales() != nullptr) << "the FP8 rows came back without scales";
    const Tensor sent = d.routing.rows.data().to(Device::cpu()), got = back.to(Device::cpu());
    const Tensor sent_s = d.routing.rows.data().fp8_scales()->scale_inv.to(Device::cpu());
    const Tensor got_s = back.fp8_scales()->scale_inv.to(Device::cpu());
    for (int64_t row : d.routing.row_map.to_ints()) {
      if (row < 0) continue;
      EXPECT_EQ(std::memcmp(static_cast<const uint8_t*>(got.raw_data()) + row * H,
                            static_cast<const uint8_t*>(sent.raw_data()) + row * H, size_t(H)),
                0)
          << "sorted row " << row << "'s bytes";
      EXPECT_EQ(std::memcmp(got_s.data<float>() + row * cols, sent_s.data<float>() + row * cols,
                            size_t(cols) * sizeof(float)),
                0)
          << "sorted row " << row << "'s scales";
    }
  }
}

TEST(Exchange, Fp8PayloadIsBitIdentical) { check_fp8_bits(on_cpu()); }
TEST(Exchange, ZeroSyncFp8PayloadIsBitIdentical) { check_fp8_bits(on_cpu(true)); }
TEST(Exchange, Fp8PayloadIsBitIdenticalCuda) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  check_fp8_bits(on_staged_gpu());
  check_fp8_bits(on_staged_gpu(true));
}

// dispatch → a row-wise "expert" → combine across ranks equals the same on this rank alone, values
// and gradients, with the probs applied at combine and with the probs moving with the rows.
void check_gradients(const Ranks& ranks) {
  const Device device = ranks.device;
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  const int64_t H = 128;
  const uint64_t seed = shared_seed();
  Rng rng(seed + uint64_t(me));
  for (const Routing& r : routings())
    for (bool probs_with_rows : {false, true}) {
      SCOPED_TRACE(r.name + (probs_with_rows ? ", probs with the rows" : ", probs at combine"));
      RankData data = rank_data(r, me, n, H, seed + 2);
      const int64_t T = data.x.size(0);
      Tensor x0 = tensor_scale(data.x, 1e-3).to(device), p0 = random_tensor(rng, {T, kTopK}, DType::f32, device);
      Tensor dy = random_tensor(rng, {T, H}, DType::f32, device);
      std::vector<Tensor> got;
      for (bool across : {false, true}) {
        Variable x(x0, true), prob(p0, true);
        DispatchOptions o = group_options(ranks, r);
        if (!across) o.expert_parallel = nullptr;
        Dispatched d = dispatch(x, data.idx.to(device), probs_with_rows ? prob : Variable(), o);
        Variable rows = mul(d.rows, d.rows);
        if (probs_with_rows) rows = times_probs(rows, d.probs);
        const uint64_t syncs = num_host_syncs();
        Variable y = combine(rows, d, probs_with_rows ? Variable() : prob);
        y.backward(dy);
        if (dispatch_syncs(ranks) >= 0) {
          EXPECT_EQ(num_host_syncs(), syncs) << "combine and the backward read nothing to the host";
        }
        for (const Tensor& t : {y.data(), x.grad(), prob.grad()}) got.push_back(t.to(Device::cpu()));
      }
      EXPECT_TRUE(bit_equal(got[3], got[0])) << "y";
      EXPECT_TRUE(bit_equal(got[4], got[1])) << "d x";
      EXPECT_TRUE(bit_equal(got[5], got[2])) << "d prob";
    }
}

TEST(Exchange, GradientsMatchOneRank) { check_gradients(on_cpu()); }
TEST(Exchange, ZeroSyncGradientsMatchOneRank) { check_gradients(on_cpu(true)); }
TEST(Exchange, GradientsMatchOneRankCuda) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  check_gradients(on_staged_gpu());
  check_gradients(on_staged_gpu(true));
}

// The MoE layer with its experts sharded over the world against one process holding every expert on
// the whole batch (every rank builds that reference itself), for each recipe: the output rows, d x,
// the expert weights' gradients (this rank's rows) and the dense gradients (summed over the ranks).
// Tolerance: the expert GEMMs see the same rows in the same order, but the dense gradients add the
// ranks' partial sums in another order, and CPU GEMM blocking may follow the row count: 1e-5 relative.
void check_layer(MoeRecipe recipe, const Ranks& ranks) {
  const Device device = ranks.device;
  Communicator& world = test_world();
  const int me = world.rank(), n = world.size();
  const int64_t H = 128, F = 128, T = 12;
  const ModelConfig cfg = moe_test_config(4 * n, 2, H, F, 1, 0.05);
  Rng rng(shared_seed());  // the same draws on every rank: the global batch and its output gradient
  Tensor x_all = random_tensor(rng, {n * T, H}, DType::f32, Device::cpu());
  Tensor dy_all = random_tensor(rng, {n * T, H}, DType::f32, Device::cpu());
  const DType compute = device.is_cuda() ? DType::bf16 : DType::f32;
  auto run = [&](bool sharded, const Tensor& x0, const Tensor& dy) {
    MoeOptions o(16);
    o.recipe = recipe;
    if (sharded) o.expert_parallel = ranks.comm;
    o.ep_dispatch = ranks.zero_sync ? EpDispatch::zero_sync : EpDispatch::sync;
    ParamFactory f(7, device);
    MoeLayer layer(f, cfg, "mlp", o, device);
    Variable x(x0.to(device).to(compute), true);
    const uint64_t syncs = num_host_syncs();
    Variable y = layer.forward(x, compute);
    y.backward(dy.to(device).to(compute));
    // bf16 experts take the device counts: a zero-sync step on GPUs that reach each other reads nothing.
    if (sharded && ranks.zero_sync && recipe == MoeRecipe::bf16 && dispatch_syncs(ranks) == 0) {
      EXPECT_EQ(num_host_syncs(), syncs) << "a bf16 zero-sync forward and backward read the host";
    }
    std::vector<Tensor> out = {y.data().to(Device::cpu()).to(DType::f32), x.grad().to(Device::cpu()).to(DType::f32)};
    for (const Variable& p : f.params()) out.push_back(p.grad().to(Device::cpu()));
    return std::make_pair(out, f.shards());
  };
  auto [ref, ref_shards] = run(false, x_all, dy_all);
  auto [ep, shards] =
      run(true, x_all.slice(0, me * T, (me + 1) * T).contiguous(), dy_all.slice(0, me * T, (me + 1) * T).contiguous());
  const double tol = compute == DType::f32 ? 1e-5 : 2e-2;
  EXPECT_TRUE(all_close(ep[0], ref[0].slice(0, me * T, (me + 1) * T).contiguous(), tol, tol)) << "y";
  EXPECT_TRUE(all_close(ep[1], ref[1].slice(0, me * T, (me + 1) * T).contiguous(), tol, tol)) << "d x";
  for (size_t i = 0; i < shards.size(); ++i) {
    Tensor g = ep[i + 2];
    if (!shards[i].expert) world.all_reduce(g, ReduceOp::sum);  // a dense weight saw only this rank's tokens
    Tensor want = ref[i + 2].slice(0, shards[i].offset, shards[i].offset + g.size(0)).contiguous();
    EXPECT_TRUE(all_close(g, want, tol, tol * 10)) << "gradient of parameter " << i;
  }
}

TEST(Exchange, MoeLayerMatchesOneProcessBf16) { check_layer(MoeRecipe::bf16, on_cpu()); }
TEST(Exchange, MoeLayerMatchesOneProcessFp8Blockwise) { check_layer(MoeRecipe::fp8_blockwise, on_cpu()); }
TEST(Exchange, MoeLayerMatchesOneProcessFp8Flow) { check_layer(MoeRecipe::fp8_flow, on_cpu()); }
TEST(Exchange, ZeroSyncMoeLayerMatchesOneProcess) {
  for (MoeRecipe r : {MoeRecipe::bf16, MoeRecipe::fp8_flow}) {
    SCOPED_TRACE(moe_recipe_name(r));
    check_layer(r, on_cpu(true));
  }
}
TEST(Exchange, MoeLayerMatchesOneProcessCuda) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  for (MoeRecipe r : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow})
    for (bool zero_sync : {false, true}) {
      SCOPED_TRACE(std::string(moe_recipe_name(r)) + (zero_sync ? ", zero_sync" : ""));
      check_layer(r, on_staged_gpu(zero_sync));
    }
}

// Every check above through nccl, each rank on its own GPU: ctest's test_comm_np2 and test_comm_np4
// run it on a machine with as many GPUs (one GPU, or one rank: skipped).
// auto takes zero_sync only where the exchange writes into the peers' memory from the device (nccl,
// every rank reachable) and with 2 or 4 ranks, where it was measured; the mpi backend never does.
TEST(Exchange, AutoTakesZeroSyncOnlyWithDevicePuts) {
  Communicator& world = *test_runtime().world;
  EXPECT_FALSE(world.device_puts());
  const bool several = world.size() > 1;
  EXPECT_FALSE(resolve_ep_dispatch(EpDispatch::automatic, &world));
  EXPECT_FALSE(resolve_ep_dispatch(EpDispatch::sync, &world));
  EXPECT_EQ(resolve_ep_dispatch(EpDispatch::zero_sync, &world), several);  // one rank never exchanges
  EXPECT_FALSE(resolve_ep_dispatch(EpDispatch::zero_sync, nullptr));
  EXPECT_EQ(ep_dispatch_from_name("zero_sync"), EpDispatch::zero_sync);
  EXPECT_STREQ(ep_dispatch_name(EpDispatch::automatic), "auto");
  EXPECT_THROW(ep_dispatch_from_name("eager"), ConfigError);
}

TEST(Exchange, EveryCheckThroughNcclOnAGpuPerRank) {
  if (const std::string why = why_no_nccl_gpu_per_rank(); !why.empty()) GTEST_SKIP() << why;
  const int me = test_world().rank(), n = test_world().size();
  cuda_set_device(me);
  Ranks ranks{make_nccl_communicator(test_runtime().world, me), Device::cuda(me)};
  // With device puts (GPUs that reach each other: NVLink or PCIe P2P), auto takes zero_sync at 2 ranks,
  // where it was measured ahead; at 4 (sync measured ahead) and without puts never.
  const bool puts = ranks.comm->device_puts();  // collective the first time: every rank asks here
  EXPECT_EQ(resolve_ep_dispatch(EpDispatch::automatic, ranks.comm.get()), puts && n == 2);
  for (bool zero_sync : {false, true}) {  // zero_sync: rows written into the peers' GPUs (parallel/nccl/lsa_put.h)
    SCOPED_TRACE(zero_sync ? "zero_sync" : "sync");
    ranks.zero_sync = zero_sync;
    check_round_trip(ranks);
    check_fp8_bits(ranks);
    check_gradients(ranks);
    for (MoeRecipe r : {MoeRecipe::bf16, MoeRecipe::fp8_blockwise, MoeRecipe::fp8_flow}) {
      SCOPED_TRACE(moe_recipe_name(r));
      check_layer(r, ranks);
    }
  }
  ranks.comm->barrier();
  cuda_set_device(0);
}

}  // namespace
}  // namespace flowmoe::test
