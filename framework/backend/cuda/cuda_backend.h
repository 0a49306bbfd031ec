// The CUDA backend: bf16 activations and working weights, f32 master weights, optimizer state,
// accumulation and loss (ARCHITECTURE §3). The backend owns three non-blocking streams (compute,
// copy, comm); ops are issued on the one set_stream chose (compute by default) and events order
// them. Memory comes from the process-wide caching allocator of the device.
#pragma once

#include <memory>

#include "framework/backend/backend.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace hp {

// Number of usable CUDA devices; 0 when there is no driver or no GPU. Never throws.
int cuda_device_count();

// A backend on device `device_ordinal` (makes it the calling thread's current device).
std::unique_ptr<Backend> make_cuda_backend(int device_ordinal);

// The compute stream of a CUDA backend (for components that order their own streams against it
// with events: communicators, the activation store). Throws if `b` is not a CUDA backend.
CUstream_st* cuda_compute_stream(Backend& b);
// The comm stream of a CUDA backend (StreamKind::kComm): gradient communicators enqueue their
// collectives there so that they overlap compute; events order it against compute. Throws if
// `b` is not a CUDA backend.
CUstream_st* cuda_comm_stream(Backend& b);
// The device ordinal of a CUDA backend. Throws if `b` is not a CUDA backend.
int cuda_backend_device(Backend& b);

}  // namespace hp
