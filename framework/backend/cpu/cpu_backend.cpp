// The CPU reference backend: host memory, CBLAS for matmul, plain loops elsewhere, OpenMP over
// independent rows. Every reduction runs in an order fixed by the data alone (serial, or partial
// sums over fixed chunks added in chunk order), never by thread scheduling, so results are
// bitwise reproducible whatever the thread count. The interface has checked the shapes
// (backend.h); the dtypes, and the values of index tensors, are checked here before any parallel
// region: an exception must not leave an OpenMP region.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/cpu/cpu_copy_queue.h"
#include "framework/backend/cpu/cpu_kernels.h"
#include "framework/core/clip.h"
#include "framework/core/fp8.h"
#include "framework/core/rng.h"

namespace hp {
namespace {

constexpr int64_t kRowChunk = 256;         // rows per partial sum of a column reduction
constexpr int64_t kFlatChunk = 1 << 14;    // elements per partial sum of a flat reduction
constexpr int64_t kParallelMin = 1 << 14;  // smaller element loops stay serial

// ---- argument checks ----------------------------------------------------------------------------

void check_cpu(const char* op, const char* name, const Tensor& t) {
  HP_CHECK(t.defined(), op, ": tensor '", name, "' is undefined");
  HP_CHECK(t.device() == Device::kCPU, op, ": tensor '", name, "' must live on the cpu, got ",
           t.desc());
}

// Shapes are checked by the interface (backend.h); dtypes here.
void check_dtype(const char* op, const char* name, const Tensor& t, DType dtype) {
  check_cpu(op, name, t);
  HP_CHECK(t.dtype() == dtype, op, ": tensor '", name, "' is ", t.desc(), ", expected ",
           dtype_name(dtype));
}

using NamedTensor = std::pair<const char*, const Tensor*>;
void check_dtypes(const char* op, DType dtype, std::initializer_list<NamedTensor> tensors) {
  for (const NamedTensor& t : tensors) check_dtype(op, t.first, *t.second, dtype);
}

// Counts and offsets may be i32 or i64.
void check_count_dtype(const char* op, const char* name, const Tensor& t) {
  check_cpu(op, name, t);
  HP_CHECK(t.dtype() == DType::kI32 || t.dtype() == DType::kI64, op, ": tensor '", name, "' is ",
           t.desc(), ", expected i32 or i64");
}

int64_t load_count(const Tensor& t, int64_t i) {
  return t.dtype() == DType::kI32 ? t.data<int32_t>()[i] : t.data<int64_t>()[i];
}

void store_count(Tensor& t, int64_t i, int64_t v) {
  if (t.dtype() == DType::kI32) {
    t.data<int32_t>()[i] = static_cast<int32_t>(v);
  } else {
    t.data<int64_t>()[i] = v;
  }
}

// Every id in [0, limit).
void check_ids(const char* op, const char* name, const Tensor& ids, int64_t limit) {
  const int32_t* p = ids.data<int32_t>();
  for (int64_t i = 0; i < ids.numel(); ++i) {
    HP_CHECK(p[i] >= 0 && p[i] < limit, op, ": ", name, "[", i, "] = ", p[i],
             " is out of range [0, ", limit, ") (tensor ", ids.desc(), ")");
  }
}

// ---- FP8 GEMM emulation (backend.h, gemm_fp8) -----------------------------------------------

// c = Q(op(a)) @ Q(op(b)) + beta * c + bias + r (docs/design.md, "FP8 training"). Each K block's
// products are summed over E4M3 values, which are multiples of 2^-9 below 2^9: a product is a
// multiple of 2^-18 below 2^18, and a block's sum of at most 128 of them needs 43 bits, so the
// fp64 sum is exact in any order (dgemm's included). The block sums, times both blocks' scales,
// accumulate in fp64 in K order; the result is rounded once to T.
template <typename T>
void fp8_gemm_reference(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                        double beta, const Tensor& bias, const Tensor& r,
                        const Backend::Fp8Gemm& spec) {
  const int64_t m = trans_a ? a.dim(1) : a.dim(0);
  const int64_t k = trans_a ? a.dim(0) : a.dim(1);
  const int64_t n = trans_b ? b.dim(0) : b.dim(1);
  if (m == 0 || n == 0) return;
  const int64_t lda = a.dim(1), ldb = b.dim(1);
  // The operands as float (the fp64 reference backend's values rounded to float first).
  auto as_float = [](const Tensor& t, std::vector<float>& buf) -> const float* {
    if constexpr (std::is_same_v<T, float>) {
      return t.data<float>();
    } else {
      buf.resize(static_cast<size_t>(t.numel()));
      const T* p = t.data<T>();
      for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<float>(p[i]);
      return buf.data();
    }
  };
  std::vector<float> abuf, bbuf;
  const float* ap = as_float(a, abuf);
  const float* bp = as_float(b, bbuf);
  // op(a) as [m, k] and op(b) transposed, [n, k]: both with K along their second index.
  const fp8::Role ra = spec.recipe == fp8::Recipe::kMx32 ? fp8::Role::kData : spec.a;
  const fp8::Role rb = spec.recipe == fp8::Recipe::kMx32 ? fp8::Role::kData : spec.b;
  const fp8::Quantized qa = fp8::quantize(ap, m, k, trans_a ? 1 : lda, trans_a ? lda : 1,
                                          spec.recipe, ra);
  const fp8::Quantized qb = fp8::quantize(bp, n, k, trans_b ? ldb : 1, trans_b ? 1 : ldb,
                                          spec.recipe, rb);
  std::vector<double> acc(static_cast<size_t>(m * n), 0.0);
  if (k > 0) {
    std::vector<double> av(static_cast<size_t>(m * k)), bv(static_cast<size_t>(n * k));
    for (size_t i = 0; i < av.size(); ++i) av[i] = fp8::e4m3_to_float(qa.codes[i]);
    for (size_t i = 0; i < bv.size(); ++i) bv[i] = fp8::e4m3_to_float(qb.codes[i]);
    const int64_t bk = qa.block_k, kb = qa.k_blocks();
    std::vector<double> part(static_cast<size_t>(m * n));
    for (int64_t blk = 0; blk < kb; ++blk) {
      const int64_t k0 = blk * bk, kw = std::min(k, k0 + bk) - k0;
      cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(m),
                  static_cast<int>(n), static_cast<int>(kw), 1.0, av.data() + k0,
                  static_cast<int>(k), bv.data() + k0, static_cast<int>(k), 0.0, part.data(),
                  static_cast<int>(n));
#pragma omp parallel for schedule(static) if (m * n > kParallelMin)
      for (int64_t i = 0; i < m; ++i) {
        const double sa = qa.scale(i, k0);
        for (int64_t j = 0; j < n; ++j) {
          const size_t ij = static_cast<size_t>(i * n + j);
          acc[ij] += part[ij] * (sa * static_cast<double>(qb.scale(j, k0)));
        }
      }
    }
  }
  T* cp = c.data<T>();
  const T* biasp = bias.defined() ? bias.data<T>() : nullptr;
  const T* rp = r.defined() ? r.data<T>() : nullptr;
#pragma omp parallel for schedule(static) if (m * n > kParallelMin)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const size_t ij = static_cast<size_t>(i * n + j);
      double v = acc[ij];
      if (beta != 0) v += beta * static_cast<double>(cp[ij]);
      if (biasp) v += static_cast<double>(biasp[j]);
      if (rp) v += static_cast<double>(rp[ij]);
      cp[ij] = static_cast<T>(v);
    }
  }
}

// ---- element conversions ------------------------------------------------------------------------

// Rounds to float with round-to-odd: truncate toward zero, then set the last bit if inexact.
// Rounding that result to bf16 (nearest even) equals rounding the double to bf16 directly, which
// double rounding through a nearest-even float would not (float keeps > 8 + 2 significand bits).
float round_to_odd_float(double d) {
  float f = static_cast<float>(d);
  if (std::isfinite(d) && static_cast<double>(f) != d) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= 1u;
    std::memcpy(&f, &u, 4);
  }
  return f;
}

template <typename S>
double to_f64(S v) {
  return static_cast<double>(v);
}
template <>
double to_f64<bf16>(bf16 v) {
  return static_cast<double>(static_cast<float>(v));
}

template <typename D>
D from_f64(double v) {
  return static_cast<D>(v);
}
template <>
bf16 from_f64<bf16>(double v) {
  return bf16(round_to_odd_float(v));
}

// Calls f(T{}) with T the C++ type of a float dtype.
template <typename F>
void dispatch_float(const char* op, const Tensor& t, F&& f) {
  switch (t.dtype()) {
    case DType::kF32:
      f(float{});
      break;
    case DType::kF64:
      f(double{});
      break;
    case DType::kBF16:
      f(bf16{});
      break;
    default:
      HP_CHECK(false, op, ": tensor ", t.desc(), " is not of a float dtype");
  }
}

// Same for f32/f64 only (the arithmetic ops; f is never instantiated for bf16).
template <typename F>
void dispatch_f32_f64(const char* op, const Tensor& t, F&& f) {
  switch (t.dtype()) {
    case DType::kF32:
      f(float{});
      break;
    case DType::kF64:
      f(double{});
      break;
    default:
      HP_CHECK(false, op, ": tensor ", t.desc(), " must be f32 or f64");
  }
}

// ---- fixed-order reductions ---------------------------------------------------------------------

// Column sums over rows: returns s[0..n) with s = sum over rows r of what row_fn(r, acc) adds into
// acc. Rows are cut into chunks of kRowChunk, each chunk summed serially in double, the chunk sums
// added in chunk order.
template <typename RowFn>
std::vector<double> reduce_rows(int64_t rows, int64_t n, RowFn row_fn) {
  std::vector<double> sum(static_cast<size_t>(n), 0.0);
  if (rows == 0 || n == 0) return sum;
  const int64_t chunks = (rows + kRowChunk - 1) / kRowChunk;
  std::vector<double> part(static_cast<size_t>(chunks * n), 0.0);
#pragma omp parallel for schedule(static) if (rows * n > kParallelMin)
  for (int64_t c = 0; c < chunks; ++c) {
    double* acc = part.data() + c * n;
    const int64_t end = std::min(rows, (c + 1) * kRowChunk);
    for (int64_t r = c * kRowChunk; r < end; ++r) row_fn(r, acc);
  }
#pragma omp parallel for schedule(static) if (chunks * n > kParallelMin)
  for (int64_t j = 0; j < n; ++j) {
    double s = 0;
    for (int64_t c = 0; c < chunks; ++c) s += part[c * n + j];
    sum[j] = s;
  }
  return sum;
}

// out[j] += s[j]
template <typename T>
void add_sums(const std::vector<double>& s, T* out) {
  for (size_t j = 0; j < s.size(); ++j) out[j] += static_cast<T>(s[j]);
}

// Sum of per-row values in row order (values computed in parallel when rows * row_elems is
// large enough to pay for the threads).
template <typename RowFn>
double sum_rows(int64_t rows, int64_t row_elems, RowFn row_value) {
  std::vector<double> v(static_cast<size_t>(rows));
#pragma omp parallel for schedule(static) if (rows * row_elems > kParallelMin)
  for (int64_t r = 0; r < rows; ++r) v[r] = row_value(r);
  double s = 0;
  for (double x : v) s += x;
  return s;
}

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

// One row of RMSNorm: y = x r w with r = 1 / sqrt(mean(x^2) + eps); returns r. y may alias x.
template <typename T>
T rmsnorm_row_fwd(const T* x, const T* w, int64_t d, double eps, T* y) {
  double ss = 0;
  for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(x[j]) * x[j];
  const T r = static_cast<T>(1.0 / std::sqrt(ss / static_cast<double>(d) + eps));
  for (int64_t j = 0; j < d; ++j) y[j] = x[j] * r * w[j];
  return r;
}

// Its backward: dr/dx_j = -r^3 x_j / D, so dx_j = r (w_j dy_j - x_j r^2 (sum_k dy_k w_k x_k) / D).
// dx may alias dy.
template <typename T>
void rmsnorm_row_bwd(const T* x, const T* w, T r, const T* dy, int64_t d, T* dx, bool add) {
  double s = 0;
  for (int64_t j = 0; j < d; ++j) s += static_cast<double>(dy[j]) * w[j] * x[j];
  const T c = static_cast<T>(s / static_cast<double>(d)) * r * r;
  for (int64_t j = 0; j < d; ++j) {
    const T g = r * (w[j] * dy[j] - x[j] * c);
    dx[j] = add ? dx[j] + g : g;
  }
}

// ---- the backend --------------------------------------------------------------------------------

template <typename T>
class CpuBackend final : public Backend {
 public:
  static constexpr DType kDType = cpu::DTypeOf<T>::kValue;

  Device device() const override { return Device::kCPU; }
  std::string name() const override { return str_cat("cpu-", dtype_name(kDType)); }
  DType act_dtype() const override { return kDType; }
  DType master_dtype() const override { return kDType; }
  Allocator& allocator() override { return host_allocator(); }

  // ---- memory ---------------------------------------------------------------------------------

  void do_fill_normal(Tensor& t, uint64_t key, int64_t offset, double std) override {
    check_cpu("fill_normal", "t", t);
    const int64_t n = t.numel();
    auto draw = [&](auto* out) {
      using V = std::remove_pointer_t<decltype(out)>;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i)
        out[i] = static_cast<V>(
            rng_detail::mul(std, philox_normal(key, static_cast<uint64_t>(offset + i))));
    };
    switch (t.dtype()) {
      case DType::kF32:
        draw(t.data<float>());
        break;
      case DType::kF64:
        draw(t.data<double>());
        break;
      default:
        HP_CHECK(false, "fill_normal: ", t.desc(), " must be f32 or f64");
    }
  }

  void do_fill(Tensor& t, double value) override {
    check_cpu("fill", "t", t);
    const int64_t n = t.numel();
    switch (t.dtype()) {
      case DType::kF32:
        fill_typed(t.data<float>(), n, static_cast<float>(value));
        break;
      case DType::kF64:
        fill_typed(t.data<double>(), n, value);
        break;
      case DType::kBF16:
        fill_typed(t.data<bf16>(), n, from_f64<bf16>(value));
        break;
      case DType::kI32:
        HP_CHECK(value == std::floor(value) && std::fabs(value) <= 2147483647.0, "fill: value ",
                 value, " is not an i32 for tensor ", t.desc());
        fill_typed(t.data<int32_t>(), n, static_cast<int32_t>(value));
        break;
      case DType::kI64:
        HP_CHECK(value == std::floor(value) && std::fabs(value) < 9.2e18, "fill: value ", value,
                 " is not an i64 for tensor ", t.desc());
        fill_typed(t.data<int64_t>(), n, static_cast<int64_t>(value));
        break;
    }
  }

  // Device memory is host memory: an unlabelled copy on the copy stream counts as an offload.
  void do_copy(const Tensor& src, Tensor& dst) override {
    do_copy_over_link(src, dst, CopyDirection::kOffload);
  }

  void do_copy_over_link(const Tensor& src, Tensor& dst, CopyDirection dir) override {
    check_cpu("copy", "src", src);
    check_cpu("copy", "dst", dst);
    if (stream_ == StreamKind::kCopy) {
      copy_queue_.enqueue_copy(src, dst, dir);
      return;
    }
    if (src.nbytes() > 0 && src.raw() != dst.raw())
      std::memmove(dst.raw(), src.raw(), src.nbytes());
  }

  void do_convert(const Tensor& src, Tensor& dst) override {
    check_cpu("convert", "src", src);
    check_cpu("convert", "dst", dst);
    if (src.dtype() == dst.dtype()) {
      dispatch_float("convert", src, [](auto) {});
      copy(src, dst);
      return;
    }
    const int64_t n = src.numel();
    dispatch_float("convert", src, [&](auto s_tag) {
      using S = decltype(s_tag);
      dispatch_float("convert", dst, [&](auto d_tag) {
        using D = decltype(d_tag);
        const S* s = src.data<S>();
        D* d = dst.data<D>();
#pragma omp parallel for schedule(static) if (n > kParallelMin)
        for (int64_t i = 0; i < n; ++i) d[i] = from_f64<D>(to_f64(s[i]));
      });
    });
  }

  void do_read_to_host(const Tensor& src, Tensor& host_dst, SyncCause cause) override {
    copy(src, host_dst);
    if (stream_ == StreamKind::kCopy) copy_queue_.drain();
    syncs_.add(cause);
  }

  void synchronize(SyncCause cause) override {
    copy_queue_.drain();
    syncs_.add(cause);
  }

  // ---- streams and events ---------------------------------------------------------------------
  // Compute and comm work runs on the host thread in issue order; copy() on the copy stream goes
  // to the copy queue's worker. A copy-stream event is the queue ticket at record time; any other
  // event is complete when recorded.

  std::shared_ptr<Event> record_event(StreamKind s) override {
    auto e = std::make_shared<CpuEvent>();
    if (s == StreamKind::kCopy) e->ticket = copy_queue_.last_ticket();
    return e;
  }

  // The copy queue runs in order and host-thread work is done before anything after it is
  // queued, so only the host thread ever has to wait: for a copy-stream ticket.
  void wait_event(StreamKind waiter, const Event& e) override {
    if (waiter != StreamKind::kCopy) copy_queue_.wait(as_cpu_event(e).ticket);
  }

  void event_synchronize(const Event& e, SyncCause cause) override {
    copy_queue_.wait(as_cpu_event(e).ticket);
    syncs_.add(cause);
  }

  void set_simulated_link_gbps(double gbps) override { copy_queue_.set_link_gbps(gbps); }
  // The copy worker asks for the grants: the host thread never waits for one.
  void set_link_arbiter(LinkArbiter* arbiter) override { copy_queue_.set_arbiter(arbiter); }

  // ---- packed batch metadata ------------------------------------------------------------------

  BatchMeta do_upload_batch(const PackedBatch& batch) override {
    BatchMeta meta;
    // Host memory is this backend's device memory: the host copies are the device tensors.
    meta.inputs = Tensor::host_from(batch.inputs, DType::kI32);
    meta.targets = Tensor::host_from(batch.targets, DType::kI32);
    meta.positions = Tensor::host_from(batch.positions, DType::kI32);
    meta.cu_seqlens = Tensor::host_from(batch.cu_seqlens, DType::kI32);
    meta.n_seqs = batch.num_seqs();
    meta.max_seqlen = batch.max_seqlen;
    return meta;
  }

  void do_rebuild_metadata(BatchMeta& meta) override {
    check_dtype("rebuild_metadata", "positions", meta.positions, DType::kI32);
    const int64_t n = meta.positions.numel();
    const int32_t* pos = meta.positions.data<int32_t>();
    std::vector<int32_t> cu{0};
    for (int64_t t = 1; t < n; ++t) {
      if (pos[t] == 0) cu.push_back(static_cast<int32_t>(t));
    }
    if (n > 0) cu.push_back(static_cast<int32_t>(n));
    int32_t max_len = 0;
    for (size_t s = 0; s + 1 < cu.size(); ++s) max_len = std::max(max_len, cu[s + 1] - cu[s]);
    meta.cu_seqlens = Tensor::host_from(cu, DType::kI32);
    meta.n_seqs = static_cast<int64_t>(cu.size()) - 1;
    meta.max_seqlen = max_len;
    syncs_.add(SyncCause::kMetadata);  // the device path reads max_seqlen back
  }

  // ---- dense math -----------------------------------------------------------------------------

  void do_gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
               double alpha, double beta) override {
    check_dtype("gemm", "a", a, kDType);
    check_dtype("gemm", "b", b, kDType);
    check_dtype("gemm", "c", c, kDType);
    const int64_t m = trans_a ? a.dim(1) : a.dim(0);
    const int64_t k = trans_a ? a.dim(0) : a.dim(1);
    const int64_t n = trans_b ? b.dim(0) : b.dim(1);
    if (m == 0 || n == 0) return;
    T* cp = c.data<T>();
    if (k == 0) {  // op(a) @ op(b) is all zeros
      for (int64_t i = 0; i < m * n; ++i) cp[i] = beta == 0 ? T(0) : static_cast<T>(beta) * cp[i];
      return;
    }
    const auto ta = trans_a ? CblasTrans : CblasNoTrans;
    const auto tb = trans_b ? CblasTrans : CblasNoTrans;
    const auto lda = static_cast<int>(a.dim(1));
    const auto ldb = static_cast<int>(b.dim(1));
    if constexpr (std::is_same_v<T, float>) {
      cblas_sgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n),
                  static_cast<int>(k), static_cast<float>(alpha), a.data<float>(), lda,
                  b.data<float>(), ldb, static_cast<float>(beta), cp, static_cast<int>(n));
    } else {
      cblas_dgemm(CblasRowMajor, ta, tb, static_cast<int>(m), static_cast<int>(n),
                  static_cast<int>(k), alpha, a.data<double>(), lda, b.data<double>(), ldb, beta,
                  cp, static_cast<int>(n));
    }
  }

  bool has_fp8_gemms() const override { return true; }

  void do_gemm_fp8(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                   double beta, const Tensor& bias, const Tensor& r,
                   const Fp8Gemm& spec) override {
    check_dtypes("gemm_fp8", kDType, {{"a", &a}, {"b", &b}, {"c", &c}});
    if (bias.defined()) check_dtype("gemm_fp8", "bias", bias, kDType);
    if (r.defined()) check_dtype("gemm_fp8", "r", r, kDType);
    fp8_gemm_reference<T>(a, trans_a, b, trans_b, c, beta, bias, r, spec);
  }

  void do_add_bias(Tensor& y, const Tensor& bias) override {
    check_dtype("add_bias", "y", y, kDType);
    check_dtype("add_bias", "bias", bias, kDType);
    const int64_t m = y.dim(0), n = y.dim(1);
    T* yp = y.data<T>();
    const T* bp = bias.data<T>();
#pragma omp parallel for schedule(static) if (m * n > kParallelMin)
    for (int64_t r = 0; r < m; ++r) cpu::axpy(T(1), bp, yp + r * n, n);
  }

  void do_bias_grad(const Tensor& dy, Tensor& db) override {
    check_dtype("bias_grad", "dy", dy, kDType);
    check_dtype("bias_grad", "db", db, kDType);
    const int64_t m = dy.dim(0), n = dy.dim(1);
    const T* dyp = dy.data<T>();
    add_sums(reduce_rows(m, n,
                         [&](int64_t r, double* acc) {
                           const T* row = dyp + r * n;
                           for (int64_t j = 0; j < n; ++j) acc[j] += row[j];
                         }),
             db.data<T>());
  }

  void do_add(const Tensor& a, const Tensor& b, Tensor& out) override {
    check_cpu("add", "a", a);
    check_cpu("add", "b", b);
    check_cpu("add", "out", out);
    HP_CHECK(a.dtype() == b.dtype() && a.dtype() == out.dtype(), "add: a ", a.desc(), ", b ",
             b.desc(), " and out ", out.desc(), " must have one dtype");
    const int64_t n = a.numel();
    dispatch_f32_f64("add", a, [&](auto tag) {
      using S = decltype(tag);
      const S* ap = a.data<S>();
      const S* bp = b.data<S>();
      S* op = out.data<S>();
#pragma omp parallel for schedule(static) if (n > kParallelMin)
      for (int64_t i = 0; i < n; ++i) op[i] = ap[i] + bp[i];
    });
  }

  void do_axpy(double alpha, const Tensor& x, Tensor& y) override {
    check_cpu("axpy", "x", x);
    check_cpu("axpy", "y", y);
    HP_CHECK(x.dtype() == y.dtype(), "axpy: x ", x.desc(), " and y ", y.desc(),
             " must have one dtype");
    const int64_t n = x.numel();
    dispatch_f32_f64("axpy", x, [&](auto tag) {
      using S = decltype(tag);
      const S* xp = x.data<S>();
      S* yp = y.data<S>();
      const S al = static_cast<S>(alpha);
#pragma omp parallel for schedule(static) if (n > kParallelMin)
      for (int64_t i = 0; i < n; ++i) yp[i] += al * xp[i];
    });
  }

  // ---- normalization and position -------------------------------------------------------------

  void do_rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, Tensor& y,
                      Tensor& rstd) override {
    const char* op = "rmsnorm_fwd";
    check_dtype(op, "x", x, kDType);
    check_dtype(op, "w", w, kDType);
    check_dtype(op, "y", y, kDType);
    check_dtype(op, "rstd", rstd, kDType);
    const int64_t m = x.dim(0), d = x.dim(1);
    const T* xp = x.data<T>();
    const T* wp = w.data<T>();
    T* yp = y.data<T>();
    T* rp = rstd.data<T>();
#pragma omp parallel for schedule(static) if (m * d > kParallelMin)
    for (int64_t r = 0; r < m; ++r) rp[r] = rmsnorm_row_fwd(xp + r * d, wp, d, eps, yp + r * d);
  }

  // dw_j = sum over rows of dy_j x_j r.
  void do_rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                      Tensor& dx, Tensor& dw, bool accumulate_dx) override {
    const char* op = "rmsnorm_bwd";
    check_dtypes(op, kDType,
                 {{"x", &x}, {"w", &w}, {"rstd", &rstd}, {"dy", &dy}, {"dx", &dx}, {"dw", &dw}});
    const int64_t m = x.dim(0), d = x.dim(1);
    const T* xp = x.data<T>();
    const T* wp = w.data<T>();
    const T* rp = rstd.data<T>();
    const T* dyp = dy.data<T>();
    T* dxp = dx.data<T>();
    // dw first: dx may alias dy.
    add_sums(reduce_rows(m, d,
                         [&](int64_t r, double* acc) {
                           const T* xr = xp + r * d;
                           const T* dyr = dyp + r * d;
                           const double rs = rp[r];
                           for (int64_t j = 0; j < d; ++j) {
                             acc[j] += static_cast<double>(dyr[j]) * xr[j] * rs;
                           }
                         }),
             dw.data<T>());
#pragma omp parallel for schedule(static) if (m * d > kParallelMin)
    for (int64_t r = 0; r < m; ++r) {
      rmsnorm_row_bwd(xp + r * d, wp, rp[r], dyp + r * d, d, dxp + r * d, accumulate_dx);
    }
  }

  void do_rope(Tensor& x, int n_rot_heads, const Tensor& positions, const RopeTable& table,
               bool inverse) override {
    const char* op = "rope";
    check_dtype(op, "x", x, kDType);
    check_dtype(op, "positions", positions, DType::kI32);
    check_dtype(op, "table.cos", table.cos, kDType);
    check_dtype(op, "table.sin", table.sin, kDType);
    const int64_t n = x.dim(0), h = x.dim(1), d = x.dim(2);
    const int64_t half = d / 2;
    const int64_t n_pos = table.cos.dim(0);
    check_ids(op, "positions", positions, n_pos);
    T* xp = x.data<T>();
    const int32_t* pos = positions.data<int32_t>();
    const T* cs = table.cos.data<T>();
    const T* sn = table.sin.data<T>();
    const T sign = inverse ? T(-1) : T(1);
#pragma omp parallel for schedule(static) if (n * n_rot_heads * d > kParallelMin)
    for (int64_t t = 0; t < n; ++t) {
      const T* c = cs + pos[t] * half;
      const T* s = sn + pos[t] * half;
      for (int64_t hh = 0; hh < n_rot_heads; ++hh) {
        T* x1 = xp + (t * h + hh) * d;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const T a = x1[i], b = x2[i], si = sign * s[i];
          x1[i] = a * c[i] - b * si;
          x2[i] = b * c[i] + a * si;
        }
      }
    }
  }

  void do_qk_norm_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                      int64_t n_kv_heads, double eps, Tensor& out, Tensor& rstd) override {
    const char* op = "qk_norm_fwd";
    check_dtypes(op, kDType,
                 {{"qkv", &qkv}, {"qw", &qw}, {"kw", &kw}, {"out", &out}, {"rstd", &rstd}});
    const int64_t n = qkv.dim(0), h = qkv.dim(1), d = qkv.dim(2), h_norm = n_heads + n_kv_heads;
    const T* xp = qkv.data<T>();
    T* yp = out.data<T>();
    T* rp = rstd.data<T>();
#pragma omp parallel for schedule(static) if (n * h * d > kParallelMin)
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t hh = 0; hh < h; ++hh) {
        const T* x = xp + (t * h + hh) * d;
        T* y = yp + (t * h + hh) * d;
        if (hh < h_norm) {
          const T* w = hh < n_heads ? qw.data<T>() : kw.data<T>();
          rp[t * h_norm + hh] = rmsnorm_row_fwd(x, w, d, eps, y);
        } else if (y != x) {
          std::memcpy(y, x, static_cast<size_t>(d) * sizeof(T));
        }
      }
    }
  }

  void do_qk_norm_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                      int64_t n_kv_heads, const Tensor& rstd, const Tensor& dout, Tensor& din,
                      Tensor& dqw, Tensor& dkw) override {
    const char* op = "qk_norm_bwd";
    check_dtypes(op, kDType,
                 {{"qkv", &qkv},
                  {"qw", &qw},
                  {"kw", &kw},
                  {"rstd", &rstd},
                  {"dout", &dout},
                  {"din", &din},
                  {"dqw", &dqw},
                  {"dkw", &dkw}});
    const int64_t n = qkv.dim(0), h = qkv.dim(1), d = qkv.dim(2), h_norm = n_heads + n_kv_heads;
    const T* xp = qkv.data<T>();
    const T* rp = rstd.data<T>();
    const T* dyp = dout.data<T>();
    T* dxp = din.data<T>();
    // Weight gradients first (din may alias dout): [dqw | dkw] as one 2D-wide column sum.
    const std::vector<double> dw = reduce_rows(n, 2 * d, [&](int64_t t, double* acc) {
      for (int64_t hh = 0; hh < h_norm; ++hh) {
        const T* x = xp + (t * h + hh) * d;
        const T* dy = dyp + (t * h + hh) * d;
        const double r = rp[t * h_norm + hh];
        double* a = acc + (hh < n_heads ? 0 : d);
        for (int64_t j = 0; j < d; ++j) a[j] += static_cast<double>(dy[j]) * x[j] * r;
      }
    });
    for (int64_t j = 0; j < d; ++j) {
      dqw.data<T>()[j] += static_cast<T>(dw[j]);
      dkw.data<T>()[j] += static_cast<T>(dw[d + j]);
    }
#pragma omp parallel for schedule(static) if (n * h * d > kParallelMin)
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t hh = 0; hh < h; ++hh) {
        const T* dy = dyp + (t * h + hh) * d;
        T* dx = dxp + (t * h + hh) * d;
        if (hh < h_norm) {
          const T* w = hh < n_heads ? qw.data<T>() : kw.data<T>();
          rmsnorm_row_bwd(xp + (t * h + hh) * d, w, rp[t * h_norm + hh], dy, d, dx, false);
        } else if (dx != dy) {
          std::memcpy(dx, dy, static_cast<size_t>(d) * sizeof(T));
        }
      }
    }
  }

  // ---- attention ------------------------------------------------------------------------------

  void do_attention_fwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                        const AttentionShape& shape, Tensor& out, Tensor& lse) override {
    const char* op = "attention_fwd";
    const cpu::AttnLayout layout = attention_layout(op, qkv, sinks, meta, shape);
    check_dtype(op, "out", out, kDType);
    check_dtype(op, "lse", lse, kDType);
    cpu::attention_fwd<T>(layout, qkv.data<T>(), sinks.defined() ? sinks.data<T>() : nullptr,
                          out.data<T>(), lse.data<T>());
  }

  void do_attention_bwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                        const AttentionShape& shape, const Tensor& out, const Tensor& lse,
                        const Tensor& dout, Tensor& dqkv, Tensor& dsinks) override {
    const char* op = "attention_bwd";
    const cpu::AttnLayout layout = attention_layout(op, qkv, sinks, meta, shape);
    check_dtype(op, "out", out, kDType);
    check_dtype(op, "lse", lse, kDType);
    check_dtype(op, "dout", dout, kDType);
    check_dtype(op, "dqkv", dqkv, kDType);
    if (sinks.defined()) check_dtype(op, "dsinks", dsinks, kDType);
    cpu::attention_bwd<T>(layout, qkv.data<T>(), sinks.defined() ? sinks.data<T>() : nullptr,
                          out.data<T>(), lse.data<T>(), dout.data<T>(), dqkv.data<T>(),
                          sinks.defined() ? dsinks.data<T>() : nullptr);
  }

  // ---- feed-forward activations ---------------------------------------------------------------

  void do_glu_fwd(const Tensor& h, const GluParams& p, Tensor& a) override {
    const char* op = "glu_fwd";
    check_dtype(op, "h", h, kDType);
    check_dtype(op, "a", a, kDType);
    const int64_t m = h.dim(0), f = h.dim(1) / 2;
    const T* hp = h.data<T>();
    T* ap = a.data<T>();
    const bool gpt_oss = p.kind == GluKind::kGptOss;
    const T alpha = static_cast<T>(p.alpha), limit = static_cast<T>(p.limit);
#pragma omp parallel for schedule(static) if (m * f > kParallelMin)
    for (int64_t r = 0; r < m; ++r) {
      const T* g = hp + r * 2 * f;
      const T* u = g + f;
      T* ar = ap + r * f;
      for (int64_t j = 0; j < f; ++j) {
        if (gpt_oss) {
          const T gc = std::min(g[j], limit);
          const T uc = std::min(std::max(u[j], -limit), limit);
          ar[j] = gc * sigmoid(alpha * gc) * (uc + T(1));
        } else {
          ar[j] = g[j] * sigmoid(g[j]) * u[j];
        }
      }
    }
  }

  // SwiGLU: da/dg = u (s + g s (1 - s)), da/du = g s with s = sigmoid(g). GPT-OSS, with
  // s = sigmoid(alpha gc): da/dgc = (uc + 1)(s + alpha gc s (1 - s)), da/duc = gc s; the clamps
  // pass the gradient inside their closed ranges (g <= L, -L <= u <= L) and block it outside.
  void do_glu_bwd(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh) override {
    const char* op = "glu_bwd";
    check_dtype(op, "h", h, kDType);
    check_dtype(op, "da", da, kDType);
    check_dtype(op, "dh", dh, kDType);
    const int64_t m = h.dim(0), f = h.dim(1) / 2;
    const T* hp = h.data<T>();
    const T* dap = da.data<T>();
    T* dhp = dh.data<T>();
    const bool gpt_oss = p.kind == GluKind::kGptOss;
    const T alpha = static_cast<T>(p.alpha), limit = static_cast<T>(p.limit);
#pragma omp parallel for schedule(static) if (m * f > kParallelMin)
    for (int64_t r = 0; r < m; ++r) {
      const T* g = hp + r * 2 * f;
      const T* u = g + f;
      const T* dar = dap + r * f;
      T* dg = dhp + r * 2 * f;
      T* du = dg + f;
      for (int64_t j = 0; j < f; ++j) {
        if (gpt_oss) {
          const T gc = std::min(g[j], limit);
          const T uc = std::min(std::max(u[j], -limit), limit);
          const T s = sigmoid(alpha * gc);
          const T dgc = dar[j] * (uc + T(1)) * (s + alpha * gc * s * (T(1) - s));
          const T duc = dar[j] * gc * s;
          dg[j] = g[j] <= limit ? dgc : T(0);
          du[j] = (u[j] >= -limit && u[j] <= limit) ? duc : T(0);
        } else {
          const T s = sigmoid(g[j]);
          dg[j] = dar[j] * u[j] * (s + g[j] * s * (T(1) - s));
          du[j] = dar[j] * g[j] * s;
        }
      }
    }
  }

  // ---- mixture-of-experts routing -------------------------------------------------------------

  void do_router_topk(const Tensor& logits, int k, Tensor& idx, Tensor& w) override {
    const char* op = "router_topk";
    check_dtype(op, "logits", logits, kDType);
    check_dtype(op, "idx", idx, DType::kI32);
    check_dtype(op, "w", w, kDType);
    const int64_t n = logits.dim(0), e = logits.dim(1);
    const T* lp = logits.data<T>();
    int32_t* ip = idx.data<int32_t>();
    T* wp = w.data<T>();
#pragma omp parallel if (n * e > kParallelMin)
    {
      std::vector<int32_t> order(static_cast<size_t>(e));
#pragma omp for schedule(static)
      for (int64_t r = 0; r < n; ++r) {
        const T* l = lp + r * e;
        std::iota(order.begin(), order.end(), 0);
        // A strict total order: larger logit first, then lower expert id.
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [l](int32_t a, int32_t b) {
          return l[a] > l[b] || (l[a] == l[b] && a < b);
        });
        const T mx = l[order[0]];
        double denom = 0;
        for (int s = 0; s < k; ++s) denom += std::exp(static_cast<double>(l[order[s]] - mx));
        for (int s = 0; s < k; ++s) {
          ip[r * k + s] = order[s];
          wp[r * k + s] = static_cast<T>(std::exp(static_cast<double>(l[order[s]] - mx)) / denom);
        }
      }
    }
  }

  // Softmax backward over the picked logits: dl_s = w_s (dw_s - sum_r w_r dw_r).
  void do_router_topk_bwd(const Tensor& idx, const Tensor& w, const Tensor& dw,
                          Tensor& dlogits) override {
    const char* op = "router_topk_bwd";
    check_dtype(op, "idx", idx, DType::kI32);
    check_dtype(op, "w", w, kDType);
    check_dtype(op, "dw", dw, kDType);
    check_dtype(op, "dlogits", dlogits, kDType);
    const int64_t n = idx.dim(0), k = idx.dim(1), e = dlogits.dim(1);
    check_ids(op, "idx", idx, e);
    const int32_t* ip = idx.data<int32_t>();
    const T* wp = w.data<T>();
    const T* dwp = dw.data<T>();
    T* dl = dlogits.data<T>();
#pragma omp parallel for schedule(static) if (n * e > kParallelMin)
    for (int64_t r = 0; r < n; ++r) {
      T* dr = dl + r * e;
      std::fill(dr, dr + e, T(0));
      const T* wr = wp + r * k;
      const T* dwr = dwp + r * k;
      const T s = cpu::dot(wr, dwr, k);
      for (int64_t j = 0; j < k; ++j) dr[ip[r * k + j]] = wr[j] * (dwr[j] - s);
    }
  }

  // loss = coef E / N * sum_t sum_e f_e p_te, so dloss/dlogit_tj = coef E / N * p_tj (f_j - c_t)
  // with c_t = sum_e f_e p_te.
  void do_router_aux_loss(const Tensor& logits, const Tensor& counts, int k, double coef,
                          Tensor& loss, Tensor& dlogits) override {
    const char* op = "router_aux_loss";
    check_dtype(op, "logits", logits, kDType);
    check_count_dtype(op, "counts", counts);
    check_dtype(op, "loss", loss, kDType);
    check_dtype(op, "dlogits", dlogits, kDType);
    const int64_t n = logits.dim(0), e = logits.dim(1);
    if (n == 0) return;
    std::vector<double> f(static_cast<size_t>(e));
    for (int64_t j = 0; j < e; ++j) {
      f[j] = static_cast<double>(load_count(counts, j)) / static_cast<double>(n * k);
    }
    const double g = coef * static_cast<double>(e) / static_cast<double>(n);
    const T* lp = logits.data<T>();
    T* dl = dlogits.data<T>();
    const double total = sum_rows(n, e, [&](int64_t r) {
      const T* l = lp + r * e;
      T* d = dl + r * e;
      T mx = l[0];
      for (int64_t j = 1; j < e; ++j) mx = std::max(mx, l[j]);
      double denom = 0;
      for (int64_t j = 0; j < e; ++j) denom += std::exp(static_cast<double>(l[j] - mx));
      double c = 0;
      for (int64_t j = 0; j < e; ++j) c += f[j] * std::exp(static_cast<double>(l[j] - mx)) / denom;
      for (int64_t j = 0; j < e; ++j) {
        const double pj = std::exp(static_cast<double>(l[j] - mx)) / denom;
        d[j] += static_cast<T>(g * pj * (f[j] - c));
      }
      return c;
    });
    loss.data<T>()[0] += static_cast<T>(g * total);
  }

  void do_histogram(const Tensor& ids, int n_bins, Tensor& counts) override {
    const char* op = "histogram";
    check_dtype(op, "ids", ids, DType::kI32);
    check_count_dtype(op, "counts", counts);
    check_ids(op, "ids", ids, n_bins);
    std::vector<int64_t> c(static_cast<size_t>(n_bins), 0);
    const int32_t* ip = ids.data<int32_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) ++c[ip[i]];
    for (int b = 0; b < n_bins; ++b) store_count(counts, b, c[b]);
  }

  void do_exclusive_scan(const Tensor& counts, Tensor& offsets) override {
    const char* op = "exclusive_scan";
    check_count_dtype(op, "counts", counts);
    check_count_dtype(op, "offsets", offsets);
    int64_t acc = 0;
    store_count(offsets, 0, 0);
    for (int64_t i = 0; i < counts.numel(); ++i) {
      acc += load_count(counts, i);
      store_count(offsets, i + 1, acc);
    }
  }

  // Counting sort: a cursor per id starts at its offset; assignments are placed in index order,
  // which makes the sort stable.
  void do_sort_by_id(const Tensor& ids, const Tensor& offsets, Tensor& sorted_to_assign,
                     Tensor& assign_to_sorted) override {
    const char* op = "sort_by_id";
    check_dtype(op, "ids", ids, DType::kI32);
    check_count_dtype(op, "offsets", offsets);
    check_dtype(op, "sorted_to_assign", sorted_to_assign, DType::kI32);
    check_dtype(op, "assign_to_sorted", assign_to_sorted, DType::kI32);
    const int64_t m = ids.numel();
    const int64_t n_bins = offsets.numel() - 1;
    HP_CHECK(load_count(offsets, 0) == 0 && load_count(offsets, n_bins) == m, op, ": offsets ",
             offsets.desc(), " must run from 0 to the id count ", m);
    check_ids(op, "ids", ids, n_bins);
    std::vector<int64_t> cursor(static_cast<size_t>(n_bins)), limit(static_cast<size_t>(n_bins));
    for (int64_t b = 0; b < n_bins; ++b) {
      cursor[b] = load_count(offsets, b);
      limit[b] = load_count(offsets, b + 1);
    }
    const int32_t* ip = ids.data<int32_t>();
    int32_t* s2a = sorted_to_assign.data<int32_t>();
    int32_t* a2s = assign_to_sorted.data<int32_t>();
    for (int64_t a = 0; a < m; ++a) {
      const int64_t j = cursor[ip[a]]++;
      HP_CHECK(j < limit[ip[a]], op, ": more ids equal to ", ip[a],
               " than offsets allow; offsets do not match the ids");
      s2a[j] = static_cast<int32_t>(a);
      a2s[a] = static_cast<int32_t>(j);
    }
  }

  void do_permute_rows(const Tensor& x, const Tensor& sorted_to_assign, int k,
                       Tensor& out) override {
    const char* op = "permute_rows";
    check_dtype(op, "x", x, kDType);
    check_dtype(op, "sorted_to_assign", sorted_to_assign, DType::kI32);
    check_dtype(op, "out", out, kDType);
    const int64_t n = x.dim(0), d = x.dim(1), m = sorted_to_assign.numel();
    check_ids(op, "sorted_to_assign", sorted_to_assign, n * k);
    const T* xp = x.data<T>();
    const int32_t* s2a = sorted_to_assign.data<int32_t>();
    T* out_p = out.data<T>();
#pragma omp parallel for schedule(static) if (m * d > kParallelMin)
    for (int64_t j = 0; j < m; ++j) {
      std::memcpy(out_p + j * d, xp + (s2a[j] / k) * d, static_cast<size_t>(d) * sizeof(T));
    }
  }

  // Inverts the permutation so each token sums its k rows in assignment order.
  void do_permute_rows_bwd(const Tensor& dout, const Tensor& sorted_to_assign, int k,
                           Tensor& dx) override {
    const char* op = "permute_rows_bwd";
    check_dtype(op, "dx", dx, kDType);
    check_dtype(op, "sorted_to_assign", sorted_to_assign, DType::kI32);
    check_dtype(op, "dout", dout, kDType);
    const int64_t n = dx.dim(0), d = dx.dim(1);
    check_ids(op, "sorted_to_assign", sorted_to_assign, n * k);
    const std::vector<int64_t> inv = invert(op, sorted_to_assign, n * k);
    const T* dp = dout.data<T>();
    T* dxp = dx.data<T>();
#pragma omp parallel for schedule(static) if (n * d > kParallelMin)
    for (int64_t t = 0; t < n; ++t) {
      std::fill(dxp + t * d, dxp + (t + 1) * d, T(0));
      for (int64_t s = 0; s < k; ++s) {
        const int64_t j = inv[t * k + s];
        if (j >= 0) cpu::axpy(T(1), dp + j * d, dxp + t * d, d);
      }
    }
  }

  void do_unpermute_combine(const Tensor& y, const Tensor& assign_to_sorted, const Tensor& w,
                            Tensor& out) override {
    const char* op = "unpermute_combine";
    check_dtype(op, "y", y, kDType);
    check_dtype(op, "w", w, kDType);
    check_dtype(op, "assign_to_sorted", assign_to_sorted, DType::kI32);
    check_dtype(op, "out", out, kDType);
    const int64_t m = y.dim(0), d = y.dim(1), n = w.dim(0), k = w.dim(1);
    check_ids(op, "assign_to_sorted", assign_to_sorted, m);
    const T* yp = y.data<T>();
    const int32_t* a2s = assign_to_sorted.data<int32_t>();
    const T* wp = w.data<T>();
    T* out_p = out.data<T>();
#pragma omp parallel for schedule(static) if (n * d > kParallelMin)
    for (int64_t t = 0; t < n; ++t) {
      T* o = out_p + t * d;
      std::fill(o, o + d, T(0));
      for (int64_t s = 0; s < k; ++s) cpu::axpy(wp[t * k + s], yp + a2s[t * k + s] * d, o, d);
    }
  }

  void do_unpermute_combine_bwd(const Tensor& dout, const Tensor& y, const Tensor& assign_to_sorted,
                                const Tensor& w, Tensor& dy, Tensor& dw) override {
    const char* op = "unpermute_combine_bwd";
    check_dtypes(op, kDType, {{"y", &y}, {"w", &w}, {"dout", &dout}, {"dy", &dy}, {"dw", &dw}});
    check_dtype(op, "assign_to_sorted", assign_to_sorted, DType::kI32);
    const int64_t m = y.dim(0), d = y.dim(1), n = w.dim(0), k = w.dim(1);
    check_ids(op, "assign_to_sorted", assign_to_sorted, m);
    invert(op, assign_to_sorted, m);  // each row of y feeds one assignment at most
    const T* dop = dout.data<T>();
    const T* yp = y.data<T>();
    const int32_t* a2s = assign_to_sorted.data<int32_t>();
    const T* wp = w.data<T>();
    T* dyp = dy.data<T>();
    T* dwp = dw.data<T>();
    std::fill(dyp, dyp + m * d, T(0));
#pragma omp parallel for schedule(static) if (n * d > kParallelMin)
    for (int64_t t = 0; t < n; ++t) {
      const T* g = dop + t * d;
      for (int64_t s = 0; s < k; ++s) {
        const int64_t j = a2s[t * k + s];
        T* dyr = dyp + j * d;
        for (int64_t c = 0; c < d; ++c) dyr[c] = wp[t * k + s] * g[c];
        dwp[t * k + s] = cpu::dot(g, yp + j * d, d);
      }
    }
  }

  // ---- embedding and loss ---------------------------------------------------------------------

  void do_embedding_fwd(const Tensor& table, const Tensor& ids, Tensor& out) override {
    const char* op = "embedding_fwd";
    check_dtype(op, "table", table, kDType);
    check_dtype(op, "ids", ids, DType::kI32);
    check_dtype(op, "out", out, kDType);
    const int64_t v = table.dim(0), d = table.dim(1), n = ids.numel();
    check_ids(op, "ids", ids, v);
    const T* tp = table.data<T>();
    const int32_t* ip = ids.data<int32_t>();
    T* out_p = out.data<T>();
#pragma omp parallel for schedule(static) if (n * d > kParallelMin)
    for (int64_t t = 0; t < n; ++t) {
      std::memcpy(out_p + t * d, tp + ip[t] * d, static_cast<size_t>(d) * sizeof(T));
    }
  }

  // Tokens are grouped by id with a stable counting sort, so each table row adds its tokens'
  // rows in token order and rows are independent of each other.
  void do_embedding_bwd(const Tensor& dout, const Tensor& ids, Tensor& dtable) override {
    const char* op = "embedding_bwd";
    check_dtype(op, "dtable", dtable, kDType);
    check_dtype(op, "ids", ids, DType::kI32);
    check_dtype(op, "dout", dout, kDType);
    const int64_t v = dtable.dim(0), d = dtable.dim(1), n = ids.numel();
    check_ids(op, "ids", ids, v);
    const int32_t* ip = ids.data<int32_t>();
    std::vector<int64_t> start(static_cast<size_t>(v + 1), 0);
    for (int64_t t = 0; t < n; ++t) ++start[ip[t] + 1];
    for (int64_t i = 0; i < v; ++i) start[i + 1] += start[i];
    std::vector<int64_t> order(static_cast<size_t>(n));
    {
      std::vector<int64_t> cursor(start.begin(), start.end() - 1);
      for (int64_t t = 0; t < n; ++t) order[cursor[ip[t]]++] = t;
    }
    const T* dp = dout.data<T>();
    T* tp = dtable.data<T>();
#pragma omp parallel for schedule(dynamic, 64) if (n * d > kParallelMin)
    for (int64_t row = 0; row < v; ++row) {
      for (int64_t r = start[row]; r < start[row + 1]; ++r) {
        cpu::axpy(T(1), dp + order[r] * d, tp + row * d, d);
      }
    }
  }

  void do_cross_entropy(Tensor& logits, const Tensor& targets, double grad_scale,
                        Tensor& loss) override {
    const char* op = "cross_entropy";
    check_dtype(op, "logits", logits, kDType);
    check_dtype(op, "targets", targets, DType::kI32);
    check_dtype(op, "loss", loss, kDType);
    const int64_t n = logits.dim(0), v = logits.dim(1);
    const int32_t* tg = targets.data<int32_t>();
    for (int64_t r = 0; r < n; ++r) {
      HP_CHECK(tg[r] == -1 || (tg[r] >= 0 && tg[r] < v), op, ": targets[", r, "] = ", tg[r],
               " is neither -1 nor in [0, ", v, ") (logits ", logits.desc(), ")");
    }
    T* lp = logits.data<T>();
    const double total = sum_rows(n, v, [&](int64_t r) -> double {
      T* l = lp + r * v;
      if (tg[r] < 0) {
        std::fill(l, l + v, T(0));
        return 0.0;
      }
      T mx = l[0];
      for (int64_t j = 1; j < v; ++j) mx = std::max(mx, l[j]);
      double denom = 0;
      for (int64_t j = 0; j < v; ++j) denom += std::exp(static_cast<double>(l[j] - mx));
      const double lse = static_cast<double>(mx) + std::log(denom);
      const double row_loss = lse - static_cast<double>(l[tg[r]]);
      for (int64_t j = 0; j < v; ++j) {
        l[j] = static_cast<T>(grad_scale * std::exp(static_cast<double>(l[j]) - lse));
      }
      l[tg[r]] -= static_cast<T>(grad_scale);
      return row_loss;
    });
    loss.data<T>()[0] += static_cast<T>(total);
  }

  // ---- optimizer ------------------------------------------------------------------------------

  void do_sum_squares(const Tensor& x, Tensor& acc) override {
    const char* op = "sum_squares";
    check_cpu(op, "x", x);
    check_dtype(op, "acc", acc, kDType);
    const int64_t n = x.numel();
    const int64_t chunks = (n + kFlatChunk - 1) / kFlatChunk;
    std::vector<double> part(static_cast<size_t>(chunks), 0.0);
    dispatch_float(op, x, [&](auto tag) {
      using S = decltype(tag);
      const S* xp = x.data<S>();
#pragma omp parallel for schedule(static) if (chunks > 1)
      for (int64_t c = 0; c < chunks; ++c) {
        double s = 0;
        const int64_t end = std::min(n, (c + 1) * kFlatChunk);
        for (int64_t i = c * kFlatChunk; i < end; ++i) {
          const double v = to_f64(xp[i]);
          s += v * v;
        }
        part[c] = s;
      }
    });
    double total = 0;
    for (double s : part) total += s;
    acc.data<T>()[0] += static_cast<T>(total);
  }

  void do_update_gate(const Tensor& checked, const Tensor& sumsq, double max_norm,
                      Tensor& gate) override {
    const char* op = "update_gate";
    check_dtype(op, "checked", checked, kDType);
    check_dtype(op, "sumsq", sumsq, kDType);
    check_cpu(op, "gate", gate);
    bool ok = true;
    for (int64_t i = 0; i < checked.numel(); ++i)
      ok = ok && std::isfinite(static_cast<double>(checked.data<T>()[i]));
    double ss = 0;
    for (int64_t i = 0; i < sumsq.numel(); ++i) ss += static_cast<double>(sumsq.data<T>()[i]);
    double* g = gate.data<double>();
    g[0] = clip_coefficient(std::sqrt(ss), max_norm);
    g[1] = ok ? 1.0 : 0.0;
  }

  void do_adamw(Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& gated,
                Tensor& working) override {
    const char* op = "adamw";
    check_dtype(op, "master", master, kDType);
    check_dtype(op, "grad", grad, kDType);
    check_dtype(op, "m", m, kDType);
    check_dtype(op, "v", v, kDType);
    // A gated update reads its scale and its go-ahead from the gate (host memory here).
    AdamWParams p = gated;
    if (gated.gate != nullptr) {
      check_cpu(op, "gate", *gated.gate);
      const double* g = gated.gate->data<double>();
      if (g[1] == 0.0) return;
      p.grad_scale = g[0];
      p.gate = nullptr;
    }
    const double b1 = p.beta1, b2 = p.beta2;
    const double bc1 = 1.0 - std::pow(b1, static_cast<double>(p.step));
    const double bc2 = 1.0 - std::pow(b2, static_cast<double>(p.step));
    const int64_t n = master.numel();
    T* wp = master.data<T>();
    const T* gp = grad.data<T>();
    T* mp = m.data<T>();
    T* vp = v.data<T>();
    // One element of the update, in double, rounded to T: the same arithmetic in both modes.
    const auto element = [&](int64_t i, T& m_new, T& v_new, T& w_new) {
      const double g = static_cast<double>(gp[i]) * p.grad_scale;
      const double mi = b1 * mp[i] + (1.0 - b1) * g;
      const double vi = b2 * vp[i] + (1.0 - b2) * g * g;
      m_new = static_cast<T>(mi);
      v_new = static_cast<T>(vi);
      const double w = wp[i];
      const double update = (mi / bc1) / (std::sqrt(vi / bc2) + p.eps) + p.weight_decay * w;
      w_new = static_cast<T>(w - p.lr * update);
    };
    if (p.check_flag != nullptr) {
      // Check only: nothing but the flag is written.
      Tensor& flag = *p.check_flag;
      check_dtype(op, "check_flag", flag, kDType);
      // A working copy of another dtype must hold the new master too (bf16 rounds up to inf
      // just below the float range).
      const DType wt = working.defined() ? working.dtype() : kDType;
      HP_CHECK(wt == DType::kF32 || wt == DType::kF64 || wt == DType::kBF16, op, ": working ",
               working.desc(), " is not of a float dtype");
      const auto in_working = [wt](double x) {
        if (wt == DType::kBF16) return to_f64(from_f64<bf16>(x));
        if (wt == DType::kF32) return static_cast<double>(static_cast<float>(x));
        return x;
      };
      int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (n > kParallelMin)
      for (int64_t i = 0; i < n; ++i) {
        T mi, vi, wi;
        element(i, mi, vi, wi);
        const bool ok = std::isfinite(static_cast<double>(mi)) &&
                        std::isfinite(static_cast<double>(vi)) &&
                        std::isfinite(in_working(static_cast<double>(wi)));
        bad |= ok ? 0 : 1;
      }
      if (bad) flag.data<T>()[0] = T(1);
      return;
    }
#pragma omp parallel for schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) {
      T mi, vi, wi;
      element(i, mi, vi, wi);
      mp[i] = mi;
      vp[i] = vi;
      wp[i] = wi;
    }
    if (working.defined() &&
        !(working.raw() == master.raw() && working.dtype() == master.dtype())) {
      convert(master, working);
    }
  }

 private:
  template <typename S>
  static void fill_typed(S* p, int64_t n, S value) {
#pragma omp parallel for schedule(static) if (n > kParallelMin)
    for (int64_t i = 0; i < n; ++i) p[i] = value;
  }

  // inv[a] = j where perm[j] = a, -1 where no j; throws if perm hits a value twice.
  static std::vector<int64_t> invert(const char* op, const Tensor& perm, int64_t size) {
    std::vector<int64_t> inv(static_cast<size_t>(size), -1);
    const int32_t* pp = perm.data<int32_t>();
    for (int64_t j = 0; j < perm.numel(); ++j) {
      HP_CHECK(inv[pp[j]] < 0, op, ": index ", pp[j], " appears twice in ", perm.desc());
      inv[pp[j]] = j;
    }
    return inv;
  }

  // The packed attention arguments' dtypes and cu_seqlens values (shapes: the interface); returns
  // the kernel geometry.
  cpu::AttnLayout attention_layout(const char* op, const Tensor& qkv, const Tensor& sinks,
                                   const BatchMeta& meta, const AttentionShape& shape) const {
    check_dtype(op, "qkv", qkv, kDType);
    if (sinks.defined()) check_dtype(op, "sinks", sinks, kDType);
    check_dtype(op, "meta.cu_seqlens", meta.cu_seqlens, DType::kI32);
    const int64_t n = qkv.dim(0), n_seqs = meta.n_seqs;
    const int32_t* cu = meta.cu_seqlens.data<int32_t>();
    HP_CHECK(cu[0] == 0 && cu[n_seqs] == n, op, ": meta.cu_seqlens runs from ", cu[0], " to ",
             cu[n_seqs], ", expected 0 to the token count of qkv ", qkv.desc());
    for (int64_t s = 0; s < n_seqs; ++s) {
      HP_CHECK(cu[s] <= cu[s + 1], op, ": meta.cu_seqlens decreases at ", s);
    }
    cpu::AttnLayout layout;
    layout.n_tokens = n;
    layout.n_seqs = n_seqs;
    layout.cu_seqlens = cu;
    layout.hq = shape.n_heads;
    layout.hkv = shape.n_kv_heads;
    layout.d = shape.head_dim;
    layout.window = shape.window;
    layout.scale = shape.scale;
    return layout;
  }

 private:
  struct CpuEvent final : Event {
    uint64_t ticket = 0;  // 0: complete
  };
  static const CpuEvent& as_cpu_event(const Event& e) {
    const auto* c = dynamic_cast<const CpuEvent*>(&e);
    HP_CHECK(c != nullptr, "event was not recorded by a CPU backend");
    return *c;
  }

  CpuCopyQueue copy_queue_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return std::make_unique<CpuBackend<float>>();
    case DType::kF64:
      return std::make_unique<CpuBackend<double>>();
    default:
      break;
  }
  HP_FAIL(ErrorKind::kUser, "make_cpu_backend: dtype must be f32 or f64, got ", dtype_name(dtype));
}

}  // namespace hp
