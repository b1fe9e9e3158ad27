// dispatch and combine (see parallel/dispatch.h): permute+pad and unpermute+unpad on the tokens'
// rank, with the exchange of parallel/exchange.h between them and the experts when there are several.
#include "parallel/dispatch.h"

#include <sstream>

#include "engine/ops/grouped_linear.h"
#include "engine/ops/unpermute.h"
#include "kernels/fp8.h"

namespace flowmoe {

namespace {

// The sender's permute groups copies by global expert. Its segments only need to be contiguous, but
// permute_pad pads them to at least its smallest align_size, the FP8 row multiple; the pad rows never travel.
constexpr int kSortedAlign = kFp8RowMultiple;

}  // namespace

Dispatched dispatch(const Variable& tokens, const Tensor& topk_idx, const Variable& probs, const DispatchOptions& o) {
  FLOWMOE_CHECK(tokens.data().dim() == 2, ShapeError, "dispatch: tokens must be [T, H], got ",
                tokens.data().describe());
  FLOWMOE_CHECK(topk_idx.dim() == 2 && topk_idx.size(0) == tokens.size(0), ShapeError, "dispatch: topk_idx ",
                topk_idx.describe(), " must be [", tokens.size(0), ", k]");
  FLOWMOE_CHECK(o.num_experts >= 1, Error, "dispatch: num_experts must be at least 1, got ", o.num_experts);
  Dispatched d;
  if (!o.expert_parallel) {
    d.routing = permute_pad(tokens, topk_idx, probs, o.num_experts, o.align_size, 0, -1, o.num_rows);
    d.rows = d.routing.rows;
    d.probs = d.routing.probs;
    d.tokens_per_expert = d.routing.tokens_per_expert;
    d.counts = o.device_counts ? gemm_counts(d.routing.padded_tokens_per_expert, d.rows.data(), o.fp8_experts)
                               : ExpertCounts{read_counts_once(d.routing.padded_tokens_per_expert), Tensor()};
    return d;
  }
  Communicator& comm = *o.expert_parallel;
  FLOWMOE_CHECK(o.num_experts % comm.size() == 0, ConfigError, "dispatch: ", o.num_experts,
                " experts do not split over an expert-parallel group of ", comm.size(), " ranks");
  if (o.zero_sync) {
    const int L = o.num_experts / comm.size(), k = int(topk_idx.size(1));
    const int64_t T = o.tokens_per_rank >= 0 ? o.tokens_per_rank : tokens.size(0);
    FLOWMOE_CHECK(tokens.size(0) <= T, ShapeError, "dispatch: ", tokens.size(0), " tokens on rank ", comm.rank(),
                  " but zero_sync buffers are sized for tokens_per_rank = ", T);
    // Both buffers sized from T alone, so every rank's has the same shape (the device puts need it).
    d.routing = permute_pad(tokens, topk_idx, probs, o.num_experts, kSortedAlign, 0, -1,
                            permute_worst_case_rows(T, k, o.num_experts, kSortedAlign));
    const int64_t rows = zero_sync_padded_rows(comm.size(), T, k, L, o.align_size, o.row_multiple, o.capacity_factor,
                                               o.min_receive_rows);
    auto plan = std::make_shared<ExchangePlan>(make_device_exchange_plan(o.expert_parallel, d.routing.tokens_per_expert,
                                                                         kSortedAlign, d.routing.rows.size(0),
                                                                         o.align_size, rows, o.most_needed));
    std::vector<Variable> moved = exchange(d.routing.rows, d.routing.probs, plan, ExchangeDirection::to_experts);
    d.rows = moved[0];
    d.probs = moved[1];
    d.tokens_per_expert = plan->device_tokens_per_expert;
    // Never read on a GPU (the layer's GEMMs there are bf16 or FP8, and both take device counts); the
    // CPU's are host memory, read without a sync.
    const Tensor& padded = plan->device_padded_tokens_per_expert;
    d.counts = padded.device().is_cuda() ? ExpertCounts{{}, padded} : gemm_counts(padded, d.rows.data(), o.fp8_experts);
    d.plan = std::move(plan);
    return d;
  }
  d.routing = permute_pad(tokens, topk_idx, probs, o.num_experts, kSortedAlign);
  auto [send_counts, recv_counts] = exchange_counts_once(comm, d.routing.tokens_per_expert);  // THE host sync
  auto plan = std::make_shared<ExchangePlan>(make_exchange_plan(o.expert_parallel, send_counts, recv_counts,
                                                                kSortedAlign, d.routing.rows.size(0), o.align_size,
                                                                o.row_multiple, tokens.device()));
  std::vector<Variable> moved = exchange(d.routing.rows, d.routing.probs, plan, ExchangeDirection::to_experts);
  d.rows = moved[0];
  d.probs = moved[1];
  d.counts = {plan->padded_tokens_per_expert, Tensor()};
  d.tokens_per_expert = Tensor::from_ints(plan->tokens_per_expert, {int64_t(plan->tokens_per_expert.size())});
  d.plan = std::move(plan);
  return d;
}

std::string capacity_factor_error(double capacity_factor, bool sync, const std::string& why_sync) {
  if (capacity_factor <= 0 || !sync) return "";
  std::ostringstream os;
  os << capacity_factor << " bounds the zero-sync exchange's receive buffers, but this run's exchange is sync ("
     << why_sync << "), which sizes its own: set parallel.ep_dispatch: zero_sync, or parallel.ep_capacity_factor: 0";
  return os.str();
}

EpDispatch ep_dispatch_from_name(const std::string& name) {
  return parse_enum(kEpDispatchNames, name, "parallel.ep_dispatch");
}

const char* ep_dispatch_name(EpDispatch mode) { return enum_name(kEpDispatchNames, mode); }

bool resolve_ep_dispatch(EpDispatch mode, Communicator* group) {
  if (!group || group->size() <= 1 || mode == EpDispatch::sync) return false;
  if (mode == EpDispatch::zero_sync) return true;
  // auto takes zero_sync where it was measured ahead (docs/PERF.md): at 2 ranks, as fast in training and
  // faster alone. At 4 the sync exchange (one block per peer) trains faster with a third less memory (the
  // worst-case receive buffers); 8 ranks are not measured. Without device puts (several hosts) zero_sync
  // would read its tables to the host.
  return group->size() == 2 && group->device_puts();
}

Variable combine_return(const Variable& rows, const Dispatched& from) {
  FLOWMOE_CHECK(rows.data().dim() == 2 && rows.size(0) == from.rows.size(0), ShapeError, "combine: rows ",
                rows.data().describe(), " must be [", from.rows.size(0), ", H] (the dispatched rows)");
  return from.plan ? exchange(rows, Variable(), from.plan, ExchangeDirection::to_tokens)[0] : rows;
}

Variable combine_unpermute(const Variable& sorted, const Dispatched& from, const Variable& topk_prob) {
  return unpermute_unpad(sorted, from.routing, topk_prob);
}

Variable combine(const Variable& rows, const Dispatched& from, const Variable& topk_prob) {
  return combine_unpermute(combine_return(rows, from), from, topk_prob);
}

}  // namespace flowmoe
