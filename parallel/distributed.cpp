// Start-up of a distributed run (see parallel/distributed.h): launcher detection from the environment,
// the backend choice, the world communicator with this rank's device, and the config agreement check.
#include "parallel/distributed.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "parallel/backends.h"

namespace flowmoe {

CommBackend parse_comm_backend(const std::string& name) {
  return parse_enum(kCommBackendNames, name, "parallel.backend");
}

const char* comm_backend_name(CommBackend backend) { return enum_name(kCommBackendNames, backend); }

namespace {

// The variable's value as an integer >= min_value; `fallback` when unset.
int env_int(const EnvLookup& env, const char* name, int min_value, int fallback) {
  const char* text = env(name);
  if (!text) return fallback;
  std::string s(text);
  int value = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  FLOWMOE_CHECK(ec == std::errc() && end == s.data() + s.size() && value >= min_value, ConfigError, "environment ",
                name, "='", s, "' is not an integer >= ", min_value);
  return value;
}

}  // namespace

LaunchInfo detect_launch(const EnvLookup& env) {
  struct Launcher {
    const char *size, *rank, *local_rank;
  };
  static const Launcher kLaunchers[] = {
      {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {"PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"},
      {"SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID"},
      {"SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"},
  };
  LaunchInfo info;
  for (const Launcher& l : kLaunchers) {
    if (!env(l.size)) continue;
    info.launcher = l.size;
    info.world_size = env_int(env, l.size, 1, 1);
    info.rank = env_int(env, l.rank, 0, 0);
    info.local_rank = env_int(env, l.local_rank, 0, 0);
    FLOWMOE_CHECK(info.rank < info.world_size, ConfigError, "environment ", l.rank, "=", info.rank, " is not below ",
                  l.size, "=", info.world_size);
    break;
  }
  return info;
}

LaunchInfo detect_launch() {
  return detect_launch([](const char* name) -> const char* { return std::getenv(name); });
}

CommBackend resolve_backend(CommBackend requested, int world_size, bool use_cuda, bool have_nccl) {
  switch (requested) {
    case CommBackend::automatic:
      if (world_size == 1) return CommBackend::none;
      return use_cuda && have_nccl ? CommBackend::nccl : CommBackend::mpi;
    case CommBackend::none:
      FLOWMOE_CHECK(world_size == 1, ConfigError, "backend none runs one process, but the launcher started ",
                    world_size, " (use auto, mpi or nccl)");
      return requested;
    case CommBackend::nccl:
      FLOWMOE_CHECK(use_cuda, ConfigError, "backend nccl moves GPU tensors, but this run is on the CPU (use mpi)");
      return requested;
    case CommBackend::mpi:
      return requested;
  }
  FLOWMOE_THROW(ConfigError, "unknown communication backend ", int(requested));
}

DistributedRuntime init_distributed(const DistributedOptions& options) {
  DistributedRuntime rt;
  rt.launch = detect_launch();
  rt.backend = resolve_backend(options.backend, rt.launch.world_size, options.use_cuda, built_with_nccl());
  const bool want_mpi = rt.backend == CommBackend::mpi || rt.launch.world_size > 1;
  FLOWMOE_CHECK(!want_mpi || built_with_mpi(), CommError, "started as ", rt.launch.world_size, " processes (",
                rt.launch.launcher.empty() ? "backend mpi" : rt.launch.launcher,
                ") but flowmoe was built without MPI:", " install libopenmpi-dev and rebuild");

  std::shared_ptr<Communicator> host_world = want_mpi ? make_mpi_world_communicator() : make_none_communicator();
  FLOWMOE_CHECK(!want_mpi || rt.launch.launcher.empty() || host_world->size() == rt.launch.world_size, CommError,
                "the launcher started ", rt.launch.world_size, " processes (", rt.launch.launcher, ") but MPI sees ",
                host_world->size(),
                ": was flowmoe started by the mpirun of another MPI than the one it was built with?");
  rt.launch.world_size = host_world->size();
  rt.launch.rank = host_world->rank();
  // The first collective of every rank: a rank given another config or command fails here with the
  // others, before they diverge into collectives it would never join.
  if (host_world->size() > 1) check_same_config(*host_world, options.config_text);
  if (want_mpi && host_world->size() > 1) rt.launch.local_rank = mpi_node_local_rank();

  rt.device = Device::cpu();
  if (options.use_cuda) {
    const int num_gpus = cuda_device_count();
    FLOWMOE_CHECK(num_gpus > 0, DeviceError, "a CUDA run, but no CUDA device is visible on this host");
    // One visible GPU with several local ranks is what `srun --gpus-per-task 1` gives each task (its
    // own); if the ranks do share it, NCCL's start-up says so.
    const bool own_gpu = rt.launch.local_rank < num_gpus || num_gpus == 1;
    if (rt.backend == CommBackend::nccl) {
      // Decided by every rank together: one that gave up alone would leave the others waiting in NCCL.
      Tensor short_of_gpus = Tensor::from_ints({own_gpu ? 0 : 1}, {1}, DType::i32);
      host_world->all_reduce(short_of_gpus, ReduceOp::max);
      FLOWMOE_CHECK(short_of_gpus.to_ints()[0] == 0, DeviceError, "nccl needs one GPU per rank, but a host runs more",
                    " ranks than it has GPUs (this rank: local rank ", rt.launch.local_rank, ", ", num_gpus,
                    " GPUs); backend mpi can share GPUs, staging through host memory: a test transport");
    }
    rt.device = Device::cuda(rt.launch.local_rank % num_gpus);
    cuda_set_device(rt.device.index);
  }
  rt.world = rt.backend == CommBackend::nccl ? make_nccl_communicator(host_world, rt.device.index) : host_world;
  return rt;
}

uint64_t config_hash(const std::string& text) {
  uint64_t h = 14695981039346656037ull;  // FNV-1a 64-bit offset basis
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;  // FNV prime
  }
  return h;
}

namespace {

struct YamlLine {
  std::string path, value;  // "train.steps", "200"; a line opening a map has an empty value
};

// Each key line of a config text as to_yaml writes it (two-space nesting, "key: value", "key:" opening
// a map) with its dotted path. Not a YAML parser: parallel/ has none, and the texts are the engine's own.
std::vector<YamlLine> yaml_lines(const std::string& text) {
  std::vector<YamlLine> out;
  std::vector<std::pair<size_t, std::string>> open;  // the maps the line is inside: indent, key
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    const size_t indent = line.find_first_not_of(' ');
    if (indent == std::string::npos || line[indent] == '#') continue;
    const std::string body = line.substr(indent);
    size_t colon = body.find(": ");
    if (colon == std::string::npos && body.ends_with(':')) colon = body.size() - 1;
    const std::string key = colon == std::string::npos ? body : body.substr(0, colon);
    const std::string value = colon == std::string::npos ? "" : body.substr(std::min(colon + 2, body.size()));
    while (!open.empty() && open.back().first >= indent) open.pop_back();
    std::string path;
    for (const auto& [i, k] : open) path += k + ".";
    path += key;
    if (colon != std::string::npos && value.empty()) open.push_back({indent, key});
    out.push_back({path, value});
  }
  return out;
}

std::string quoted(const YamlLine* l) {
  if (!l) return "nothing";
  return "'" + l->path + (l->value.empty() ? "" : ": " + l->value) + "'";
}

}  // namespace

std::string first_config_difference(const std::string& a, int rank_a, const std::string& b, int rank_b) {
  const std::vector<YamlLine> la = yaml_lines(a), lb = yaml_lines(b);
  for (size_t i = 0; i < std::max(la.size(), lb.size()); ++i) {
    const YamlLine* x = i < la.size() ? &la[i] : nullptr;
    const YamlLine* y = i < lb.size() ? &lb[i] : nullptr;
    if (x && y && x->path == y->path && x->value == y->value) continue;
    if (x && y && x->path == y->path)
      return x->path + " is " + x->value + " on rank " + std::to_string(rank_a) + " and " + y->value + " on rank " +
             std::to_string(rank_b);
    return "rank " + std::to_string(rank_a) + " has " + quoted(x) + " where rank " + std::to_string(rank_b) + " has " +
           quoted(y);
  }
  return "the texts differ only in spacing or comments";
}

// The config text of every rank (a collective): lengths first, then the texts padded to the longest.
static std::vector<std::string> gather_texts(Communicator& comm, const std::string& text) {
  const Tensor len = Tensor::from_ints({int64_t(text.size())}, {1}, DType::i64, comm.native_device());
  const std::vector<int64_t> lens = comm.all_gather(len).to_ints();
  const int64_t width = std::max<int64_t>(*std::max_element(lens.begin(), lens.end()), 1);  // the longest text
  Tensor mine = Tensor::zeros({width}, DType::u8);
  std::copy(text.begin(), text.end(), mine.data<uint8_t>());
  const Tensor all = comm.all_gather(mine.to(comm.native_device())).to(Device::cpu());
  comm.synchronize();
  std::vector<std::string> out;
  const auto* bytes = all.data<uint8_t>();
  for (size_t r = 0; r < lens.size(); ++r) {
    const char* row = reinterpret_cast<const char*>(bytes) + r * size_t(width);
    out.emplace_back(row, size_t(lens[r]));
  }
  return out;
}

void check_same_config(Communicator& comm, const std::string& config_text) {
  const uint64_t mine = config_hash(config_text);
  Tensor local = Tensor::from_ints({int64_t(mine)}, {1}, DType::i64, comm.native_device());
  Tensor all = comm.all_gather(local);
  comm.synchronize();
  std::vector<int64_t> hashes = all.to_ints();
  // The groups in the order of their first rank (rank 0's first), whatever the hash values.
  std::vector<std::pair<uint64_t, std::vector<int>>> ranks_by_hash;
  for (size_t r = 0; r < hashes.size(); ++r) {
    const uint64_t h = uint64_t(hashes[r]);
    auto it = std::find_if(ranks_by_hash.begin(), ranks_by_hash.end(), [h](const auto& g) { return g.first == h; });
    if (it == ranks_by_hash.end()) it = ranks_by_hash.insert(ranks_by_hash.end(), {h, {}});
    it->second.push_back(int(r));
  }
  if (ranks_by_hash.size() == 1) return;
  std::string groups;
  for (const auto& [hash, ranks] : ranks_by_hash) {
    char hex[24];
    std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(hash));
    if (!groups.empty()) groups += "; ";
    groups += ranks.size() == 1 ? "rank " : "ranks ";
    for (size_t i = 0; i < ranks.size() && i < 8; ++i) {
      if (i) groups += ',';
      groups += std::to_string(ranks[i]);
    }
    if (ranks.size() > 8) groups += ",... (" + std::to_string(ranks.size()) + " ranks)";
    groups += std::string(" hash ") + hex;
  }
  // Every rank gets every text, so each names the same key: rank 0's group against the next group's first rank.
  const std::vector<std::string> texts = gather_texts(comm, config_text);
  const int other = ranks_by_hash[1].second.front(), first = ranks_by_hash[0].second.front();
  FLOWMOE_THROW(AllRanksConfigError, "the ranks were given different configs (", groups,
                "): ", first_config_difference(texts[size_t(first)], first, texts[size_t(other)], other),
                "; every rank must read the same config file with the same overrides");
}

}  // namespace flowmoe
