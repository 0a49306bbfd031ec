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
    CudaBackendOptions cuda;
    cuda.attention = parse_attention_impl(o.device.attention);
    cuda.deterministic = o.device.deterministic;
    cuda.expert_gemm = parse_expert_gemm_impl(o.device.expert_gemm);
    cuda.gemm_autotune = o.device.gemm_autotune;
    cuda.attention_autotune = o.device.attention_autotune;
    return make_cuda_backend(local_rank % gpus, cuda);
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

DataConfig make_data_config(const TrainOptions& o, int rank, int world) {
  DataConfig d;
  d.source = o.data.source;
  d.vocab_size = o.model.vocab_size;
  d.eot_token =
      o.data.eot_token < 0 ? static_cast<int32_t>(o.model.vocab_size - 1) : o.data.eot_token;
  d.seq_len = o.data.seq_len;
  d.rows_per_batch = o.data.rows_per_batch();
  d.rank = rank;
  d.world = world;
  d.seed = o.run.seed;
  d.shuffle = o.data.shuffle;
  d.packing = o.data.packing;
  d.packing_window = o.data.packing_window;
  // Default: every id below the EOT is a content token.
  d.synthetic_vocab = o.data.synthetic_vocab > 0 ? o.data.synthetic_vocab : d.eot_token;
  d.synthetic_zipf = o.data.synthetic_zipf;
  d.synthetic_mean_doc_len = o.data.synthetic_mean_doc_len;
  d.synthetic_doc_len = o.data.synthetic_doc_len;
  return d;
}

double step_model_flops(const ModelConfig& c, const PackedBatch& batch) {
  double flops = 6.0 * static_cast<double>(count_params(c).active) * batch.num_doc_tokens;
  for (int l = 0; l < c.n_layers; ++l)
    flops += 12.0 * batch.attention_pairs(c.window_for_layer(l)) * c.head_dim * c.n_heads;
  return flops;
}

ModelOptions make_model_options(const TrainOptions& o) {
  ModelOptions m;
  m.checkpoint_activations = o.compute.checkpoint_activations;
  m.metadata = o.compute.metadata;
  m.routing = o.compute.routing;
  m.ce_chunk_tokens = o.compute.ce_chunk_tokens;
  m.offload.mode = o.offload.mode;
  m.offload.buffers = o.offload.buffers;
  m.offload.lookahead = o.offload.lookahead;
  m.offload.sim_link_gbps = o.offload.sim_link_gbps;
  m.offload.pinned_pool_bytes = o.offload.pinned_pool_mib << 20;
  if (m.offload.mode != OffloadMode::kNone) m.checkpoint_activations = true;
  m.max_positions = o.data.seq_len;
  return m;
}

}  // namespace hp
