// Checked CUDA and cuBLAS calls: a failure throws hp::Error naming the statement, file:line, the
// rank and the library's own error string.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "framework/core/error.h"

#define CUDA_CHECK(stmt)                                                                        \
  do {                                                                                          \
    cudaError_t hp_cuda_err_ = (stmt);                                                          \
    if (hp_cuda_err_ != cudaSuccess)                                                            \
      HP_FAIL(::hp::ErrorKind::kCuda, #stmt, " failed: ", cudaGetErrorName(hp_cuda_err_), ": ", \
              cudaGetErrorString(hp_cuda_err_));                                                \
  } while (0)

#define CUBLAS_CHECK(stmt)                                                                      \
  do {                                                                                          \
    cublasStatus_t hp_cublas_st_ = (stmt);                                                      \
    if (hp_cublas_st_ != CUBLAS_STATUS_SUCCESS)                                                 \
      HP_FAIL(::hp::ErrorKind::kCublas, #stmt, " failed: ", cublasGetStatusName(hp_cublas_st_), \
              ": ", cublasGetStatusString(hp_cublas_st_));                                      \
  } while (0)

// After a kernel launch: reports launch-configuration errors at the launch site (asynchronous
// faults surface at the next synchronizing call).
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
