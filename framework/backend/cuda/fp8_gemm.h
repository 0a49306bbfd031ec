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
// columns meet cuBLASLt's block-scaling rules (rows a multiple of 4, or padded rows that may
// spill into the next product's output; columns of 8, 16-byte pointers) and cuBLASLt has an
// algorithm for it. Otherwise the product goes to an fp32 scratch
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
#include <map>
#include <memory>
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

// A weight W [rows, cols] (row-major, contiguous) quantized in both forms a product takes from
// one read of each 128x128 tile (recipe block128, role kWeight: a tile's scale is the same
// whichever way round it is used): `as_stored` X = W (the b operand of dY W^T), `transposed`
// X = W^T (the b operand of x W). Codes and scales are written in full, padding included.
struct Fp8WeightPair {
  const void* x = nullptr;
  int64_t rows = 0, cols = 0;
  Fp8Layout as_stored, transposed;
  void *codes_s = nullptr, *scales_s = nullptr, *codes_t = nullptr, *scales_t = nullptr;
};
// Every pair quantized, all of x_t, with cols a multiple of 8 and x 16-byte aligned; a few
// launches for all of them (the tiles of up to 16 weights each).
void launch_fp8_quantize_weight_pairs(const std::vector<Fp8WeightPair>& pairs, DType x_t,
                                      cudaStream_t stream);

// Data operands to quantize in one launch (a group's products, Backend::gemm_fp8_group): X [l.rows,
// l.k] K-contiguous at x with row stride ld, into l's codes and scales (written in full, padding
// included, as launch_fp8_quantize writes them: the same bits).
struct Fp8DataOperand {
  const void* x = nullptr;
  int64_t ld = 0;
  Fp8Layout l;
  void* codes = nullptr;
  void* scales = nullptr;
};
// Every operand quantized, all of x_t, in launches of up to 32 operands; false (nothing issued)
// unless all are block128 data layouts of one k and ldk, with k and ld multiples of 8, x 16-byte
// and codes 8-byte aligned.
bool launch_fp8_quantize_data_batch(const std::vector<Fp8DataOperand>& ops, DType x_t,
                                    cudaStream_t stream);

// Backend::glu_fwd_fp8 / glu_bwd_fp8: launch_glu_fwd / launch_glu_bwd's GLU written to a (dh)
// and quantized into `l` as a block128 data operand (X = a: rows x f; X = dh: rows x 2f;
// rows padded to 4), codes and scales in full. False, with nothing done, unless the dtype is
// bf16, f a multiple of 128, the pointers 16-byte aligned and `l` that layout.
bool launch_glu_fwd_fp8(const void* h, void* a, DType t, int64_t rows, int64_t f, int kind,
                        float alpha, float limit, const Fp8Layout& l, void* codes, void* scales,
                        cudaStream_t stream);
bool launch_glu_bwd_fp8(const void* h, const void* da, void* dh, DType t, int64_t rows, int64_t f,
                        int kind, float alpha, float limit, const Fp8Layout& l, void* codes,
                        void* scales, cudaStream_t stream);

// Backend::cross_entropy_fp8: launch_cross_entropy's loss and gradient (the same bits) with the
// gradient also quantized into `l` as a block128 data operand (X = logits: n x v; rows padded
// to 4), codes and scales in full. False, with nothing done, unless the dtype is bf16, v a
// multiple of 128, the pointers 16-byte aligned and `l` that layout.
bool launch_cross_entropy_fp8(void* logits, DType t, const int32_t* targets, int64_t n, int64_t v,
                              float grad_scale, float* loss, const Fp8Layout& l, void* codes,
                              void* scales, Allocator& alloc, cudaStream_t stream);

// ---- fp8_gemm.cpp -------------------------------------------------------------------------------
// A quantized operand on the device: codes and scales in `layout`.
struct Fp8Operand {
  Fp8Layout layout;
  Tensor codes;   // code_bytes() bytes (i32 storage)
  Tensor scales;  // scale_count() fp32 values, or bytes for kMx32 (i32 storage)
};

// Codes and scales for `layout`, from `alloc`, not written.
Fp8Operand fp8_empty_operand(Allocator& alloc, const Fp8Layout& layout);

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
  // Products that went through the fp32 scratch and the combine kernel (fp8_gemm).
  int64_t scratch_products() const { return scratch_products_; }
  void count_scratch_product() { ++scratch_products_; }

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
  int64_t scratch_products_ = 0;
  std::unordered_map<Key, Entry, KeyHash> algos_;
  std::unordered_set<uint64_t> wide_;
};

// Quantized operands kept for later products: the weights of Backend::hold_fp8_weights, both
// forms of each (X = W, X = W^T) as a product's b operand takes them (rows padded to 8, K to 16
// bytes; role kWeight under block128, kData under mxfp8), and the one data operand a GLU or the
// loss hands on to the next product (Backend::glu_fwd_fp8, cross_entropy_fp8); keyed by the
// tensor's storage, shape, dtype and recipe.
class Fp8HeldOperands {
 public:
  // Quantizes `weights` (2-D, f32 or bf16, on the device) under `recipe` on `stream`, scratch
  // from `alloc`; weights held already are kept as they are.
  void hold(Allocator& alloc, const std::vector<Tensor>& weights, fp8::Recipe recipe,
            cudaStream_t stream);
  void release() {
    held_.clear();
    next_data_.reset();
  }
  // A data operand handed on to the next product (Backend::glu_fwd_fp8, glu_bwd_fp8,
  // cross_entropy_fp8): x's codes as gemm_fp8 quantizes op(a) = x.
  void set_next_data(const Tensor& x, Fp8Operand q, fp8::Recipe recipe);
  // The handed-on operand where it is this product's op(a) (a not transposed; same storage,
  // shape, dtype, recipe and layout), else null; nothing is handed on afterwards either way.
  std::unique_ptr<Fp8Operand> take_next_data(const Tensor& a, bool trans, fp8::Recipe recipe,
                                             const Fp8Layout& narrow);
  int64_t data_uses() const { return data_uses_; }
  // The held operand X of w (w^T where `trans`) under `recipe` and `role`, or null; counts a use.
  const Fp8Operand* find(const Tensor& w, bool trans, fp8::Recipe recipe, fp8::Role role);
  // Weights held now, and products that took a held operand so far.
  int64_t size() const { return static_cast<int64_t>(held_.size()); }
  int64_t uses() const { return uses_; }

 private:
  struct Key {
    const void* p;
    int64_t d0, d1;
    int dtype, recipe;
    bool operator<(const Key& o) const;
    bool operator==(const Key& o) const;
  };
  static Key key_of(const Tensor& x, fp8::Recipe recipe);
  struct Forms {
    fp8::Role role;
    Fp8Operand as_stored, transposed;
  };
  std::map<Key, Forms> held_;
  int64_t uses_ = 0;
  struct NextData {
    Key key;
    Fp8Operand q;
  };
  std::unique_ptr<NextData> next_data_;
  int64_t data_uses_ = 0;
};

// What fp8_gemm runs with: the backend's allocator, stream, cuBLASLt workspace and device.
struct Fp8Context {
  Allocator* alloc = nullptr;
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  Fp8Lt* lt = nullptr;
  Fp8HeldOperands* held = nullptr;  // held weights and handed-on data, or null
  int device = 0, cc_major = 0, cc_minor = 0;
};

// Backend::gemm_fp8 on the device (shapes checked by the interface, dtypes by the backend).
// `spill_rows`: rows of c's width and dtype right after c's end that a later product overwrites
// in full (gemm_fp8_group's next problem): with beta 0 and no residual, a product whose rows
// are not a multiple of 4 may then write its padded rows straight into c, past its end,
// instead of going through the fp32 scratch.
// `quantized_a`: op(a) already quantized in the narrow form (rows padded to 4, K to 16), as
// fp8_quantize_group_data gives it, or null.
void fp8_gemm(const Fp8Context& ctx, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
              Tensor& c, double beta, const Tensor& bias, const Tensor& r,
              const Backend::Fp8Gemm& spec, int64_t spill_rows = 0,
              const Fp8Operand* quantized_a = nullptr);

// The a operands of a group's products (Backend::gemm_fp8_group) quantized together, in the
// narrow form fp8_gemm takes, by a few launches instead of one a product: entry i is problem
// i's (null where its product is empty). Empty (nothing issued) where the group does not allow
// it: fewer than two products, a transposed, another recipe than block128 or role than kData,
// a's of different dtypes or K, or a product cuBLASLt takes only in the wide form.
std::vector<std::unique_ptr<Fp8Operand>> fp8_quantize_group_data(
    const Fp8Context& ctx, const std::vector<Backend::GemmProblem>& ps, bool trans_a, bool trans_b,
    const Backend::Fp8Gemm& spec);

}  // namespace hp::cuda
