// The CUDA backend: bf16 activations and working weights, f32 master weights, optimizer state,
// accumulation and loss (docs/architecture.md, "Backends and precision"). The backend owns three
// non-blocking streams (compute, copy, comm); ops are issued on the one set_stream chose (compute
// by default) and events order them. Memory comes from the process-wide caching allocator of the
// device.
#pragma once

#include <memory>
#include <string>

#include "framework/backend/backend.h"
#include "framework/backend/cuda_options.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace hp {

// Number of usable CUDA devices; 0 when there is no driver or no GPU. Never throws.
int cuda_device_count();
// Total memory of device `ordinal` in bytes (cudaDeviceProp::totalGlobalMem).
int64_t cuda_device_total_bytes(int ordinal);

// AttentionImpl, ExpertGemmImpl and CudaBackendOptions: framework/backend/cuda_options.h.

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
