#include "framework/backend/cuda/lt_gemm.h"

#include <cstring>

#include "framework/backend/cuda/cuda_check.h"
#include "framework/core/rng.h"

namespace hp::cuda {
namespace {

constexpr uint32_t kAlign = 16;

int bucket(int x) {
  int p = 64;
  while (p < x) p *= 2;
  return p;
}

// A matrix layout created for one call and destroyed with it (creation is a few host stores).
class Layout {
 public:
  Layout(cudaDataType t, uint64_t rows, uint64_t cols, int64_t ld) {
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&l_, t, rows, cols, ld));
  }
  ~Layout() { cublasLtMatrixLayoutDestroy(l_); }
  operator cublasLtMatrixLayout_t() const { return l_; }

 private:
  cublasLtMatrixLayout_t l_ = nullptr;
};

}  // namespace

bool LtGemm::Key::operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }

size_t LtGemm::KeyHash::operator()(const Key& k) const { return hash64_bytes(&k, sizeof(Key)); }

LtGemm::LtGemm() {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
  const cublasOperation_t ops[2] = {CUBLAS_OP_N, CUBLAS_OP_T};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j) {
      CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc_[i][j], CUBLAS_COMPUTE_32F, CUDA_R_32F));
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_[i][j], CUBLASLT_MATMUL_DESC_TRANSA, &ops[i],
                                                  sizeof(ops[i])));
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc_[i][j], CUBLASLT_MATMUL_DESC_TRANSB, &ops[j],
                                                  sizeof(ops[j])));
    }
}

LtGemm::~LtGemm() {
  for (auto& row : desc_)
    for (cublasLtMatmulDesc_t d : row)
      if (d) cublasLtMatmulDescDestroy(d);
  if (handle_) cublasLtDestroy(handle_);
}

bool LtGemm::run(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, float alpha,
                 const void* a, int lda, const void* b, int ldb, float beta, void* c,
                 cudaDataType c_type, int ldc, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream) {
  // The cached algorithms are chosen for 16-byte alignment (expert slices of a row-major buffer
  // keep that where rows are a multiple of 8 elements); anything else goes to cublasGemmEx.
  for (const void* p : {a, b, static_cast<const void*>(c)})
    if (reinterpret_cast<uintptr_t>(p) % kAlign != 0) return false;
  const int ia = op_a == CUBLAS_OP_T, ib = op_b == CUBLAS_OP_T;
  cublasLtMatmulDesc_t desc = desc_[ia][ib];
  const Layout la(CUDA_R_16BF, ia ? k : m, ia ? m : k, lda);
  const Layout lb(CUDA_R_16BF, ib ? n : k, ib ? k : n, ldb);
  const Layout lc(c_type, m, n, ldc);
  Key key;
  std::memset(&key, 0, sizeof(key));
  // A dimension may be bucketed where no stored matrix has it as its row count (so the leading
  // dimensions stay valid for the bucket's problem): n unless op(B) is transposed, k where A is
  // not transposed and B is.
  const int nb = ib ? n : bucket(n), kb = (!ia && ib) ? bucket(k) : k;
  key = Key{ia, ib, m, nb, kb, lda, ldb, ldc, static_cast<int>(c_type), beta == 0};
  auto it = algos_.find(key);
  if (it == algos_.end()) {
    // The heuristic for the bucket's largest problem of this shape.
    Entry e;
    const Layout ba(CUDA_R_16BF, ia ? kb : m, ia ? m : kb, lda);
    const Layout bb(CUDA_R_16BF, ib ? nb : kb, ib ? kb : nb, ldb);
    const Layout bc(c_type, m, nb, ldc);
    cublasLtMatmulPreference_t pref = nullptr;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes, sizeof(workspace_bytes)));
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      const uint32_t align = kAlign;
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    if (cublasLtMatmulAlgoGetHeuristic(handle_, desc, ba, bb, bc, bc, pref, 1, &result, &found) ==
            CUBLAS_STATUS_SUCCESS &&
        found > 0) {
      e.ok = true;
      e.algo = result.algo;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    it = algos_.emplace(key, e).first;
  }
  if (!it->second.ok) return false;
  const cublasStatus_t rc = cublasLtMatmul(handle_, desc, &alpha, a, la, b, lb, &beta, c, lc, c, lc,
                                           &it->second.algo, workspace, workspace_bytes, stream);
  if (rc == CUBLAS_STATUS_SUCCESS) return true;
  if (rc != CUBLAS_STATUS_NOT_SUPPORTED && rc != CUBLAS_STATUS_INVALID_VALUE) CUBLAS_CHECK(rc);
  return false;
}

}  // namespace hp::cuda
