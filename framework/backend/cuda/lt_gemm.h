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
//
// With autotune on, a bucket's first product of at least kTuneMinFlop (beta 0 or C apart from D,
// so a product may be run again on its own output; the caller says may_tune) also times the
// heuristic's candidates for the bucket on its stream, between events, before the product itself;
// the host never waits for them: a later product of the bucket that finds the last event complete
// switches to the fastest candidate. The backend tunes its single products (dense layers, the
// unembedding), not the experts' groups: their rows reach a new bucket in most steps, and the
// candidates' runs then cost more than the winners save.
// Which algorithm wins depends on timings, so the bits may differ from process to process
// (the backend turns autotune off under deterministic=true).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "framework/backend/cuda/candidate_timer.h"
#include "framework/backend/cuda/cuda_check.h"

namespace hp::cuda {

// A cuBLASLt matrix layout created for one call and destroyed with it (creation is a few host
// stores); the bf16 GEMMs here and the FP8 GEMMs (fp8_gemm.cpp) both use it.
class LtLayout {
 public:
  LtLayout(cudaDataType t, uint64_t rows, uint64_t cols, int64_t ld) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l_, t, rows, cols, ld));
  }
  ~LtLayout() { cublasLtMatrixLayoutDestroy(l_); }
  LtLayout(const LtLayout&) = delete;
  LtLayout& operator=(const LtLayout&) = delete;
  operator cublasLtMatrixLayout_t() const { return l_; }

 private:
  cublasLtMatrixLayout_t l_ = nullptr;
};

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
  // null), D at c, C at c_in (c where c_in is null) with D's layout: A, B bf16; C, D bf16 or f32
  // (c_type); bias of bias_type; f32 compute and epilogue. Returns false (nothing issued) where
  // no cached or heuristic algorithm applies. may_tune: the product's bucket may be tuned
  // (autotune on; the caller's products of this shape keep to few buckets). warm: the product's
  // size follows the data (an expert's rows), so later products may land in any bucket of its
  // shape: when the shape's buckets are chosen, each algorithm among them runs once on a small
  // problem in the workspace, which loads its kernel then. CUDA loads a kernel at its first
  // launch; a product whose kernel is new would otherwise stop the host for the load in the
  // middle of a step, and the GPU with it.
  bool run(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, float alpha,
           const void* a, int lda, const void* b, int ldb, float beta, void* c, cudaDataType c_type,
           int ldc, void* workspace, size_t workspace_bytes, cudaStream_t stream,
           const void* bias = nullptr, cudaDataType bias_type = CUDA_R_16BF, bool may_tune = false,
           const void* c_in = nullptr, bool warm = false);

  // Products this large (2 m n k) are worth timing the heuristic's candidates for.
  static constexpr double kTuneMinFlop = 4e9;
  // The heuristic's first candidates timed, each over this many runs after an untimed one.
  static constexpr int kTuneCandidates = 8, kTuneRuns = 2;
  void set_autotune(bool on) { autotune_ = on; }
  // Buckets whose timed candidates have been compared (the winner then runs).
  int tuned_buckets() const { return tuned_; }
  // Algorithms launched on the small problem by warm products (their kernels loaded early).
  int warmed_algos() const { return warmed_; }

 private:
  struct Key {
    int op_a, op_b, m, n_bucket, k_bucket, lda, ldb, ldc, c_type, beta_zero, bias_type;
    bool operator==(const Key& o) const;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  // The candidates of a bucket being timed: algos[i]'s runs are the timer's candidate i.
  struct Tuning {
    std::vector<cublasLtMatmulAlgo_t> algos;
    CandidateTimer timer;
  };
  struct Entry {
    bool ok = false;
    cublasLtMatmulAlgo_t algo{};       // what runs: the heuristic's choice, then the tuned one
    cublasLtMatmulAlgo_t heuristic{};  // where the tuned one does not apply to a size
    bool tuned = false;
    std::unique_ptr<Tuning> tuning;  // while the candidates' timings are outstanding
  };
  // Issues the timed candidates of `e` for this problem on `stream` (nothing waits for them).
  void start_tuning(Entry& e, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                    cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, int m, int nq, int kq,
                    int lda, int ldb, int ldc, cudaDataType c_type, bool ia, bool ib,
                    const void* alpha, const void* a, const void* b, const void* beta,
                    const void* c_in, void* c, void* workspace, size_t workspace_bytes,
                    cudaStream_t stream);
  // Picks the fastest candidate of `e` once its last event has completed; else nothing.
  void finish_tuning(Entry& e);
  // Launches each of `algos` once on a 64 x 64 x 64 product of the desc's kind whose operands
  // are the front of the workspace (zeroed memory or earlier partial sums: the result is not
  // read), the rest of it its workspace; an algorithm that does not take the small problem is
  // left to load at its first real product. Leaves the desc's bias pointer at `bias`.
  void warm_algos(const std::vector<cublasLtMatmulAlgo_t>& algos, cublasLtMatmulDesc_t desc,
                  cudaDataType c_type, bool has_bias, float beta, const void* bias, void* workspace,
                  size_t workspace_bytes, cudaStream_t stream);
  cublasLtHandle_t handle_ = nullptr;
  bool autotune_ = false;
  int tuned_ = 0, warmed_ = 0;
  // By op_a, op_b (N, T) and epilogue (none, bias of bf16, bias of f32).
  cublasLtMatmulDesc_t desc_[2][2][3] = {};
  std::unordered_map<Key, Entry, KeyHash> algos_;
};

}  // namespace hp::cuda
