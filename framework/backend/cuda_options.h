// The CUDA backend's options, with no CUDA in sight: every build parses and checks them (the
// `attention`, `deterministic`, `expert_gemm`, `gemm_autotune` and `attention_autotune` keys),
// and a CPU build refuses a bad value exactly as a CUDA build does. The backend itself is
// framework/backend/cuda/cuda_backend.h.
#pragma once

#include <string>

namespace hp {

// Which attention kernels the backend runs.
enum class AttentionImpl {
  kAuto,   // cuDNN's fused attention where it is loadable and supports the shape, else tiled
  kCudnn,  // cuDNN's; an error where it cannot run
  kTiled,  // the backend's own tiled tensor-core kernels (bitwise deterministic)
};
// Parses "auto", "cudnn" or "tiled" (config key `attention`); throws a UserError naming the key.
AttentionImpl parse_attention_impl(const std::string& s);
const char* attention_impl_name(AttentionImpl a);

// How a group of GEMMs (Backend::gemm_group: the experts of a MoE layer) runs.
enum class ExpertGemmImpl {
  kSerial,   // one cuBLASLt product after another on the compute stream
  kStreams,  // round-robin over the compute stream and side streams, joined after the group
  kGrouped,  // one cublasGemmGroupedBatchedEx call (serial where cuBLAS does not take it)
};
// Parses "serial", "streams" or "grouped" (config key `expert_gemm`); throws a UserError
// naming the key.
ExpertGemmImpl parse_expert_gemm_impl(const std::string& s);
const char* expert_gemm_impl_name(ExpertGemmImpl e);

struct CudaBackendOptions {
  AttentionImpl attention = AttentionImpl::kAuto;
  // Bitwise-reproducible results. On: cuDNN's forward with cuDNN's atomic-free backward where
  // its workspace (quadratic in the longest sequence) stays under 1 GiB, else the tiled
  // backward. Off: cuDNN's faster backward, whose dQ sums arrive in varying order.
  bool deterministic = false;
  ExpertGemmImpl expert_gemm = ExpertGemmImpl::kStreams;
  // Time cuBLASLt's candidate algorithms for each large GEMM bucket at its first products and
  // keep the fastest (lt_gemm.h); not under deterministic=true, since timings pick the bits.
  bool gemm_autotune = true;
  // Time every plan cuDNN's heuristic offers for each attention forward graph at its first run
  // and keep the fastest (cudnn_attention.h); not under deterministic=true.
  bool attention_autotune = true;
};

}  // namespace hp
