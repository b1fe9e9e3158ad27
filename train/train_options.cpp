// The device, compute dtype and MoE options a run's config implies (see train_options.h).
#include "train/train_options.h"

#include "kernels/common/device_api.h"
#include "kernels/common/error.h"

namespace flowmoe {

Device resolve_device(const Config& cfg) {
  const DeviceChoice d = cfg.train.device;
  if (d == DeviceChoice::cpu) return Device::cpu();
  if (d == DeviceChoice::cuda) {
    if (!cuda_available())
      throw ConfigError(cfg.origin("train.device") + ": train.device: cuda was requested, but " +
                        (built_with_cuda() ? "no CUDA device is usable" : "this build has no CUDA backend") +
                        " (use auto or cpu)");
    return Device::cuda(0);
  }
  return cuda_available() ? Device::cuda(0) : Device::cpu();
}

DType compute_dtype_for(Device device) {
  // Every recipe computes in bf16 on the GPU outside its FP8 GEMMs (and fp32 on the CPU).
  return device.is_cuda() ? DType::bf16 : DType::f32;
}

MoeOptions moe_options(const Config& cfg) {
  MoeOptions o(int(cfg.precision.align_size));
  o.recipe = cfg.precision.recipe;
  o.recompute_expert = cfg.train.recomputes("moe_expert");
  o.ep_dispatch = cfg.parallel.ep_dispatch;
  return o;
}

MoeOptions moe_options(const Config& cfg, const ParallelState& ps) {
  MoeOptions o = moe_options(cfg);
  if (ps.expert_parallel_size > 1) o.expert_parallel = ps.expert_parallel;
  const AutoOnOff overlap = cfg.parallel.shared_expert_overlap;
  o.shared_expert_overlap =
      overlap == AutoOnOff::on || (overlap == AutoOnOff::automatic && ps.expert_parallel_size > 1);
  o.exchange_chunks = int(cfg.parallel.exchange_chunks);
  return o;
}

}  // namespace flowmoe
