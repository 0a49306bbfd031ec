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
// FP8 GEMMs (Backend::gemm_fp8; docs/design.md, "FP8 on the GPU"): the recipe this device's
// block-scaled cuBLASLt GEMMs take (block128 on compute capability 9.x, mxfp8 on 10.x); throws
// on other devices. Throws if `b` is not a CUDA backend.
fp8::Recipe cuda_fp8_recipe(Backend& b);
// x (2-D, f32 or bf16, on the device) quantized as gemm_fp8 quantizes an operand, X = x^T where
// `trans`, else x, blocked along X's columns (the contraction dimension) by `role` under
// `recipe`; returned in the CPU reference's form (framework/core/fp8.h), read back (waits for
// the device). Runs on any device of the build (the MX kernels on Hopper too).
fp8::Quantized cuda_fp8_quantize(Backend& b, const Tensor& x, bool trans, fp8::Recipe recipe,
                                 fp8::Role role);
// The same quantization enqueued and not read back (what a benchmark times).
void cuda_fp8_quantize_only(Backend& b, const Tensor& x, bool trans, fp8::Recipe recipe,
                            fp8::Role role);
// Weights held by Backend::hold_fp8_weights now, and the FP8 products so far that took a held
// weight instead of quantizing it. Throw if `b` is not a CUDA backend.
int64_t cuda_fp8_held_weights(Backend& b);
int64_t cuda_fp8_held_uses(Backend& b);
// FP8 products so far that took the codes a GLU handed on (Backend::glu_fwd_fp8, glu_bwd_fp8)
// instead of quantizing their op(a). Throws if `b` is not a CUDA backend.
int64_t cuda_fp8_handed_uses(Backend& b);
// FP8 products so far whose output went through the fp32 scratch and the combine kernel
// (fp8_gemm.h). Throws if `b` is not a CUDA backend.
int64_t cuda_fp8_scratch_products(Backend& b);
// gemm_fp8_group calls so far whose a operands were quantized together (fp8_quantize_group_data).
// Throws if `b` is not a CUDA backend.
int64_t cuda_fp8_batched_groups(Backend& b);
// The device ordinal of a CUDA backend. Throws if `b` is not a CUDA backend.
int cuda_backend_device(Backend& b);

}  // namespace hp
