#include "framework/backend/cuda/fp8_gemm.h"

#include <array>
#include <cstring>
#include <limits>
#include <tuple>

#include "framework/backend/cuda/cuda_check.h"
#include "framework/backend/cuda/lt_gemm.h"
#include "framework/backend/cuda/mark_written.h"
#include "framework/core/error.h"
#include "framework/core/rng.h"

namespace hp::cuda {
namespace {

constexpr uint32_t kAlign = 16;

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % kAlign == 0; }

int32_t scale_mode(const Fp8Layout& l) {
  if (l.mx()) return CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0;
  return l.weight ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                  : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
}

class Desc {
 public:
  Desc() { CUBLAS_CHECK(cublasLtMatmulDescCreate(&d_, CUBLAS_COMPUTE_32F, CUDA_R_32F)); }
  ~Desc() { cublasLtMatmulDescDestroy(d_); }
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attr, const T& v) {
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d_, attr, &v, sizeof(v)));
  }
  operator cublasLtMatmulDesc_t() const { return d_; }

 private:
  cublasLtMatmulDesc_t d_ = nullptr;
};

Tensor scratch_bytes(Allocator& alloc, int64_t bytes) {
  return Tensor::empty(alloc, {std::max<int64_t>((bytes + 3) / 4, 1)}, DType::kI32);
}

}  // namespace

Fp8Operand fp8_empty_operand(Allocator& alloc, const Fp8Layout& layout) {
  Fp8Operand q;
  q.layout = layout;
  q.codes = scratch_bytes(alloc, layout.code_bytes());
  q.scales = scratch_bytes(alloc, layout.scale_count() * (layout.mx() ? 1 : 4));
  return q;
}

Fp8Operand fp8_quantize_operand(Allocator& alloc, const Tensor& x, bool trans, fp8::Recipe recipe,
                                fp8::Role role, int64_t row_multiple, int64_t k_multiple,
                                cudaStream_t stream) {
  const int64_t d0 = x.dim(0), d1 = x.dim(1);
  const int64_t rows = trans ? d1 : d0, k = trans ? d0 : d1;
  Fp8Operand q =
      fp8_empty_operand(alloc, fp8_layout(rows, k, recipe, role, row_multiple, k_multiple));
  // x row-major [d0, d1]: X[r][c] = x[r][c], or x[c][r] when transposed.
  launch_fp8_quantize(x.raw(), x.dtype(), trans ? 1 : d1, trans ? d1 : 1, q.layout, q.codes.raw(),
                      q.scales.raw(), stream);
  return q;
}

fp8::Quantized fp8_reference_form(const Fp8Layout& l, const std::vector<uint8_t>& codes,
                                  const std::vector<uint8_t>& scales) {
  HP_CHECK(static_cast<int64_t>(codes.size()) >= l.code_bytes(),
           "fp8_reference_form: ", codes.size(), " code bytes, the layout has ", l.code_bytes());
  HP_CHECK(static_cast<int64_t>(scales.size()) >= l.scale_count() * (l.mx() ? 1 : 4),
           "fp8_reference_form: ", scales.size(), " scale bytes are too few");
  fp8::Quantized q;
  q.rows = l.rows;
  q.k = l.k;
  q.block_k = l.block_k();
  q.block_rows = l.weight ? 128 : 1;
  q.codes.resize(static_cast<size_t>(l.rows * l.k));
  for (int64_t r = 0; r < l.rows; ++r)
    std::memcpy(q.codes.data() + r * l.k, codes.data() + r * l.ldk, static_cast<size_t>(l.k));
  const int64_t rb = (l.rows + q.block_rows - 1) / q.block_rows, kb = l.k_blocks();
  q.scales.resize(static_cast<size_t>(rb * kb));
  if (l.mx()) q.scale_codes.resize(q.scales.size());
  for (int64_t br = 0; br < rb; ++br)
    for (int64_t bc = 0; bc < kb; ++bc) {
      const size_t i = static_cast<size_t>(br * kb + bc);
      const int64_t at = l.scale_index(br * q.block_rows, bc);
      if (l.mx()) {
        q.scale_codes[i] = scales[static_cast<size_t>(at)];
        q.scales[i] = fp8::e8m0_to_float(q.scale_codes[i]);
      } else {
        std::memcpy(&q.scales[i], scales.data() + at * 4, 4);
      }
    }
  return q;
}

bool fp8_device_recipe(int major, fp8::Recipe* recipe) {
  if (major == 9) {
    *recipe = fp8::Recipe::kBlock128;
    return true;
  }
  if (major == 10) {
    *recipe = fp8::Recipe::kMx32;
    return true;
  }
  return false;
}

// ---- Fp8HeldOperands ----------------------------------------------------------------------------

bool Fp8HeldOperands::Key::operator<(const Key& o) const {
  return std::tie(p, d0, d1, dtype, recipe) < std::tie(o.p, o.d0, o.d1, o.dtype, o.recipe);
}

bool Fp8HeldOperands::Key::operator==(const Key& o) const {
  return std::tie(p, d0, d1, dtype, recipe) == std::tie(o.p, o.d0, o.d1, o.dtype, o.recipe);
}

Fp8HeldOperands::Key Fp8HeldOperands::key_of(const Tensor& x, fp8::Recipe recipe) {
  return Key{x.raw(), x.dim(0), x.dim(1), static_cast<int>(x.dtype()), static_cast<int>(recipe)};
}

void Fp8HeldOperands::hold(Allocator& alloc, const std::vector<Tensor>& weights, fp8::Recipe recipe,
                           cudaStream_t stream) {
  const bool mx = recipe == fp8::Recipe::kMx32;
  const fp8::Role role = mx ? fp8::Role::kData : fp8::Role::kWeight;
  // As fp8_gemm quantizes a b operand: rows padded to 8, K to 16 bytes.
  constexpr int64_t kRows = 8, kK = 16;
  std::vector<Fp8WeightPair> pairs[2];  // by dtype: f32, bf16
  for (const Tensor& w : weights) {
    const Key key = key_of(w, recipe);
    if (held_.count(key)) continue;
    Forms f;
    f.role = role;
    const int64_t r = w.dim(0), c = w.dim(1);
    const bool pair_kernel = !mx && c % 8 == 0 && reinterpret_cast<uintptr_t>(w.raw()) % 16 == 0;
    if (!pair_kernel) {
      f.as_stored = fp8_quantize_operand(alloc, w, false, recipe, role, kRows, kK, stream);
      f.transposed = fp8_quantize_operand(alloc, w, true, recipe, role, kRows, kK, stream);
      held_.emplace(key, std::move(f));
      continue;
    }
    f.as_stored = fp8_empty_operand(alloc, fp8_layout(r, c, recipe, role, kRows, kK));
    f.transposed = fp8_empty_operand(alloc, fp8_layout(c, r, recipe, role, kRows, kK));
    Fp8WeightPair p;
    p.x = w.raw();
    p.rows = r;
    p.cols = c;
    p.as_stored = f.as_stored.layout;
    p.transposed = f.transposed.layout;
    p.codes_s = f.as_stored.codes.raw();
    p.scales_s = f.as_stored.scales.raw();
    p.codes_t = f.transposed.codes.raw();
    p.scales_t = f.transposed.scales.raw();
    pairs[w.dtype() == DType::kBF16 ? 1 : 0].push_back(p);
    held_.emplace(key, std::move(f));
  }
  launch_fp8_quantize_weight_pairs(pairs[0], DType::kF32, stream);
  launch_fp8_quantize_weight_pairs(pairs[1], DType::kBF16, stream);
}

const Fp8Operand* Fp8HeldOperands::find(const Tensor& w, bool trans, fp8::Recipe recipe,
                                        fp8::Role role) {
  if (held_.empty() || w.ndim() != 2) return nullptr;
  const auto it = held_.find(key_of(w, recipe));
  if (it == held_.end() || it->second.role != role) return nullptr;
  ++uses_;
  return trans ? &it->second.transposed : &it->second.as_stored;
}

void Fp8HeldOperands::set_next_data(const Tensor& x, Fp8Operand q, fp8::Recipe recipe) {
  next_data_ = std::make_unique<NextData>(NextData{key_of(x, recipe), std::move(q)});
}

std::unique_ptr<Fp8Operand> Fp8HeldOperands::take_next_data(const Tensor& a, bool trans,
                                                            fp8::Recipe recipe,
                                                            const Fp8Layout& narrow) {
  std::unique_ptr<NextData> d = std::move(next_data_);
  if (!d || trans || a.ndim() != 2 || !(d->key == key_of(a, recipe)) || !(d->q.layout == narrow))
    return nullptr;
  ++data_uses_;
  return std::make_unique<Fp8Operand>(std::move(d->q));
}

// ---- Fp8Lt --------------------------------------------------------------------------------------

bool Fp8Lt::Key::operator==(const Key& o) const { return std::memcmp(this, &o, sizeof(Key)) == 0; }

size_t Fp8Lt::KeyHash::operator()(const Key& k) const { return hash64_bytes(&k, sizeof(Key)); }

Fp8Lt::Fp8Lt() { CUBLAS_CHECK(cublasLtCreate(&handle_)); }

Fp8Lt::~Fp8Lt() {
  if (handle_) cublasLtDestroy(handle_);
}

const Fp8Lt::Entry& Fp8Lt::entry(const Key& key, cublasLtMatmulDesc_t desc, const Problem& p,
                                 size_t workspace_bytes) {
  auto it = algos_.find(key);
  if (it != algos_.end()) return it->second;
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
  // The bucket's largest problem (the key's n), the operands' leading dimensions unchanged.
  const LtLayout la(CUDA_R_8F_E4M3, key.k, key.m, key.k);
  const LtLayout lb(CUDA_R_8F_E4M3, key.k, key.n, key.k);
  const LtLayout ld(p.d_type, key.m, key.n, p.ldd);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t rc =
      cublasLtMatmulAlgoGetHeuristic(handle_, desc, la, lb, ld, ld, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  ++queries_;
  Entry e;
  if (rc == CUBLAS_STATUS_SUCCESS && found > 0) {
    e.ok = true;
    e.algo = result.algo;
  } else if (rc != CUBLAS_STATUS_SUCCESS && rc != CUBLAS_STATUS_NOT_SUPPORTED &&
             rc != CUBLAS_STATUS_INVALID_VALUE) {
    CUBLAS_CHECK(rc);
  }
  return algos_.emplace(key, e).first->second;
}

bool Fp8Lt::run(const Problem& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  const Fp8Layout& la = p.a->layout;
  const Fp8Layout& lb = p.b->layout;
  for (const void* ptr :
       std::initializer_list<const void*>{p.a->codes.raw(), p.b->codes.raw(), p.a->scales.raw(),
                                          p.b->scales.raw(), p.c_in, static_cast<const void*>(p.d)})
    if (!aligned(ptr)) return false;
  if (p.bias && !aligned(p.bias)) return false;
  const int32_t mode_a = scale_mode(la), mode_b = scale_mode(lb);
  Desc desc;
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  desc.set(CUBLASLT_MATMUL_DESC_TRANSA, op_t);
  desc.set(CUBLASLT_MATMUL_DESC_TRANSB, op_n);
  desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, mode_a);
  desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, mode_b);
  const void* sa = p.a->scales.raw();
  const void* sb = p.b->scales.raw();
  desc.set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, sa);
  desc.set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, sb);
  if (p.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType bias_type = CUDA_R_16BF;
    desc.set(CUBLASLT_MATMUL_DESC_EPILOGUE, epi);
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, bias_type);
    desc.set(CUBLASLT_MATMUL_DESC_BIAS_POINTER, p.bias);
  }
  Key key;
  std::memset(&key, 0, sizeof(key));
  key = Key{p.m,         bucket_rows(p.n),  p.k, mode_a, mode_b, static_cast<int>(p.d_type),
            p.beta == 0, p.bias != nullptr, 0};
  const LtLayout a(CUDA_R_8F_E4M3, p.k, p.m, la.ldk);
  const LtLayout b(CUDA_R_8F_E4M3, p.k, p.n, lb.ldk);
  const LtLayout d(p.d_type, p.m, p.n, p.ldd);
  const float alpha = 1.f;
  auto product = [&](const Entry& e) {
    if (!e.ok) return false;
    const cublasStatus_t rc =
        cublasLtMatmul(handle_, desc, &alpha, p.a->codes.raw(), a, p.b->codes.raw(), b, &p.beta,
                       p.c_in, d, p.d, d, &e.algo, workspace, workspace_bytes, stream);
    if (rc == CUBLAS_STATUS_NOT_SUPPORTED || rc == CUBLAS_STATUS_INVALID_VALUE) return false;
    CUBLAS_CHECK(rc);
    return true;
  };
  if (product(entry(key, desc, p, workspace_bytes))) return true;
  // The bucket's algorithm does not take this size: the heuristic for the size itself.
  key.n = p.n;
  key.exact = 1;
  return product(entry(key, desc, p, workspace_bytes));
}

// ---- gemm_fp8
// -------------------------------------------------------------------------------------

namespace {

// The product's shape as Fp8Lt::wide knows it: op(b)'s n and k, the recipe and the roles.
uint64_t product_shape(int64_t n, int64_t k, const Backend::Fp8Gemm& spec, fp8::Role role_a,
                       fp8::Role role_b) {
  return hash64_bytes(
      std::array<int64_t, 5>{n, k, static_cast<int64_t>(spec.recipe), static_cast<int64_t>(role_a),
                             static_cast<int64_t>(role_b)}
          .data(),
      5 * sizeof(int64_t));
}

}  // namespace

std::vector<std::unique_ptr<Fp8Operand>> fp8_quantize_group_data(
    const Fp8Context& ctx, const std::vector<Backend::GemmProblem>& ps, bool trans_a, bool trans_b,
    const Backend::Fp8Gemm& spec) {
  std::vector<std::unique_ptr<Fp8Operand>> none;
  fp8::Recipe native{};
  if (ps.size() < 2 || trans_a || spec.recipe != fp8::Recipe::kBlock128 ||
      spec.a != fp8::Role::kData || !fp8_device_recipe(ctx.cc_major, &native) ||
      native != spec.recipe)
    return none;
  const DType t = ps[0].a.dtype();
  const int64_t k = ps[0].a.dim(1);
  std::vector<std::unique_ptr<Fp8Operand>> out(ps.size());
  // Every operand's codes in one buffer and its scales in another, each at a 256-byte boundary
  // (in 4-byte words: the buffers' i32 storage): two allocations a group, not two a product.
  constexpr int64_t kAlignWords = 64;
  auto words = [](int64_t bytes) {
    return (bytes + 4 * kAlignWords - 1) / (4 * kAlignWords) * kAlignWords;
  };
  std::vector<Fp8Layout> layouts(ps.size());
  int64_t code_words = 0, scale_words = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    const Backend::GemmProblem& p = ps[i];
    const int64_t m = p.a.dim(0), n = trans_b ? p.b.dim(0) : p.b.dim(1);
    if (p.a.dtype() != t || p.a.dim(1) != k) return none;
    if (m == 0 || n == 0 || k == 0) continue;  // fp8_gemm quantizes nothing for these
    if (ctx.lt->wide(product_shape(n, k, spec, spec.a, spec.b))) return none;
    layouts[i] = fp8_layout(m, k, spec.recipe, spec.a, 4, 16);
    code_words += words(layouts[i].code_bytes());
    scale_words += words(layouts[i].scale_count() * 4);
  }
  if (code_words == 0) return none;
  const Tensor codes = Tensor::empty(*ctx.alloc, {code_words}, DType::kI32);
  const Tensor scales = Tensor::empty(*ctx.alloc, {scale_words}, DType::kI32);
  std::vector<Fp8DataOperand> ops;
  int64_t code_at = 0, scale_at = 0;
  for (size_t i = 0; i < ps.size(); ++i) {
    const Fp8Layout& l = layouts[i];
    if (l.rows == 0) continue;
    const int64_t cw = words(l.code_bytes()), sw = words(l.scale_count() * 4);
    out[i] = std::make_unique<Fp8Operand>();
    out[i]->layout = l;
    out[i]->codes = codes.slice(code_at, code_at + cw);
    out[i]->scales = scales.slice(scale_at, scale_at + sw);
    code_at += cw;
    scale_at += sw;
    const Backend::GemmProblem& p = ps[i];
    Fp8DataOperand o;
    o.x = p.a.raw();
    o.ld = k;
    o.l = out[i]->layout;
    o.codes = out[i]->codes.raw();
    o.scales = out[i]->scales.raw();
    ops.push_back(o);
  }
  if (ops.empty() || !launch_fp8_quantize_data_batch(ops, t, ctx.stream)) return none;
  return out;
}

void fp8_gemm(const Fp8Context& ctx, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
              Tensor& c, double beta, const Tensor& bias, const Tensor& r,
              const Backend::Fp8Gemm& spec, int64_t spill_rows, const Fp8Operand* quantized_a) {
  const char* op = "gemm_fp8";
  const int64_t m = trans_a ? a.dim(1) : a.dim(0);
  const int64_t k = trans_a ? a.dim(0) : a.dim(1);
  const int64_t n = trans_b ? b.dim(0) : b.dim(1);
  // What a GLU handed on (Backend::glu_fwd_fp8), taken or dropped by this product whatever it is.
  const fp8::Role role_a0 = spec.recipe == fp8::Recipe::kMx32 ? fp8::Role::kData : spec.a;
  const std::unique_ptr<Fp8Operand> handed =
      ctx.held ? ctx.held->take_next_data(a, trans_a, spec.recipe,
                                          fp8_layout(m, k, spec.recipe, role_a0, 4, 16))
               : nullptr;
  if (m == 0 || n == 0) return;
  fp8::Recipe native{};
  if (!fp8_device_recipe(ctx.cc_major, &native))
    HP_FAIL(ErrorKind::kCuda, op,
            ": the CUDA backend's FP8 GEMMs need compute capability 9.x "
            "(recipe block128) or 10.x (recipe mxfp8); CUDA device ",
            ctx.device, " has ", ctx.cc_major, ".", ctx.cc_minor);
  HP_CHECK(spec.recipe == native, op, ": recipe ", fp8::recipe_name(spec.recipe),
           " does not run on CUDA device ", ctx.device, " (compute capability ", ctx.cc_major, ".",
           ctx.cc_minor, "), whose cuBLASLt block-scaled GEMMs take recipe ",
           fp8::recipe_name(native));
  const bool mx = spec.recipe == fp8::Recipe::kMx32;
  const fp8::Role role_a = mx ? fp8::Role::kData : spec.a;
  const fp8::Role role_b = mx ? fp8::Role::kData : spec.b;
  HP_CHECK(role_a != fp8::Role::kWeight || role_b != fp8::Role::kWeight, op,
           ": two weight operands (128x128 tiles on both sides) is not a form cuBLASLt's "
           "block-scaled GEMMs take; one operand must have the data role");
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  HP_CHECK(m < kMaxInt - 8 && n < kMaxInt - 8 && k < kMaxInt - 16, op,
           ": dimensions exceed int range");
  const DType bias_t = bias.defined() ? bias.dtype() : c.dtype();
  if (k == 0) {  // op(a) op(b) is all zeros
    launch_fp8_combine(nullptr, 0, c.raw(), c.dtype(), m, n, beta,
                       bias.defined() ? bias.raw() : nullptr, bias_t,
                       r.defined() ? r.raw() : nullptr, ctx.stream);
    return;
  }
  // Row-major c [m, n] is cuBLASLt's column-major D [n, m] = op(b)^T op(a)^T: its A is op(b)^T
  // (n rows of K), its B is op(a) (m rows of K), both stored K-contiguous ("TN").
  const uint64_t shape = product_shape(n, k, spec, role_a, role_b);
  // The narrow form of a, ready: quantized with the group's others, or handed on by a GLU or the
  // loss.
  const Fp8Operand* ready = quantized_a ? quantized_a : handed.get();
  auto quantize = [&](bool wide, Fp8Operand& qa, Fp8Operand& qb) {
    // Narrow: rows to 4 (a) and 8 (b), K to 16 bytes. Wide: rows to 128, K to the block length.
    const int64_t kq = wide ? fp8::block_k(spec.recipe) : 16;
    qa = !wide && ready ? *ready
                        : fp8_quantize_operand(*ctx.alloc, a, trans_a, spec.recipe, role_a,
                                               wide ? 128 : 4, kq, ctx.stream);
    // A held weight (Backend::hold_fp8_weights) is the narrow form's b operand as it is.
    const Fp8Operand* held =
        !wide && ctx.held ? ctx.held->find(b, !trans_b, spec.recipe, role_b) : nullptr;
    qb = held ? *held
              : fp8_quantize_operand(*ctx.alloc, b, !trans_b, spec.recipe, role_b, wide ? 128 : 8,
                                     kq, ctx.stream);
  };
  auto problem = [](const Fp8Operand& qa, const Fp8Operand& qb) {
    Fp8Lt::Problem p;
    p.a = &qb;
    p.b = &qa;
    p.m = static_cast<int>(qb.layout.rows_pad);
    p.n = static_cast<int>(qa.layout.rows_pad);
    p.k = static_cast<int>(qa.layout.ldk);
    return p;
  };
  // Into an fp32 scratch of the padded shape, then beta * c, bias and residual in one pass.
  auto through_scratch = [&](const Fp8Operand& qa, const Fp8Operand& qb) {
    Fp8Lt::Problem p = problem(qa, qb);
    Tensor d = Tensor::empty(*ctx.alloc, {static_cast<int64_t>(p.m) * p.n}, DType::kF32);
    p.d = d.raw();
    p.d_type = CUDA_R_32F;
    p.ldd = p.m;
    p.c_in = d.raw();
    p.beta = 0.f;
    p.bias = nullptr;
    if (!ctx.lt->run(p, ctx.workspace, ctx.workspace_bytes, ctx.stream)) return false;
    ctx.lt->count_scratch_product();
    mark_written(d.raw(), d.nbytes(), ctx.stream);
    launch_fp8_combine(static_cast<const float*>(d.raw()), p.m, c.raw(), c.dtype(), m, n, beta,
                       bias.defined() ? bias.raw() : nullptr, bias_t,
                       r.defined() ? r.raw() : nullptr, ctx.stream);
    return true;
  };
  Fp8Operand qa, qb;
  if (!ctx.lt->wide(shape)) {
    quantize(false, qa, qb);
    // Straight into c: the epilogue adds beta * c, or the residual as C apart from D, and a
    // bf16 bias.
    const bool bias_ok = !bias.defined() || (bias.dtype() == DType::kBF16 && aligned(bias.raw()));
    // Padded rows past c's end land in rows a later product overwrites (spill_rows); they hold
    // the zero rows' product (and the bias) until then.
    const bool rows_ok = qa.layout.rows_pad == m ||
                         (beta == 0 && !r.defined() && qa.layout.rows_pad - m <= spill_rows);
    if (rows_ok && qb.layout.rows_pad == n && bias_ok && aligned(c.raw()) &&
        (!r.defined() || aligned(r.raw()))) {
      Fp8Lt::Problem p = problem(qa, qb);
      p.d = c.raw();
      p.d_type = c.dtype() == DType::kBF16 ? CUDA_R_16BF : CUDA_R_32F;
      p.ldd = static_cast<int>(n);
      p.c_in = r.defined() ? r.raw() : c.raw();
      p.beta = r.defined() ? 1.f : static_cast<float>(beta);
      p.bias = bias.defined() ? bias.raw() : nullptr;
      if (ctx.lt->run(p, ctx.workspace, ctx.workspace_bytes, ctx.stream)) {
        mark_written(c.raw(), c.nbytes(), ctx.stream);
        return;
      }
    }
    if (through_scratch(qa, qb)) return;
    ctx.lt->set_wide(shape);
  }
  // cuBLASLt took no narrow padding of this product: K padded to whole blocks and rows to 128.
  quantize(true, qa, qb);
  if (!through_scratch(qa, qb))
    HP_FAIL(ErrorKind::kCublas, op, ": cuBLASLt has no ", fp8::recipe_name(spec.recipe),
            " block-scaled FP8 algorithm for ", m, " x ", n, " x ", k, " (scale modes ",
            scale_mode(qb.layout), ", ", scale_mode(qa.layout), ") on CUDA device ", ctx.device,
            " (compute capability ", ctx.cc_major, ".", ctx.cc_minor, ")");
}

}  // namespace hp::cuda
