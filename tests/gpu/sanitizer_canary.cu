// Kernels with one defect each, for the sanitizer canaries (sanitizer_canary_test.cpp): the GPU
// suite runs each under its tool, with the kernel filter the suite's own runs use, and passes
// only if the tool reports it. A tool or a filter that cannot see hotpath's kernels would
// otherwise report 0 errors and look clean. The kernels live in hp::cuda, as every hotpath kernel.
#include <cuda_runtime.h>

#include <string>

#include "framework/backend/cuda/cuda_check.h"

namespace hp::cuda {
namespace {

// Every thread of two warps writes one shared word and reads it back, with no barrier between:
// write-after-write and read-after-write hazards across warps for racecheck.
__global__ void canary_shared_race_kernel(int* out) {
  __shared__ volatile int word;
  word = static_cast<int>(threadIdx.x);
  out[threadIdx.x] = word;
}

// Reads one element past the end of its buffer: an invalid global read for memcheck.
__global__ void canary_out_of_bounds_kernel(const int* in, int n, int* out) { out[0] = in[n]; }

// Reads memory nothing wrote: an uninitialized global read for initcheck.
__global__ void canary_uninitialized_kernel(const int* in, int* out) { out[0] = in[0] + 1; }

// Every lane of a warp calls __syncwarp with a mask that holds lane 0 only: lanes 1..31 are not
// in the mask they pass, invalid arguments for synccheck.
__global__ void canary_bad_warp_mask_kernel(int* out) {
  __syncwarp(1u);
  out[threadIdx.x] = 1;
}

}  // namespace

// Runs the canary of `tool` ("racecheck", "memcheck", "initcheck", "synccheck") and waits for it.
// Returns false for an unknown tool.
bool run_sanitizer_canary(const char* tool) {
  const std::string t = tool;
  int* out = nullptr;
  int* in = nullptr;
  CUDA_CHECK(cudaMalloc(&out, 64 * sizeof(int)));
  CUDA_CHECK(cudaMemset(out, 0, 64 * sizeof(int)));
  CUDA_CHECK(cudaMalloc(&in, 16 * sizeof(int)));
  bool known = true;
  if (t == "racecheck") {
    canary_shared_race_kernel<<<1, 64>>>(out);
  } else if (t == "memcheck") {
    CUDA_CHECK(cudaMemset(in, 0, 16 * sizeof(int)));
    canary_out_of_bounds_kernel<<<1, 1>>>(in, 16, out);
  } else if (t == "initcheck") {
    canary_uninitialized_kernel<<<1, 1>>>(in, out);
  } else if (t == "synccheck") {
    canary_bad_warp_mask_kernel<<<1, 32>>>(out);
  } else {
    known = false;
  }
  // Under a tool the defect is reported, not raised; without one it may fault: either way the
  // result is not what the canary is for.
  cudaGetLastError();
  cudaDeviceSynchronize();
  cudaGetLastError();
  cudaFree(in);
  cudaFree(out);
  return known;
}

}  // namespace hp::cuda
