// bench_dispatch: expert-parallel dispatch and combine (parallel/dispatch.h) over the ranks of one run,
// against a plain all-to-all of the same bytes on the same communicator (docs/PERF.md has the figures).
// Ops dispatch, combine and their backward (ShapeBench::run lists them), each in the modes sync and zero_sync,
// with a bf16 and an fp8 (fp8_flow) payload, on the shapes toy and deepep (bench_shape); a figure is the slowest
// rank's host time, the median of --reps after --warmup. GB/s counts the bytes sent to other ranks (report).
// Run: build/bench/bench_dispatch (one process), mpirun -np 8 build/bench/bench_dispatch (one host, a GPU per
// rank: nccl); the options and the other launchers are listed above parse_options.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_ranks.h"
#include "bench/bench_routing.h"
#include "engine/ops/quantize.h"
#include "engine/rng.h"
#include "kernels/common/device_api.h"
#include "kernels/fp8.h"
#include "layers/moe.h"
#include "parallel/dispatch.h"

using namespace flowmoe;

namespace {

struct Options {
  CommBackend backend = CommBackend::automatic;
  std::vector<std::string> shapes{"toy", "deepep"};
  std::vector<bool> zero_sync{false, true};  // --modes: sync, zero_sync
  int reps = 20, warmup = 3;
  bool quick = false, cpu = false, backward = true;
  int sms = 0;  // --sms: the exchange kernels' SM budget (parallel.exchange_sms; 0: the kernels' own grid)
};

struct BenchShape {
  std::string name;
  int64_t tokens, hidden;
  int top_k, experts;
};

// Shapes, tokens per rank × hidden, top-k of E (E rounds up to a multiple of the ranks), random top-k
// routing with distinct experts per token (fixed seed per rank):
//   toy     8192 × 1024, top-4 of 32   (configs/gpu_moe.yaml's MoE layers)
//   deepep  4096 × 7168, top-8 of 256  (DeepEP's published setting)
// On the CPU (no GPU, or --cpu) and with --quick: 512 × 256 and 256 × 1024, same k and E, 5 reps.
BenchShape bench_shape(const std::string& name, bool small) {
  if (name == "toy") return small ? BenchShape{name, 512, 256, 4, 32} : BenchShape{name, 8192, 1024, 4, 32};
  if (name == "deepep") return small ? BenchShape{name, 256, 1024, 8, 256} : BenchShape{name, 4096, 7168, 8, 256};
  FLOWMOE_THROW(ConfigError, "bench_dispatch: unknown shape '", name, "' (toy, deepep)");
}

// "a,b,c" -> {"a", "b", "c"}.
std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> out;
  for (size_t at = 0; at <= list.size();) {
    const size_t comma = std::min(list.find(',', at), list.size());
    out.push_back(list.substr(at, comma - at));
    at = comma + 1;
  }
  return out;
}

// Run (options: --backend auto|nccl|mpi|none, --shapes toy,deepep, --modes sync,zero_sync, --reps N,
// --warmup N, --quick, --cpu, --no-backward, --sms S: the zero-sync kernels on S SMs, as parallel.exchange_sms
// leaves them beside the GEMMs):
//   build/bench/bench_dispatch                                      one process
//   mpirun -np 8 build/bench/bench_dispatch                         one host, a GPU per rank: nccl
//   mpirun -np 16 --hostfile hosts build/bench/bench_dispatch       several hosts
//   srun -n 16 --gpus-per-task 1 build/bench/bench_dispatch
//   mpirun -np 2 --oversubscribe build/bench/bench_dispatch --backend mpi   ranks sharing a GPU: host-staged
// nccl refuses ranks that share a GPU: --backend nccl prints a skip line there, auto falls back to mpi.
Options parse_options(int argc, char** argv) {
  Options o;
  bool reps_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&] {
      FLOWMOE_CHECK(i + 1 < argc, ConfigError, "bench_dispatch: ", a, " needs a value");
      return std::string(argv[++i]);
    };
    auto count = [&](int min) {
      const int v = std::stoi(value());
      FLOWMOE_CHECK(v >= min, ConfigError, "bench_dispatch: ", a, " must be at least ", min);
      return v;
    };
    if (a == "--backend") {
      o.backend = parse_comm_backend(value());
    } else if (a == "--shapes") {
      o.shapes = split_list(value());
      for (const std::string& s : o.shapes) bench_shape(s, true);  // an unknown name fails here, before any rank starts
    } else if (a == "--modes") {
      o.zero_sync.clear();
      for (const std::string& m : split_list(value())) {
        FLOWMOE_CHECK(m == "sync" || m == "zero_sync", ConfigError, "bench_dispatch: unknown mode '", m,
                      "' (sync, zero_sync)");
        o.zero_sync.push_back(m == "zero_sync");
      }
    } else if (a == "--reps") {
      o.reps = count(1), reps_given = true;
    } else if (a == "--warmup") {
      o.warmup = count(0);
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a == "--cpu") {
      o.cpu = true;
    } else if (a == "--no-backward") {
      o.backward = false;
    } else if (a == "--sms") {
      o.sms = count(0);
    } else {
      FLOWMOE_THROW(ConfigError, "bench_dispatch: unknown argument '", a, "' (options: bench/bench_dispatch.cpp)");
    }
  }
  if (o.quick && !reps_given) o.reps = 5, o.warmup = std::min(o.warmup, 1);
  return o;
}

double gbps(double bytes, double ms) { return bytes / (ms * 1e6); }

// ---- one shape -----------------------------------------------------------------------------------

// Rows per rank, averaged over the ranks: sent to other ranks, and kept. The averages are the same in
// both directions (every row one rank sends is a row another receives).
struct Traffic {
  double out = 0, local = 0;
};
Traffic traffic(const ExchangePlan& p, Communicator& host) {
  const int me = host.rank(), n = host.size(), L = p.num_local_experts;
  std::vector<double> v(2, 0.0);
  for (int g = 0; g < n * L; ++g) v[g / L == me ? 1 : 0] += double(p.send_counts[size_t(g)]);
  Tensor sum = Tensor::from_doubles(v, {2});
  host.all_reduce(sum, ReduceOp::sum);
  v = sum.to_doubles();
  return {v[0] / n, v[1] / n};
}

struct Run {
  const char* op;
  int64_t row_bytes;
  std::function<void()> prep, op_fn;
};

class ShapeBench {
 public:
  ShapeBench(const BenchWorld& w, const Options& o, BenchShape s, std::vector<std::string>& lines)
      : w_(w), o_(o), s_(std::move(s)), lines_(lines), n_(w.host().size()), experts_((s_.experts + n_ - 1) / n_ * n_) {}

  // Ops, each timed on every rank (host clock; a rep starts after the device is drained and a barrier and ends
  // when the device is drained again, which is what a training step waits for); a rep's time is the slowest
  // rank's, and each figure is the median of --reps after --warmup untimed reps:
  //   dispatch         permute+pad by global expert, the count exchange with its one host read, the plan,
  //                    and all_to_all_chunks straight into the owners' expert-major padded buffers
  //   combine          the experts' rows back to their tokens' rank, then unpermute+unpad
  //   dispatch.bwd     the gradient rows (and probs) back to the tokens, after an untimed forward
  //   combine.bwd      dy (FP8 in fp8_flow) to the experts' layout, after an untimed forward
  //   dispatch.nogroup one process only: what the layer runs without an expert-parallel group (permute+pad)
  // Each op runs in two modes (the field mode=): "sync", the one-sync exchange (the counts read to the host, a
  // buffer of the exact padded rows, grouped send/recv per (peer, expert) chunk), and "zero_sync"
  // (DispatchOptions::zero_sync: counts all-gathered and laid out on the device, a worst-case buffer, and on
  // nccl the rows written into the peers' GPUs by one kernel, then copied out of the window).
  // Payloads: "bf16", bf16 tokens with the probs applied at combine (the bf16 recipe; f32 on the CPU, whose
  // unpermute takes no bf16), and "fp8", fp8_flow's: e4m3 tokens quantized rowwise 1x128 once
  // (quantize_rowwise_tensor, untimed) whose f32 scales and f32 prob travel with each row; its combine moves
  // the experts' bf16 output and its backward FP8 dy with scales.
  void run() {
    const Device dev = w_.rt.device;
    const DType act = dev.is_cuda() ? DType::bf16 : DType::f32;
    const int me = w_.host().rank();
    std::mt19937_64 gen(2026 + 7919 * uint64_t(me));
    Rng rng(2026 + uint64_t(me));
    const Tensor idx = Tensor::from_ints(random_topk_experts(gen, s_.tokens, s_.top_k, experts_), {s_.tokens, s_.top_k},
                                         DType::i32, dev);
    const Tensor x = rng.uniform({s_.tokens, s_.hidden}, -1, 1, act, dev);
    const Tensor prob = rng.uniform({s_.tokens, s_.top_k}, 0, 1, DType::f32, dev);
    const Tensor xq = quantize_rowwise_tensor(x, "bench_dispatch: tokens");
    const Tensor dy = rng.uniform({s_.tokens, s_.hidden}, -1, 1, act, dev);
    const int64_t H = s_.hidden, act_row = H * int64_t(dtype_size(act)), fp8_row = H + 4 * ((H + 127) / 128);
    for (const bool fp8 : {false, true}) {
      const char* payload = fp8 ? "fp8" : dtype_name(act);
      DispatchOptions sync_opt;
      sync_opt.num_experts = experts_;
      sync_opt.row_multiple = fp8 ? kFp8RowMultiple : 1;  // as the layer rounds the FP8 GEMMs' rows
      sync_opt.expert_parallel = w_.comm;
      Variable tokens(fp8 ? xq : x, true);
      Variable probs = fp8 ? Variable(prob, true) : Variable();  // fp8_flow: the probs travel with the rows
      Variable merge = fp8 ? Variable() : Variable(prob, true);  // bf16: combine applies them
      // fp8_flow's combine quantizes its gradient once (layers/moe.h).
      const auto combine_as_layer = [fp8](const Variable& rows, const Dispatched& d, const Variable& merge) {
        Variable y = combine(rows, d, merge);
        return fp8 ? combine_grad_to_fp8(y) : y;
      };
      // The traffic is the routing's, the same in both modes: read from a sync plan, whose counts are on the host.
      const Traffic tr = traffic(*dispatch(tokens, idx, probs, sync_opt).plan, w_.host());
      for (const bool zero_sync : o_.zero_sync) {
        DispatchOptions opt = sync_opt;
        opt.zero_sync = zero_sync;
        opt.tokens_per_rank = s_.tokens;
        const Dispatched d0 = dispatch(tokens, idx, probs, opt);
        const int64_t R = d0.rows.size(0);
        Variable out_rows(rng.uniform({R, H}, -1, 1, act, dev), true);  // what fc2 would return
        const Tensor d_rows = rng.uniform({R, H}, -1, 1, act, dev);
        const Tensor d_probs = fp8 ? rng.uniform({R}, -1, 1, DType::f32, dev) : Tensor();
        std::optional<Dispatched> held;
        Variable y;
        auto clear = [&] { held.reset(), y = Variable(); };  // results die outside the timed region
        std::vector<Run> runs = {
            {"dispatch", fp8 ? fp8_row + 4 : act_row, clear, [&] { held = dispatch(tokens, idx, probs, opt); }},
            {"combine", act_row, clear, [&] { y = combine_as_layer(out_rows, d0, merge); }}};
        if (o_.backward) {
          runs.push_back({"dispatch.bwd", act_row + (fp8 ? 4 : 0),
                          [&] {
                            clear();
                            tokens.zero_grad();
                            if (probs.defined()) probs.zero_grad();
                            held = dispatch(tokens, idx, probs, opt);
                          },
                          [&] {
                            backward({held->rows, held->probs}, {d_rows, d_probs});
                          }});
          runs.push_back({"combine.bwd", fp8 ? fp8_row : act_row,
                          [&] {
                            clear();
                            out_rows.zero_grad();
                            if (merge.defined()) merge.zero_grad();
                            y = combine_as_layer(out_rows, d0, merge);
                          },
                          [&] { y.backward(dy); }});
        }
        if (n_ == 1 && !zero_sync) {  // the layer's own one-rank path, no exchange: what the exchange costs over it
          DispatchOptions alone = opt;
          alone.expert_parallel = nullptr;
          runs.push_back({"dispatch.nogroup", fp8 ? fp8_row + 4 : act_row, clear,
                          [&held, &tokens, &idx, &probs, alone] { held = dispatch(tokens, idx, probs, alone); }});
        }
        const int64_t rows_per_peer = int64_t(std::ceil((tr.out + tr.local) / n_));
        for (const Run& r : runs) {
          const RankTiming t = time_across_ranks(w_, *w_.comm, o_.warmup, o_.reps, r.op_fn, r.prep);
          clear();
          const double ceiling = cached(ceiling_, *w_.comm, rows_per_peer, r.row_bytes);
          const double nccl = w_.nccl_ceiling ? cached(nccl_, *w_.nccl_ceiling, rows_per_peer, r.row_bytes) : 0;
          report(payload, zero_sync ? "zero_sync" : "sync", r, tr, t, ceiling, nccl);
        }
      }
    }
  }

 private:
  const BenchWorld& w_;
  const Options& o_;
  const BenchShape s_;
  std::vector<std::string>& lines_;
  const int n_;
  const int experts_;
  std::map<int64_t, double> ceiling_, nccl_;  // GB/s by row bytes

  double cached(std::map<int64_t, double>& cache, Communicator& comm, int64_t rows_per_peer, int64_t row_bytes) {
    auto it = cache.find(row_bytes);
    if (it == cache.end())
      it = cache.emplace(row_bytes, all_to_all_gbps(w_, comm, o_.warmup, o_.reps, rows_per_peer, row_bytes)).first;
    return it->second;
  }

  // Bytes: rows a rank sends to other ranks × the row's bytes (data, FP8 scales, probs), averaged over the
  // ranks; GB/s = those bytes / time. "local" is the fraction of the rows that stay on their rank (a copy, not
  // counted). One process: every row is local, GB/s counts the bytes copied.
  // Ceiling: Communicator::all_to_all on the same communicator, ceil(rows / ranks) rows of the same bytes to
  // every rank, bytes to other ranks / time. One process: the none backend's all_to_all, a device copy of the
  // same bytes. An mpi run on GPUs where every rank has its own GPU and the build has NCCL also times that
  // all-to-all through an nccl communicator ("nccl" columns).
  // "syncs" is num_host_syncs() over one call: the syncs the engine makes on purpose (zero_sync on nccl
  // between reachable GPUs: 0; on mpi with GPUs the tables are read to the host, a test transport).
  void report(const char* payload, const char* mode, const Run& r, const Traffic& tr, const RankTiming& t,
              double ceiling, double nccl) {
    if (w_.host().rank() != 0) return;
    const double rows = tr.out + tr.local, bytes = (n_ > 1 ? tr.out : tr.local) * double(r.row_bytes);
    const double g = gbps(bytes, t.ms), local = rows > 0 ? tr.local / rows : 0;
    char nccl_cols[64] = "", nccl_fields[96] = "";
    if (w_.nccl_ceiling) {
      std::snprintf(nccl_cols, sizeof nccl_cols, " %9.2f %7.3f |", nccl, g / nccl);
      std::snprintf(nccl_fields, sizeof nccl_fields, " nccl_gbps=%.2f frac_nccl=%.4f", nccl, g / nccl);
    }
    std::printf("%-7s %-7s %-16s %-9s %9.0f %6lld %9.2f %6.3f | %9.3f %9.2f | %9.2f %7.3f |%s %5llu\n", s_.name.c_str(),
                payload, r.op, mode, rows, (long long)r.row_bytes, bytes / 1e6, local, t.ms, g, ceiling, g / ceiling,
                nccl_cols, (unsigned long long)t.host_syncs);
    std::fflush(stdout);
    char line[640];
    std::snprintf(line, sizeof line,
                  "BENCH dispatch shape=%s T=%lld H=%lld k=%d E=%d ranks=%d backend=%s device=%s payload=%s op=%s "
                  "mode=%s rows=%.0f row_bytes=%lld bytes=%.0f local_frac=%.4f ms=%.4f gbps=%.2f ceiling=%s "
                  "ceiling_gbps=%.2f frac_ceiling=%.4f host_syncs=%llu sms=%d%s",
                  s_.name.c_str(), (long long)s_.tokens, (long long)s_.hidden, s_.top_k, experts_, n_,
                  w_.comm->backend_name(), w_.rt.device.is_cuda() ? "cuda" : "cpu", payload, r.op, mode, rows,
                  (long long)r.row_bytes, bytes, local, t.ms, g, n_ > 1 ? "all_to_all" : "copy", ceiling, g / ceiling,
                  (unsigned long long)t.host_syncs, o_.sms, nccl_fields);
    lines_.push_back(line);
  }
};

void print_header(const BenchWorld& w, const Options& o) {
  const int n = w.host().size();
  const bool cpu = w.rt.device.is_cpu();
  std::printf(
      "bench_dispatch: %d rank(s), backend %s, %s%s%s; median of %d reps after %d warm-ups, host clock, "
      "slowest rank\n",
      n, w.comm->backend_name(), w.rt.device.str().c_str(), cpu ? " (the bf16 payload is f32 on the CPU)" : "",
      o.quick ? ", --quick shapes" : "", o.reps, o.warmup);
  if (o.sms > 0) std::printf("  zero_sync's kernels on %d SMs (--sms)\n", o.sms);
  if (!w.note.empty()) std::printf("  %s\n", w.note.c_str());
  if (n > 1)
    std::printf(
        "  bytes: rows sent to other ranks x row bytes (data, FP8 scales, probs), per rank; ceiling: "
        "all_to_all on %s of the same rows, split equally%s\n",
        w.comm->backend_name(), w.nccl_ceiling ? "; nccl: the same through an nccl communicator" : "");
  else
    std::printf(
        "  one process: the exchange is a local copy; bytes: the rows copied x row bytes; ceiling: a %s copy "
        "of the same bytes\n",
        cpu ? "host" : "device-to-device");
  std::printf("\n%-7s %-7s %-16s %-9s %9s %6s %9s %6s | %9s %9s | %9s %7s |%s %5s\n", "shape", "payload", "op", "mode",
              "rows", "B/row", n > 1 ? "MB out" : "MB copied", "local", "ms", "GB/s", "ceil GB/s", "of ceil",
              w.nccl_ceiling ? " nccl GB/s of nccl |" : "", "syncs");
}

}  // namespace

int main(int argc, char** argv) {
  int rank = 0;
  try {
    const Options o = parse_options(argc, argv);
    const BenchWorld w = make_bench_world(o.backend, o.cpu, "bench_dispatch");
    rank = w.host().rank();
    if (w.skipped) {
      if (rank == 0) std::printf("%s\n", w.note.c_str());
      return 0;
    }
    const bool small = o.quick || w.rt.device.is_cpu();
    cuda_set_comm_sms(o.sms);
    if (rank == 0) print_header(w, o);
    std::vector<std::string> lines;
    for (const std::string& name : o.shapes) ShapeBench(w, o, bench_shape(name, small), lines).run();
    if (rank == 0) {
      std::printf("\n");
      for (const std::string& line : lines) std::printf("%s\n", line.c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_dispatch failed on rank %d: %s\n", rank, e.what());
    std::fflush(stderr);
    mpi_abort_world(1);  // peers blocked in a collective would wait forever
    return 1;
  }
  return 0;
}
