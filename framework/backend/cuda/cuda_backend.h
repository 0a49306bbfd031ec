// The CUDA backend: bf16 activations and working weights, f32 master weights, optimizer state,
// accumulation and loss (docs/architecture.md, "Backends and precision"). The backend owns three
// non-blocking streams (compute, copy, comm); ops are issued on the one set_stream chose (compute
// by default) and events order them. Memory comes from the process-wide caching allocator of the
// device.
#pragma once

#include <memory>
#include <string>

#include "framework/backend/backend.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace hp {

// Number of usable CUDA devices; 0 when there is no driver or no GPU. Never throws.
int cuda_device_count();
// Total memory of device `ordinal` in bytes (cudaDeviceProp::totalGlobalMem).
int64_t cuda_device_total_bytes(int ordinal);

// Which attention kernels the backend runs.
enum class AttentionImpl {
  kAuto,   // cuDNN's fused attention where it is loadable and supports the shape, else tiled
  kCudnn,  // cuDNN's; an error where it cannot run
  kTiled,  // the backend's own tiled tensor-core kernels (bitwise deterministic)
};
// Parses "auto", "cudnn" or "tiled" (config key `attention`); throws a UserError naming the key.
AttentionImpl parse_attention_impl(const std::string& s);

// How a group of GEMMs (Backend::gemm_group: the experts of a MoE layer) runs.
enum class ExpertGemmImpl {
  kSerial,   // one cuBLASLt product after another on the compute stream
  kStreams,  // round-robin over the compute stream and side streams, joined after the group
  kGrouped,  // one cublasGemmGroupedBatchedEx call (serial where cuBLAS does not take it)
};
// Parses "serial", "streams" or "grouped" (config key `expert_gemm`); throws a UserError
// naming the key.
ExpertGemmImpl parse_expert_gemm_impl(const std::string& s);

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

// A backend on device `device_ordinal` (makes it the calling thread's current device).
std::unique_ptr<Backend> make_cuda_backend(int device_ordinal,
                                           const CudaBackendOptions& options = {});
// What the backend's attention runs on, e.g. "cudnn 9.19.0 (deterministic backward)" or
// "tiled (libcudnn.so.9 not found)". Throws if `b` is not a CUDA backend.
std::string cuda_attention_description(Backend& b);

// The compute stream of a CUDA backend (for components that order their own streams against it
// with events: communicators, the activation store). Throws if `b` is not a CUDA backend.
CUstream_st* cuda_compute_stream(Backend& b);
// The comm stream of a CUDA backend (StreamKind::kComm): gradient communicators enqueue their
// collectives there so that they overlap compute; events order it against compute. Throws if
// `b` is not a CUDA backend.
CUstream_st* cuda_comm_stream(Backend& b);
// GEMM buckets whose candidate algorithms have been timed and compared (gemm_autotune). Throws
// if `b` is not a CUDA backend.
int cuda_gemm_tuned_buckets(Backend& b);
// cuBLASLt algorithms a MoE layer's expert products will use, launched once on a small problem
// when their shape was first seen so that their kernels load then, not in a later step (lt_gemm.h).
// Throws if `b` is not a CUDA backend.
int cuda_gemm_warmed_algos(Backend& b);
// cuDNN attention forward graphs whose plans have been timed and compared (attention_autotune;
// 0 without cuDNN). Throws if `b` is not a CUDA backend.
int cuda_attention_tuned_graphs(Backend& b);
// The device ordinal of a CUDA backend. Throws if `b` is not a CUDA backend.
int cuda_backend_device(Backend& b);

}  // namespace hp
