#include "framework/backend/cuda/lt_gemm.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "framework/backend/cuda/cuda_check.h"
#include "framework/core/rng.h"

namespace hp::cuda {
namespace {

constexpr uint32_t kAlign = 16;
// A data-dependent dimension's buckets up to this many rows are chosen together, at its first
// product (expert rows: up to every token of a 16K batch times top-4 on one expert).
constexpr int64_t kPrefillRows = 65536;

}  // namespace

int bucket_rows(int x) {
  if (x <= 64) return 64;
  int64_t p = 64;
  while (p * 2 < x) p *= 2;  // p < x <= 2p
  const int64_t step = p / 8;
  return static_cast<int>((static_cast<int64_t>(x) + step - 1) / step * step);
}

bool LtGemm::Key::operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }

size_t LtGemm::KeyHash::operator()(const Key& k) const { return hash64_bytes(&k, sizeof(Key)); }

LtGemm::LtGemm() {
  CUBLAS_CHECK(cublasLtCreate(&handle_));
  const cublasOperation_t ops[2] = {CUBLAS_OP_N, CUBLAS_OP_T};
  const cudaDataType bias_types[3] = {CUDA_R_16BF, CUDA_R_16BF, CUDA_R_32F};
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 2; ++j)
      for (int e = 0; e < 3; ++e) {
        cublasLtMatmulDesc_t& d = desc_[i][j][e];
        CUBLAS_CHECK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &ops[i],
                                                    sizeof(ops[i])));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &ops[j],
                                                    sizeof(ops[j])));
        if (e == 0) continue;
        const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        CUBLAS_CHECK(
            cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                    &bias_types[e], sizeof(bias_types[e])));
      }
}

LtGemm::~LtGemm() {
  for (auto& by_b : desc_)
    for (auto& by_epilogue : by_b)
      for (cublasLtMatmulDesc_t d : by_epilogue)
        if (d) cublasLtMatmulDescDestroy(d);
  if (handle_) cublasLtDestroy(handle_);
}

bool LtGemm::run(cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, float alpha,
                 const void* a, int lda, const void* b, int ldb, float beta, void* c,
                 cudaDataType c_type, int ldc, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream, const void* bias, cudaDataType bias_type, bool may_tune,
                 const void* c_in, bool warm) {
  if (!c_in) c_in = c;
  // The cached algorithms are chosen for 16-byte alignment (expert slices of a row-major buffer
  // keep that where rows are a multiple of 8 elements); anything else goes to cublasGemmEx.
  for (const void* p : {a, b, c_in, static_cast<const void*>(c)})
    if (reinterpret_cast<uintptr_t>(p) % kAlign != 0) return false;
  int epilogue = 0;
  if (bias) {
    if (bias_type != CUDA_R_16BF && bias_type != CUDA_R_32F) return false;
    epilogue = bias_type == CUDA_R_16BF ? 1 : 2;
  }
  const int ia = op_a == CUBLAS_OP_T, ib = op_b == CUBLAS_OP_T;
  cublasLtMatmulDesc_t desc = desc_[ia][ib][epilogue];
  // The descriptor is read when the call is issued, so one per shape serves every bias.
  if (bias)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof(bias)));
  const LtLayout la(CUDA_R_16BF, ia ? k : m, ia ? m : k, lda);
  const LtLayout lb(CUDA_R_16BF, ib ? n : k, ib ? k : n, ldb);
  const LtLayout lc(c_type, m, n, ldc);
  Key key;
  std::memset(&key, 0, sizeof(key));
  // A dimension may be bucketed where no stored matrix has it as its row count (so the leading
  // dimensions stay valid for the bucket's problem): n unless op(B) is transposed, k where A is
  // not transposed and B is.
  const int nb = ib ? n : bucket_rows(n), kb = (!ia && ib) ? bucket_rows(k) : k;
  key = Key{ia, ib, m, nb, kb, lda, ldb, ldc, static_cast<int>(c_type), beta == 0, epilogue};
  auto it = algos_.find(key);
  if (it == algos_.end()) {
    // The heuristic for the bucket's largest problem of this shape, asked for every bucket from
    // 64 rows to kPrefillRows (and to this one, if larger) at once: a data-dependent dimension
    // wanders from step to step (an expert's rows go from a few to thousands), and a question
    // to the heuristic costs the host as much as many products cost the GPU, so they are all
    // asked the first time, not one by one in later steps.
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
    std::vector<cublasLtMatmulAlgo_t> chosen;  // the shape's distinct algorithms
    // The entry of the bucket (nq, kq) of this shape, from the heuristic.
    auto ask = [&](int nq, int kq) {
      Key kk = key;
      kk.n_bucket = nq;
      kk.k_bucket = kq;
      if (algos_.count(kk)) return;
      Entry e;
      const LtLayout ba(CUDA_R_16BF, ia ? kq : m, ia ? m : kq, lda);
      const LtLayout bb(CUDA_R_16BF, ib ? nq : kq, ib ? kq : nq, ldb);
      const LtLayout bc(c_type, m, nq, ldc);
      cublasLtMatmulHeuristicResult_t result{};
      int found = 0;
      if (cublasLtMatmulAlgoGetHeuristic(handle_, desc, ba, bb, bc, bc, pref, 1, &result, &found) ==
              CUBLAS_STATUS_SUCCESS &&
          found > 0) {
        e.ok = true;
        e.algo = result.algo;
        auto same = [&](const cublasLtMatmulAlgo_t& x) {
          return std::memcmp(&x, &result.algo, sizeof(x)) == 0;
        };
        if (std::none_of(chosen.begin(), chosen.end(), same)) chosen.push_back(result.algo);
      }
      algos_.emplace(kk, std::move(e));
    };
    const bool n_bucketed = !ib, k_bucketed = !ia && ib;
    if (n_bucketed || k_bucketed) {
      const int bucketed = n_bucketed ? nb : kb;
      auto ask_bucket = [&](int64_t v) {
        ask(n_bucketed ? static_cast<int>(v) : nb, k_bucketed ? static_cast<int>(v) : kb);
      };
      ask_bucket(64);
      for (int64_t lo = 64; lo < std::max<int64_t>(kPrefillRows, bucketed); lo *= 2)
        for (int64_t v = lo + lo / 8; v <= 2 * lo; v += lo / 8) ask_bucket(v);
    } else {
      ask(nb, kb);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    if (warm && chosen.size() > 1)
      warm_algos(chosen, desc, c_type, bias != nullptr, beta, bias, workspace, workspace_bytes,
                 stream);
    it = algos_.find(key);
  }
  Entry& e = it->second;
  if (!e.ok) return false;
  if (e.tuning) {
    finish_tuning(e);
  } else if (autotune_ && may_tune && !e.tuned && (beta == 0 || c_in != c) &&
             2.0 * m * static_cast<double>(n) * k >= kTuneMinFlop) {
    start_tuning(e, desc, la, lb, lc, m, nb, kb, lda, ldb, ldc, c_type, ia, ib, &alpha, a, b, &beta,
                 c_in, c, workspace, workspace_bytes, stream);
  }
  auto product = [&](const cublasLtMatmulAlgo_t& algo) {
    const cublasStatus_t rc = cublasLtMatmul(handle_, desc, &alpha, a, la, b, lb, &beta, c_in, lc,
                                             c, lc, &algo, workspace, workspace_bytes, stream);
    if (rc != CUBLAS_STATUS_SUCCESS && rc != CUBLAS_STATUS_NOT_SUPPORTED &&
        rc != CUBLAS_STATUS_INVALID_VALUE)
      CUBLAS_CHECK(rc);
    return rc == CUBLAS_STATUS_SUCCESS;
  };
  if (product(e.algo)) return true;
  // The tuned algorithm was timed on one size of the bucket; the heuristic's choice, made for
  // the bucket's largest, may still apply to this one.
  return e.tuned && product(e.heuristic);
}

void LtGemm::warm_algos(const std::vector<cublasLtMatmulAlgo_t>& algos, cublasLtMatmulDesc_t desc,
                        cudaDataType c_type, bool has_bias, float beta, const void* bias,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  constexpr int kDim = 64;
  constexpr size_t kOperands = 64 << 10;  // A, B (bf16), C (f32 at most) and a bias
  if (workspace_bytes < 2 * kOperands) return;
  char* base = static_cast<char*>(workspace);
  char* a = base;
  char* b = a + kDim * kDim * 2;
  char* c = b + kDim * kDim * 2;
  const void* scratch_bias = c + kDim * kDim * 4;
  if (has_bias)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                &scratch_bias, sizeof(scratch_bias)));
  const LtLayout l(CUDA_R_16BF, kDim, kDim, kDim), lc(c_type, kDim, kDim, kDim);
  const float alpha = 1.f;
  for (const cublasLtMatmulAlgo_t& algo : algos) {
    const cublasStatus_t rc =
        cublasLtMatmul(handle_, desc, &alpha, a, l, b, l, &beta, c, lc, c, lc, &algo,
                       base + kOperands, workspace_bytes - kOperands, stream);
    if (rc == CUBLAS_STATUS_NOT_SUPPORTED || rc == CUBLAS_STATUS_INVALID_VALUE) continue;
    CUBLAS_CHECK(rc);
    ++warmed_;
  }
  if (has_bias)
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                sizeof(bias)));
}

void LtGemm::start_tuning(Entry& e, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la,
                          cublasLtMatrixLayout_t lb, cublasLtMatrixLayout_t lc, int m, int nq,
                          int kq, int lda, int ldb, int ldc, cudaDataType c_type, bool ia, bool ib,
                          const void* alpha, const void* a, const void* b, const void* beta,
                          const void* c_in, void* c, void* workspace, size_t workspace_bytes,
                          cudaStream_t stream) {
  e.heuristic = e.algo;
  // The candidates, asked for the bucket's largest problem as its first choice was.
  cublasLtMatmulPreference_t pref = nullptr;
  CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                    &workspace_bytes, sizeof(workspace_bytes)));
  for (auto attr :
       {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    const uint32_t align = kAlign;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, attr, &align, sizeof(align)));
  }
  const LtLayout ba(CUDA_R_16BF, ia ? kq : m, ia ? m : kq, lda);
  const LtLayout bb(CUDA_R_16BF, ib ? nq : kq, ib ? kq : nq, ldb);
  const LtLayout bc(c_type, m, nq, ldc);
  cublasLtMatmulHeuristicResult_t results[kTuneCandidates];
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle_, desc, ba, bb, bc, bc, pref,
                                                           kTuneCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  e.tuned = true;  // unless candidates are issued below, the heuristic's choice stays
  if (hs != CUBLAS_STATUS_SUCCESS || found < 2) return;
  auto t = std::make_unique<Tuning>();
  for (int i = 0; i < found; ++i) {
    auto product = [&] {
      return cublasLtMatmul(handle_, desc, alpha, a, la, b, lb, beta, c_in, lc, c, lc,
                            &results[i].algo, workspace, workspace_bytes, stream);
    };
    // An untimed first run loads the kernel and shows whether the candidate applies here.
    const cublasStatus_t rc = product();
    if (rc == CUBLAS_STATUS_NOT_SUPPORTED || rc == CUBLAS_STATUS_INVALID_VALUE) continue;
    CUBLAS_CHECK(rc);
    t->algos.push_back(results[i].algo);
    t->timer.begin(stream);
    for (int r = 0; r < kTuneRuns; ++r) CUBLAS_CHECK(product());
    t->timer.end(stream);
  }
  if (t->algos.size() < 2) return;
  e.tuned = false;
  e.tuning = std::move(t);
}

void LtGemm::finish_tuning(Entry& e) {
  const int best = e.tuning->timer.fastest();
  if (best < 0) return;
  e.algo = e.tuning->algos[static_cast<size_t>(best)];
  e.tuned = true;
  e.tuning.reset();
  ++tuned_;
}

}  // namespace hp::cuda
