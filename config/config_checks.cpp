// The cross-key checks of validate() (see config_checks.h).
#include "config/config_checks.h"

#include <cstdint>
#include <filesystem>
#include <limits>
#include <sstream>
#include <utility>
#include <vector>

#include "engine/ops/fp8_linear.h"
#include "kernels/attention.h"
#include "kernels/attention_cudnn.h"
#include "kernels/common/error.h"
#include "layers/moe.h"

namespace flowmoe {

namespace fs = std::filesystem;

namespace {

// A value as a stream prints it (doubles with 6 significant digits), for messages.
template <class T>
std::string str(T v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

}  // namespace

void KeyReport::err(const std::string& key, const std::string& msg) const {
  throw ConfigError(c_.origin(key) + ": " + key + ": " + msg);
}

std::string KeyReport::from(const std::string& key) const { return key + " (" + c_.origin(key) + ")"; }

int KeyReport::rank(const std::string& key) const {
  const std::string o = c_.origin(key);
  return o.rfind("--set", 0) == 0 ? 2 : (o == "default" ? 0 : 1);
}

void KeyReport::conflict(const std::vector<std::string>& keys, const std::string& msg) const {
  std::string key = keys.front();
  for (const std::string& k : keys)
    if (rank(k) > rank(key)) key = k;
  std::string others;
  for (const std::string& k : keys)
    if (k != key) others += (others.empty() ? "" : "; ") + k + ": " + c_.origin(k);
  err(key, msg + " (" + others + ")");
}

bool attention_fits_cuda(const ModelConfig& m) {
  return m.attention != AttentionType::mla || attention_value_width_cuda(attention_qk_head_dim(m), m.v_head_dim) > 0;
}

// MLA's shapes (layers/mla.h): RoPE rotates pairs, and the CUDA attention kernels take a query/key head of at
// most kAttentionMaxHeadDimCuda and a value head no wider (the GPU pads the value to the key's width), or a
// query/key head past it, a multiple of 8 up to kAttentionMaxWideHeadDimCuda, with a value head of at most
// kAttentionMaxHeadDimCuda (attention_value_width_cuda).
static void check_mla_shape(const Config& c, const KeyReport& r) {
  const ModelConfig& m = c.model;
  if (m.qk_rope_head_dim % 2 != 0)
    r.err("model.qk_rope_head_dim", str(m.qk_rope_head_dim) + " must be even (RoPE rotates pairs)");
  if (c.train.device == DeviceChoice::cpu || attention_fits_cuda(m)) return;
  const int64_t qk = attention_qk_head_dim(m);
  const std::string qk_keys = "the query/key head model.qk_nope_head_dim + model.qk_rope_head_dim = " + str(qk);
  if (qk > kAttentionMaxWideHeadDimCuda)
    r.conflict({"model.qk_nope_head_dim", "model.qk_rope_head_dim"}, qk_keys + " exceeds the CUDA attention kernels' " +
                                                                         str(kAttentionMaxWideHeadDimCuda) +
                                                                         " (train.device: cpu takes any width)");
  if (qk > kAttentionMaxHeadDimCuda && qk % 8 != 0)
    r.conflict({"model.qk_nope_head_dim", "model.qk_rope_head_dim"},
               qk_keys + " is past " + str(kAttentionMaxHeadDimCuda) +
                   " and not a multiple of 8, which the CUDA attention kernels need there (train.device: cpu takes "
                   "any width)");
  if (qk > kAttentionMaxHeadDimCuda)
    r.conflict({"model.v_head_dim", "model.qk_nope_head_dim", "model.qk_rope_head_dim"},
               "model.v_head_dim = " + str(m.v_head_dim) + " exceeds " + str(kAttentionMaxHeadDimCuda) +
                   ", the widest value head the CUDA attention kernels take beside a query/key head past " +
                   str(kAttentionMaxHeadDimCuda) + " (here " + str(qk) + "; train.device: cpu takes any width)");
  r.conflict({"model.v_head_dim", "model.qk_nope_head_dim", "model.qk_rope_head_dim"},
             "model.v_head_dim = " + str(m.v_head_dim) + " exceeds the query/key head " + str(qk) +
                 ", which the CUDA attention kernels need at least as wide (train.device: cpu takes any width)");
}

void check_model_shape(const Config& c, const KeyReport& r) {
  const ModelConfig& m = c.model;
  if (m.attention == AttentionType::mla) check_mla_shape(c, r);
  if (m.attention == AttentionType::mha && m.hidden_size % m.num_attention_heads != 0)
    r.conflict({"model.hidden_size", "model.num_attention_heads"},
               "model.hidden_size = " + str(m.hidden_size) +
                   " is not divisible by model.num_attention_heads = " + str(m.num_attention_heads));
  if (m.attention == AttentionType::mha && (m.hidden_size / m.num_attention_heads) % 2 != 0)
    r.conflict({"model.num_attention_heads", "model.hidden_size"},
               "the head size model.hidden_size / model.num_attention_heads = " + str(m.hidden_size) + " / " +
                   str(m.num_attention_heads) + " = " + str(m.hidden_size / m.num_attention_heads) +
                   " must be even (RoPE rotates pairs)");
  if (c.data.seq_len > m.max_position_embeddings)
    r.conflict({"data.seq_len", "model.max_position_embeddings"},
               "data.seq_len = " + str(c.data.seq_len) +
                   " exceeds model.max_position_embeddings = " + str(m.max_position_embeddings));
  // Depth D's targets are the tokens D + 1 ahead: a window no longer than D gives that depth none.
  if (m.num_nextn_predict_layers >= c.data.seq_len)
    r.conflict({"model.num_nextn_predict_layers", "data.seq_len"},
               "model.num_nextn_predict_layers = " + str(m.num_nextn_predict_layers) +
                   " leaves its deepest module no target in a window of data.seq_len = " + str(c.data.seq_len) +
                   " tokens (it must be below data.seq_len)");
}

// The router's own check (validate_router_config, the one place its limits are enforced), with its
// errors reported at this file's key names.
void check_moe_routing(const Config& c, const KeyReport& r) {
  const ModelConfig& m = c.model;
  if (m.n_routed_experts == 0) return;
  try {
    validate_router_config(router_config(m), "model.");
  } catch (const RouterConfigError& e) {
    std::vector<std::string> keys;
    for (const std::string& k : e.keys()) keys.push_back("model." + k);
    if (keys.size() == 1) r.err(keys.front(), e.detail());
    r.conflict(keys, e.detail());
  }
  if (m.first_k_dense_replace > m.num_hidden_layers)
    r.err("model.first_k_dense_replace",
          std::to_string(m.first_k_dense_replace) +
              " exceeds model.num_hidden_layers = " + std::to_string(m.num_hidden_layers));
}

static void check_synthetic_data(const Config& c, const KeyReport& r) {
  const DataConfig& d = c.data;
  if (!d.path.empty())
    r.err("data.path", "is set, but data.source is synthetic (" + c.origin("data.source") +
                           "); use source: text or tokens to read files");
  if (c.model.vocab_size < 16) r.err("model.vocab_size", "the synthetic corpus needs vocab_size >= 16");
  double train_tokens = double(d.synthetic_tokens) * (1 - d.val_fraction);
  double val_tokens = double(d.synthetic_tokens) * d.val_fraction;
  if (train_tokens < double(d.seq_len + 1) || (d.val_fraction > 0 && val_tokens < double(d.seq_len + 1)))
    r.conflict({"data.synthetic_tokens", "data.seq_len", "data.val_fraction"},
               "data.synthetic_tokens = " + str(d.synthetic_tokens) +
                   " tokens are too few for one training and one validation sequence of data.seq_len = " +
                   str(d.seq_len) + " tokens, with data.val_fraction = " + str(d.val_fraction) + " held out");
}

// exists: whether data.path must be there (not where a checkpoint is read: parse_checkpoint_config).
static void check_data_files(const Config& c, const KeyReport& r, bool exists) {
  const DataConfig& d = c.data;
  if (d.path.empty()) r.err("data.source", std::string(enum_name(kDataSourceNames, d.source)) + " needs data.path");
  std::error_code ec;
  fs::file_status st = fs::status(d.path, ec);
  if (exists && (ec || !fs::exists(st))) r.err("data.path", "'" + d.path + "' does not exist");
  if (exists && d.source == DataSource::tokens && !fs::is_regular_file(st))
    r.err("data.path", "'" + d.path + "' is not a file (tokens needs a .bin token file)");
  if (d.source == DataSource::text && c.model.vocab_size < 256)
    r.err("model.vocab_size", std::to_string(c.model.vocab_size) + " is too small for byte-level text (" +
                                  r.from("data.source") + "); use vocab_size >= 256");
}

void check_attention_kernel(const Config& c, const KeyReport& r) {
  if (c.model.attention_kernel == AttentionBackend::cudnn && !attention_cudnn_built())
    r.err("model.attention_kernel",
          "cudnn, but this build has no cuDNN attention backend (a CUDA build after "
          "scripts/install_cudnn.sh has it; auto or flash run without)");
}

void check_data_source(const Config& c, const KeyReport& r, bool data_files) {
  if (c.data.source == DataSource::synthetic)
    check_synthetic_data(c, r);
  else
    check_data_files(c, r, data_files);
}

void check_init_from(const Config& c, const KeyReport& r) {
  const std::string& v = c.checkpoint.init_from;
  if (!v.empty() && (v.rfind(kInitFromHfPrefix, 0) != 0 || v.size() == std::string(kInitFromHfPrefix).size()))
    r.err("checkpoint.init_from", "'" + v + "' is not " + kInitFromHfPrefix +
                                      "DIR (a Hugging Face glm4_moe folder: config.json and model.safetensors)");
}

void check_lr_schedule(const Config& c, const KeyReport& r) {
  const OptimizerConfig& o = c.optimizer;
  if (o.min_lr > o.lr)
    r.conflict({"optimizer.min_lr", "optimizer.lr"},
               "optimizer.min_lr = " + str(o.min_lr) + " exceeds optimizer.lr = " + str(o.lr));
  if (o.warmup_steps > c.train.steps)
    r.conflict({"optimizer.warmup_steps", "train.steps"},
               "optimizer.warmup_steps = " + str(o.warmup_steps) + " exceeds train.steps = " + str(c.train.steps));
}

// Whether the size divides the ranks and the experts depends on the launch: checked at start-up
// (run_parallel_state). A dense model has no experts to share out at any launch.
void check_parallel(const Config& c, const KeyReport& r) {
  const int64_t e = c.parallel.expert_parallel_size;
  if (e > 1 && c.model.n_routed_experts == 0)
    r.err("parallel.expert_parallel_size",
          std::to_string(e) + " needs routed experts to share out over the ranks, but " +
              r.from("model.n_routed_experts") + " is 0: a dense model (use 1: the ranks then train data-parallel)");
  const std::string capacity = capacity_factor_error(
      c.parallel.ep_capacity_factor, c.parallel.ep_dispatch == EpDispatch::sync, "parallel.ep_dispatch: sync");
  if (!capacity.empty()) r.conflict({"parallel.ep_capacity_factor", "parallel.ep_dispatch"}, capacity);
  if (c.parallel.dual_microbatch && c.parallel.exchange_chunks > 1)
    r.conflict({"parallel.dual_microbatch", "parallel.exchange_chunks"},
               "two ways of putting the exchange beside compute; choose one (dual_microbatch, or exchange_chunks > 1)");
}

// fp8_blockwise and fp8_flow change only the routed experts' fc1 and fc2 GEMMs (layers/moe.cpp; fp8_flow also
// quantizes the MoE input before dispatch). Refused where that would leave nothing to change, so a
// run never reports a recipe it did not use; and before the MoE layer's own shape check, with the key.
// fp8_full runs every linear but the routers and the LM head in FP8, in dense models too; its dense GEMMs take
// the batch's tokens as rows, so data.seq_len must give a row count they take.
void check_precision_recipe(const Config& c, const KeyReport& r) {
  const MoeRecipe moe_recipe = c.precision.recipe;
  if (moe_recipe == MoeRecipe::bf16) return;
  const std::string recipe = moe_recipe_name(moe_recipe);
  const ModelConfig& m = c.model;
  // FP8 GEMMs use 128x128 weight blocks and 1x128 activation blocks (DESIGN.md §3-4).
  // `what`: how the message names the value when it is not key's own (a product of keys, "... = ").
  auto need128 = [&](const std::string& key, int64_t v, const std::string& gemms, const std::string& what = "") {
    const std::string e = fp8_width_error(v, r.from("precision.recipe") + " = " + recipe, gemms);
    if (!e.empty()) r.err(key, what + e);
  };
  if (moe_flow(moe_recipe).fp8_linears) {
    const int64_t moe_layers = num_moe_layers(m), dense_layers = m.num_hidden_layers - moe_layers;
    need128("model.hidden_size", m.hidden_size, "every linear but the routers and the LM head");
    if (dense_layers > 0) need128("model.intermediate_size", m.intermediate_size, "the dense MLPs' GEMMs");
    if (moe_layers > 0) need128("model.moe_intermediate_size", m.moe_intermediate_size, "the experts' GEMMs");
    if (m.attention == AttentionType::mla) {
      const std::string gemms = "the MLA projections' GEMMs";
      if (m.q_lora_rank > 0) need128("model.q_lora_rank", m.q_lora_rank, gemms);
      need128("model.kv_lora_rank", m.kv_lora_rank, gemms);
      // The other widths are products of keys: q_b_proj (or q_proj) writes heads x (nope + rope), kv_b_proj
      // heads x (nope + v), o_proj reads heads x v. kv_a_proj_with_mqa stays in the compute dtype (layers/mla.h).
      const int64_t nh = m.num_attention_heads;
      for (const auto& [width, keys] : std::vector<std::pair<int64_t, std::string>>{
               {nh * attention_qk_head_dim(m), "model.num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim)"},
               {nh * (m.qk_nope_head_dim + m.v_head_dim),
                "model.num_attention_heads x (qk_nope_head_dim + v_head_dim)"},
               {nh * m.v_head_dim, "model.num_attention_heads x v_head_dim"}})
        need128("model.attention", width, gemms, keys + " = ");
    }
    if (c.data.seq_len % kFp8RowMultiple != 0)
      r.err("data.seq_len", std::to_string(c.data.seq_len) + " is not a multiple of " +
                                std::to_string(kFp8RowMultiple) + ", which " + r.from("precision.recipe") + " = " +
                                recipe +
                                " needs: its FP8 linears take a batch's sequences x data.seq_len tokens as rows, and "
                                "the FP8 GEMMs take row counts in multiples of 16");
    return;
  }
  const std::string scope = recipe + " applies only to the routed experts' GEMMs of MoE layers";
  if (m.n_routed_experts == 0)
    r.conflict({"precision.recipe", "model.n_routed_experts"},
               scope + ", and model.n_routed_experts = 0 builds a dense model (use bf16, or give it experts)");
  if (m.first_k_dense_replace >= m.num_hidden_layers)
    r.conflict({"precision.recipe", "model.first_k_dense_replace", "model.num_hidden_layers"},
               scope + ", and model.first_k_dense_replace = " + std::to_string(m.first_k_dense_replace) +
                   " keeps all model.num_hidden_layers = " + std::to_string(m.num_hidden_layers) +
                   " blocks dense (use bf16, or fewer dense blocks)");
  need128("model.hidden_size", m.hidden_size, "the routed experts' GEMMs");
  need128("model.moe_intermediate_size", m.moe_intermediate_size, "the routed experts' GEMMs");
}

namespace {

// Shape products are int64 and byte counts size_t: 2^60 elements of 8 bytes is the most that fits.
constexpr int64_t kMaxElements = int64_t(1) << 60;

struct Factor {
  const char* key;  // nullptr: a constant of the layout
  int64_t value;
};

// The product of the factors, or INT64_MAX where it would overflow (every factor is positive).
int64_t product(const std::vector<Factor>& factors) {
  int64_t p = 1;
  for (const Factor& f : factors)
    if (__builtin_mul_overflow(p, f.value, &p)) return std::numeric_limits<int64_t>::max();
  return p;
}

void check_elements(const KeyReport& r, const std::string& what, const std::vector<Factor>& factors) {
  if (product(factors) <= kMaxElements) return;
  std::string formula;
  std::vector<std::string> keys;
  for (const Factor& f : factors) {
    formula += (formula.empty() ? "" : " x ") + (f.key ? std::string(f.key) + " " : "") + std::to_string(f.value);
    if (f.key) keys.push_back(f.key);
  }
  r.conflict(keys, what + " would hold " + formula + " elements, more than 2^60 (tensor byte counts are int64); " +
                       "make the model or the micro-batch smaller");
}

}  // namespace

// The routed and shared experts' activations are the products that can pass 2^60 within the keys'
// ranges (logits and the dense MLP stay below it).
void check_tensor_sizes(const Config& c, const KeyReport& r) {
  const ModelConfig& m = c.model;
  if (m.n_routed_experts == 0 || m.first_k_dense_replace >= m.num_hidden_layers) return;
  const Factor batch{"train.batch_size", c.train.batch_size}, seq{"data.seq_len", c.data.seq_len};
  const Factor width{"model.moe_intermediate_size", m.moe_intermediate_size};
  // fc1's output: a row per token and routed expert, gate and up side by side.
  check_elements(r, "one micro-batch's routed-expert activations",
                 {batch, seq, {"model.num_experts_per_tok", m.num_experts_per_tok}, {nullptr, 2}, width});
  // The shared experts run as one MLP n_shared_experts times as wide.
  check_elements(r, "one micro-batch's shared-expert activations",
                 {batch, seq, {"model.n_shared_experts", m.n_shared_experts}, width});
}

}  // namespace flowmoe
