#include "launch/train/components.h"

#include <string>

#include "framework/core/error.h"
#if HOTPATH_HAVE_CUDA
#include "framework/backend/cuda/cuda_backend.h"
#endif

namespace hp {

std::unique_ptr<Backend> make_backend(const TrainOptions& o, int local_rank) {
  DeviceKind device = o.device.kind;
#if HOTPATH_HAVE_CUDA
  const int gpus = cuda_device_count();
  if (device == DeviceKind::kAuto) device = gpus > 0 ? DeviceKind::kCuda : DeviceKind::kCpu;
  if (device == DeviceKind::kCuda) {
    if (gpus == 0)
      HP_USER_ERROR(ErrorKind::kConfig,
                    "config key 'device': cuda requested but no CUDA device is visible");
    return make_cuda_backend(local_rank % gpus, o.cuda);
  }
#else
  if (device == DeviceKind::kCuda)
    HP_USER_ERROR(ErrorKind::kConfig,
                  "config key 'device': this hotpath was built without CUDA; use device=cpu or "
                  "build the cuda preset");
#endif
  return make_cpu_backend(o.device.cpu_dtype);
}

int64_t visible_device_bytes(const TrainOptions& o, int local_rank) {
#if HOTPATH_HAVE_CUDA
  if (o.device.kind == DeviceKind::kCpu) return 0;
  const int gpus = cuda_device_count();
  return gpus > 0 ? cuda_device_total_bytes(local_rank % gpus) : 0;
#else
  return 0;
#endif
}

double step_model_flops(const ModelConfig& c, const PackedBatch& batch) {
  double flops = 6.0 * static_cast<double>(count_params(c).active) * batch.num_doc_tokens;
  for (int l = 0; l < c.n_layers; ++l)
    flops += 12.0 * batch.attention_pairs(c.window_for_layer(l)) * c.head_dim * c.n_heads;
  return flops;
}

}  // namespace hp
