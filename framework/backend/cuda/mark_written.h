// Declaring memory written to compute-sanitizer's initcheck.
//
// initcheck does not see the stores that NVIDIA's Hopper library kernels make through the tensor
// memory accelerator (cuBLASLt's products, cuDNN's fused attention), so the next kernel to read
// such an output would be reported as reading uninitialized memory. The backend declares each
// library output written here, through NVTX's memory API: a no-op unless a tool is attached (the
// GPU suite runs initcheck with --nvtx yes). That the libraries write every element is tested
// (CudaConsistency.GemmWritesEveryElement; the attention outputs are compared with the CPU's in
// full).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace hp::cuda {

// [p, p + bytes) is written by the work issued on `stream` so far.
void mark_written(const void* p, size_t bytes, cudaStream_t stream);

}  // namespace hp::cuda
