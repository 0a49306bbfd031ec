// The CUDA backend's FP8 GEMMs (Backend::gemm_fp8; docs/design.md, "FP8 on the GPU"): both
// operands quantized on the device into K-contiguous E4M3 copies with their block scales
// (fp8_layout.h, fp8_quantize.cu), then one cuBLASLt block-scaled matmul in the "TN" form with
// fp32 accumulation and a bf16 or fp32 output:
//  - compute capability 9.x (Hopper): recipe block128, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F
//    for data operands and BLK128x128_32F for weights (cuBLAS takes either on either side, not
//    two weights);
//  - compute capability 10.x (Blackwell): recipe mxfp8, VEC32_UE8M0 for both.
// Another recipe than the device's, or another device, is refused with an error naming both.
//
// The output goes straight into c, with beta * c, a bf16 bias (cuBLASLt's bias epilogue) and a
// residual (cuBLASLt's C apart from D) added in the matmul's fp32 epilogue, where c's rows and
// columns meet cuBLASLt's block-scaling rules (rows a multiple of 4, columns of 8, 16-byte
// pointers) and cuBLASLt has an algorithm for it. Otherwise the product goes to an fp32 scratch
// of padded shape and one kernel adds beta * c, the bias and the residual in double and rounds
// once into c.
//
// The algorithm is chosen once per shape by cuBLASLt's heuristic and cached; the rows of op(a)
// (the tokens of an expert, which change every step) are bucketed as the bf16 path buckets them
// (lt_gemm.h, bucket_rows), with the exact size asked where the bucket's algorithm does not take
// a size.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/cuda/fp8_layout.h"
#include "framework/core/fp8.h"

namespace hp::cuda {

// ---- fp8_quantize.cu ----------------------------------------------------------------------------
// Quantizes X[r][c] = x[r * row_stride + c * col_stride] (r < l.rows, c < l.k; x of x_t, f32
// or bf16) into l's codes and scales (both written in full, padding included).
void launch_fp8_quantize(const void* x, DType x_t, int64_t row_stride, int64_t col_stride,
                         const Fp8Layout& l, void* codes, void* scales, cudaStream_t stream);
// c[i, j] (m x n, c_t) = d[i * ldd + j] (0 where d is null) + beta * c[i, j] (+ bias[j] of bias_t
// where bias is not null) (+ r[i, j], c_t, where r is not null), summed in double and rounded once.
void launch_fp8_combine(const float* d, int64_t ldd, void* c, DType c_t, int64_t m, int64_t n,
                        double beta, const void* bias, DType bias_t, const void* r,
                        cudaStream_t stream);

// ---- fp8_gemm.cpp -------------------------------------------------------------------------------
// A quantized operand on the device: codes and scales in `layout`.
struct Fp8Operand {
  Fp8Layout layout;
  Tensor codes;   // code_bytes() bytes (i32 storage)
  Tensor scales;  // scale_count() fp32 values, or bytes for kMx32 (i32 storage)
};

// X = trans ? x^T : x (x 2-D, f32 or bf16, on the device) quantized along X's columns with
// `role`'s blocks under `recipe`, rows padded to a multiple of `row_multiple` and K to one of
// `k_multiple` (fp8_layout); scratch from `alloc`, work on `stream`.
Fp8Operand fp8_quantize_operand(Allocator& alloc, const Tensor& x, bool trans, fp8::Recipe recipe,
                                fp8::Role role, int64_t row_multiple, int64_t k_multiple,
                                cudaStream_t stream);

// The same operand in the CPU reference's form (framework/core/fp8.h, Quantized) from the
// device buffers' bytes.
fp8::Quantized fp8_reference_form(const Fp8Layout& l, const std::vector<uint8_t>& codes,
                                  const std::vector<uint8_t>& scales);

// The recipe the block-scaled FP8 GEMMs of cuBLASLt take on compute capability `major`
// (block128 on 9, mxfp8 on 10); false where there is none.
bool fp8_device_recipe(int major, fp8::Recipe* recipe);

// cuBLASLt's block-scaled FP8 matmul with algorithms cached per shape.
class Fp8Lt {
 public:
  Fp8Lt();
  ~Fp8Lt();
  Fp8Lt(const Fp8Lt&) = delete;
  Fp8Lt& operator=(const Fp8Lt&) = delete;

  // Column-major D [m, n] (ldd) = A^T B + beta C, cuBLAS's names: A the operand of m rows, B of n
  // rows, both K-contiguous (k = their ldk); C at c_in with D's layout (c_in may be d); bias:
  // bf16 [m] through the bias epilogue, or null. False (nothing issued) where cuBLASLt has no
  // algorithm for it.
  struct Problem {
    const Fp8Operand* a = nullptr;
    const Fp8Operand* b = nullptr;
    int m = 0, n = 0, k = 0;
    float beta = 0;
    const void* c_in = nullptr;
    void* d = nullptr;
    cudaDataType d_type = CUDA_R_16BF;
    int ldd = 0;
    const void* bias = nullptr;
  };
  bool run(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream);

  // Heuristic queries made so far (each shape bucket asks once).
  int heuristic_queries() const { return queries_; }
  // Products (by n, k and the operands' scale modes) that cuBLASLt took only with the widest
  // padding (fp8_gemm): later ones quantize that way at once.
  bool wide(uint64_t shape) const { return wide_.count(shape) != 0; }
  void set_wide(uint64_t shape) { wide_.insert(shape); }

 private:
  struct Key {
    int m, n, k, mode_a, mode_b, d_type, beta_zero, bias, exact;
    bool operator==(const Key& o) const;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  struct Entry {
    bool ok = false;
    cublasLtMatmulAlgo_t algo{};
  };
  const Entry& entry(const Key& key, cublasLtMatmulDesc_t desc, const Problem& p,
                     size_t workspace_bytes);
  cublasLtHandle_t handle_ = nullptr;
  int queries_ = 0;
  std::unordered_map<Key, Entry, KeyHash> algos_;
  std::unordered_set<uint64_t> wide_;
};

// What fp8_gemm runs with: the backend's allocator, stream, cuBLASLt workspace and device.
struct Fp8Context {
  Allocator* alloc = nullptr;
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  Fp8Lt* lt = nullptr;
  int device = 0, cc_major = 0, cc_minor = 0;
};

// Backend::gemm_fp8 on the device (shapes checked by the interface, dtypes by the backend).
void fp8_gemm(const Fp8Context& ctx, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
              Tensor& c, double beta, const Tensor& bias, const Tensor& r,
              const Backend::Fp8Gemm& spec);

}  // namespace hp::cuda
