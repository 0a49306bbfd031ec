// bf16 GEMMs through cuBLASLt with the algorithm chosen once per shape bucket.
//
// cublasGemmEx runs its heuristic again for every new problem size; the MoE layer issues one
// GEMM per expert with row counts that change every step, so that search costs the host more
// than the GPU needs for the product, and the GPU waits. LtGemm asks cuBLASLt's heuristic once
// per shape bucket: transposes, leading dimensions, output type, beta == 0, the bias epilogue, and
// m, n, k, where n and k are rounded up (to eight steps an octave, bucket_rows) when they are not
// a row count of a stored matrix (the dimensions that follow the data: expert rows), and reuses
// the algorithm for every size in the bucket (cublasLtMatmul checks that it applies; the caller
// falls back to cublasGemmEx where it does not). A shape's buckets up to 65,536 rows are all
// chosen at its first product, so that no question to the heuristic falls in a later step.
// Deterministic for a given algorithm, as cuBLAS is.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <unordered_map>

namespace hp::cuda {

// The bucket a data-dependent GEMM dimension is rounded up to: 64 at least, else the smallest of
// the eight evenly spaced sizes in (2^j, 2^(j+1)] that holds x (at most 1/8 larger than x).
int bucket_rows(int x);

class LtGemm {
 public:
  LtGemm();
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Column-major D = alpha op(A) op(B) + beta C (+ bias[m] on every column where bias is not
  // null) with C == D: A, B bf16; C bf16 or f32 (c_type); bias of bias_type; f32 compute and
  // epilogue. Returns false (nothing issued) where no cached or heuristic algorithm applies.
  bool run(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, float alpha,
           const void* a, int lda, const void* b, int ldb, float beta, void* c, cudaDataType c_type,
           int ldc, void* workspace, size_t workspace_bytes, cudaStream_t stream,
           const void* bias = nullptr, cudaDataType bias_type = CUDA_R_16BF);

 private:
  struct Key {
    int op_a, op_b, m, n_bucket, k_bucket, lda, ldb, ldc, c_type, beta_zero, bias_type;
    bool operator==(const Key& o) const;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  struct Entry {
    bool ok = false;
    cublasLtMatmulAlgo_t algo{};
  };
  cublasLtHandle_t handle_ = nullptr;
  // By op_a, op_b (N, T) and epilogue (none, bias of bf16, bias of f32).
  cublasLtMatmulDesc_t desc_[2][2][3] = {};
  std::unordered_map<Key, Entry, KeyHash> algos_;
};

}  // namespace hp::cuda
