// The op interface's contract checks (backend.h, "Argument contracts") and the default
// implementations that compose other ops.
#include "framework/backend/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>

#include "framework/core/error.h"

namespace hp {
namespace {

void need_defined(const char* op, const char* name, const Tensor& t) {
  HP_CHECK(t.defined(), op, ": tensor '", name, "' is undefined");
}

void need_shape(const char* op, const char* name, const Tensor& t, const Shape& shape) {
  need_defined(op, name, t);
  HP_CHECK(t.shape() == shape, op, ": tensor '", name, "' is ", t.desc(), ", expected shape ",
           shape_str(shape));
}

// A gated update's gate (AdamWParams::gate): f64 [2].
void need_gate(const char* op, const Tensor& gate) {
  need_shape(op, "gate", gate, {2});
  HP_CHECK(gate.dtype() == DType::kF64, op, ": gate ", gate.desc(), " must be f64");
}

void need_ndim(const char* op, const char* name, const Tensor& t, int ndim) {
  need_defined(op, name, t);
  HP_CHECK(t.ndim() == ndim, op, ": tensor '", name, "' is ", t.desc(), ", expected a ", ndim,
           "-d tensor");
}

void need_same_numel(const char* op, const char* na, const Tensor& a, const char* nb,
                     const Tensor& b) {
  need_defined(op, na, a);
  need_defined(op, nb, b);
  HP_CHECK(a.numel() == b.numel(), op, ": tensors '", na, "' ", a.desc(), " and '", nb, "' ",
           b.desc(), " differ in numel");
}

void need_copyable(const char* op, const Tensor& src, const Tensor& dst) {
  need_defined(op, "src", src);
  need_defined(op, "dst", dst);
  HP_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(), op, ": src ", src.desc(),
           " and dst ", dst.desc(), " must have the same dtype and numel");
}

// c = op(a) op(b), all 2-d: returns {M, N}.
std::pair<int64_t, int64_t> need_gemm(const char* op, const Tensor& a, bool trans_a,
                                      const Tensor& b, bool trans_b, const Tensor& c) {
  need_ndim(op, "a", a, 2);
  need_ndim(op, "b", b, 2);
  need_ndim(op, "c", c, 2);
  const int64_t m = trans_a ? a.dim(1) : a.dim(0);
  const int64_t k = trans_a ? a.dim(0) : a.dim(1);
  const int64_t kb = trans_b ? b.dim(1) : b.dim(0);
  const int64_t n = trans_b ? b.dim(0) : b.dim(1);
  HP_CHECK(k == kb && c.dim(0) == m && c.dim(1) == n, op, ": op(a) of ", a.desc(),
           (trans_a ? " (transposed)" : ""), " times op(b) of ", b.desc(),
           (trans_b ? " (transposed)" : ""), " does not fit c ", c.desc(), ", expected shape ",
           shape_str({m, n}));
  return {m, n};
}

// Every problem of a group as need_gemm checks one, a bias only with beta == 0, and no two c's
// overlapping.
void need_gemm_group(const char* op, const std::vector<Backend::GemmProblem>& problems,
                     bool trans_a, bool trans_b, double beta) {
  std::vector<std::pair<uintptr_t, uintptr_t>> spans;  // [begin, end) bytes of each c
  spans.reserve(problems.size());
  for (const Backend::GemmProblem& p : problems) {
    const int64_t n = need_gemm(op, p.a, trans_a, p.b, trans_b, p.c).second;
    if (p.bias.defined()) {
      need_shape(op, "bias", p.bias, {n});
      HP_CHECK(beta == 0, op, ": a bias needs beta == 0, got ", beta);
    }
    if (p.c.nbytes() > 0) {
      const auto begin = reinterpret_cast<uintptr_t>(p.c.raw());
      spans.emplace_back(begin, begin + p.c.nbytes());
    }
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    HP_CHECK(spans[i - 1].second <= spans[i].first, op, ": the c's of two problems overlap");
  }
}

void need_attention_shape(const char* op, const AttentionShape& s) {
  HP_CHECK(s.n_heads > 0 && s.n_kv_heads > 0 && s.n_heads % s.n_kv_heads == 0 && s.head_dim > 0 &&
               s.window >= 0 && std::isfinite(s.scale),
           op, ": bad shape n_heads=", s.n_heads, " n_kv_heads=", s.n_kv_heads,
           " head_dim=", s.head_dim, " window=", s.window, " scale=", s.scale,
           " (needs heads > 0, n_heads a multiple of n_kv_heads, window >= 0, a finite scale)");
}

// The arguments forward and backward share; returns the token count N.
int64_t need_attention(const char* op, const Tensor& qkv, const Tensor& sinks,
                       const BatchMeta& meta, const AttentionShape& s) {
  need_attention_shape(op, s);
  need_ndim(op, "qkv", qkv, 3);
  const int64_t n = qkv.dim(0);
  need_shape(op, "qkv", qkv, {n, s.n_heads + 2 * s.n_kv_heads, s.head_dim});
  if (sinks.defined()) need_shape(op, "sinks", sinks, {s.n_heads});
  need_shape(op, "meta.positions", meta.positions, {n});
  HP_CHECK(meta.n_seqs >= 0, op, ": meta.n_seqs = ", meta.n_seqs, " is negative");
  need_shape(op, "meta.cu_seqlens", meta.cu_seqlens, {meta.n_seqs + 1});
  return n;
}

// qk_norm's common arguments; returns the token count N.
int64_t need_qk_norm(const char* op, const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                     int64_t n_heads, int64_t n_kv_heads) {
  need_ndim(op, "qkv", qkv, 3);
  HP_CHECK(n_heads > 0 && n_kv_heads > 0 && qkv.dim(1) == n_heads + 2 * n_kv_heads, op, ": qkv ",
           qkv.desc(), " does not hold n_heads + 2 n_kv_heads = ", n_heads, " + 2*", n_kv_heads,
           " heads");
  need_shape(op, "qw", qw, {qkv.dim(2)});
  need_shape(op, "kw", kw, {qkv.dim(2)});
  return qkv.dim(0);
}

// rope's positions[n] and tables [P, d/2] for heads of d (even).
void need_rope_table(const char* op, int64_t n, int64_t d, const Tensor& positions,
                     const RopeTable& table) {
  need_shape(op, "positions", positions, {n});
  need_ndim(op, "table.cos", table.cos, 2);
  need_shape(op, "table.cos", table.cos, {table.cos.dim(0), d / 2});
  need_shape(op, "table.sin", table.sin, table.cos.shape());
}

// Whether the bytes of two defined tensors overlap.
bool overlaps(const Tensor& a, const Tensor& b) {
  if (a.nbytes() == 0 || b.nbytes() == 0) return false;
  const auto a0 = reinterpret_cast<uintptr_t>(a.raw()), b0 = reinterpret_cast<uintptr_t>(b.raw());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// The arguments qk_norm_rope_fwd and _bwd share with qk_norm and rope; returns N.
int64_t need_qk_norm_rope(const char* op, const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                          int64_t n_heads, int64_t n_kv_heads, const Tensor& positions,
                          const RopeTable& table) {
  const int64_t n = need_qk_norm(op, qkv, qw, kw, n_heads, n_kv_heads);
  HP_CHECK(qkv.dim(2) % 2 == 0, op, ": qkv ", qkv.desc(), " needs an even head_dim for rope");
  need_rope_table(op, n, qkv.dim(2), positions, table);
  return n;
}

// adamw_many's entries: no tensor one entry writes (master, m, v, working) overlaps a tensor of
// another entry, so that updating them at once gives the bits of updating them in turn. A sweep
// over the byte spans in address order; for the spans begun so far it keeps, among all spans and
// among written ones, the two that reach furthest of two different entries.
void need_entries_apart(const std::vector<Backend::AdamWEntry>& entries) {
  struct Span {
    uintptr_t begin, end;
    size_t entry;
    bool written;
    const char* name;
  };
  std::vector<Span> spans;
  spans.reserve(entries.size() * 5);
  for (size_t i = 0; i < entries.size(); ++i) {
    const Backend::AdamWEntry& e = entries[i];
    const std::pair<const Tensor*, const char*> tensors[] = {{&e.master, "master"},
                                                             {&e.m, "m"},
                                                             {&e.v, "v"},
                                                             {&e.working, "working"},
                                                             {&e.grad, "grad"}};
    for (const auto& [t, name] : tensors) {
      if (!t->defined() || t->nbytes() == 0) continue;
      const auto begin = reinterpret_cast<uintptr_t>(t->raw());
      spans.push_back({begin, begin + t->nbytes(), i, t != &e.grad, name});
    }
  }
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.entry < b.entry;
  });
  // Reach: the span of furthest end so far, and the furthest of an entry other than its own.
  struct Reach {
    const Span* first = nullptr;
    const Span* second = nullptr;
    void add(const Span& s) {
      if (!first || s.end > first->end) {
        // The old first is the furthest of an entry other than s's, if it is of one; else the
        // second stays (its entry differs from the old first's, which is s's).
        if (first && first->entry != s.entry) second = first;
        first = &s;
      } else if (s.entry != first->entry && (!second || s.end > second->end)) {
        second = &s;
      }
    }
    // A span begun so far that reaches past `at`, of an entry other than `entry`, or null.
    const Span* other(size_t entry, uintptr_t at) const {
      if (first && first->entry != entry && first->end > at) return first;
      if (second && second->entry != entry && second->end > at) return second;
      return nullptr;
    }
  };
  Reach all, written;
  for (const Span& s : spans) {
    const Span* hit = s.written ? all.other(s.entry, s.begin) : written.other(s.entry, s.begin);
    HP_CHECK(hit == nullptr, "adamw_many: entry ", s.entry, "'s '", s.name, "' overlaps entry ",
             hit->entry, "'s '", hit->name, "' (entries must not share memory that either writes)");
    all.add(s);
    if (s.written) written.add(s);
  }
}

}  // namespace

Tensor Backend::zeros(Shape shape, DType dtype) {
  Tensor t = empty(std::move(shape), dtype);
  fill(t, 0.0);
  return t;
}

std::shared_ptr<Storage> Backend::pinned_host_storage(size_t bytes) {
  return std::make_shared<Storage>(&host_allocator(), bytes);
}

Tensor Backend::upload(const Tensor& host) {
  Tensor t = empty(host.shape(), host.dtype());
  copy(host, t);
  return t;
}

// ---- memory ---------------------------------------------------------------------------------

void Backend::fill(Tensor& t, double value) {
  need_defined("fill", "t", t);
  do_fill(t, value);
}

void Backend::fill_normal(Tensor& t, uint64_t key, int64_t offset, double std) {
  need_defined("fill_normal", "t", t);
  do_fill_normal(t, key, offset, std);
}

void Backend::copy(const Tensor& src, Tensor& dst) {
  need_copyable("copy", src, dst);
  do_copy(src, dst);
}

void Backend::convert(const Tensor& src, Tensor& dst) {
  need_same_numel("convert", "src", src, "dst", dst);
  do_convert(src, dst);
}

void Backend::read_to_host(const Tensor& src, Tensor& host_dst, SyncCause cause) {
  need_copyable("read_to_host", src, host_dst);
  HP_CHECK(host_dst.device() == Device::kCPU, "read_to_host: destination ", host_dst.desc(),
           " must be a host tensor");
  do_read_to_host(src, host_dst, cause);
}

void Backend::copy_over_link(const Tensor& src, Tensor& dst, CopyDirection dir) {
  need_copyable("copy_over_link", src, dst);
  do_copy_over_link(src, dst, dir);
}

void Backend::do_copy_over_link(const Tensor& src, Tensor& dst, CopyDirection) {
  do_copy(src, dst);
}

// ---- packed batch metadata ------------------------------------------------------------------

BatchMeta Backend::upload_batch(const PackedBatch& batch) {
  const size_t n = batch.inputs.size();
  HP_CHECK(batch.targets.size() == n && batch.positions.size() == n,
           "upload_batch: inputs, targets and positions have ", n, ", ", batch.targets.size(),
           " and ", batch.positions.size(), " entries; they must match");
  HP_CHECK(!batch.cu_seqlens.empty() && batch.cu_seqlens.front() == 0 &&
               static_cast<size_t>(batch.cu_seqlens.back()) == n,
           "upload_batch: cu_seqlens must run from 0 to the token count ", n);
  for (size_t s = 0; s + 1 < batch.cu_seqlens.size(); ++s) {
    HP_CHECK(batch.cu_seqlens[s] <= batch.cu_seqlens[s + 1],
             "upload_batch: cu_seqlens decreases at sequence ", s);
  }
  return do_upload_batch(batch);
}

void Backend::rebuild_metadata(BatchMeta& meta) {
  need_ndim("rebuild_metadata", "positions", meta.positions, 1);
  do_rebuild_metadata(meta);
}

// ---- dense math -----------------------------------------------------------------------------

void Backend::gemm(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                   double alpha, double beta) {
  need_gemm("gemm", a, trans_a, b, trans_b, c);
  do_gemm(a, trans_a, b, trans_b, c, alpha, beta);
}

void Backend::gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                        const Tensor& bias) {
  const int64_t n = need_gemm("gemm_bias", a, trans_a, b, trans_b, c).second;
  need_shape("gemm_bias", "bias", bias, {n});
  do_gemm_bias(a, trans_a, b, trans_b, c, bias);
}

void Backend::gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                       const Tensor& r, Tensor& c, const Tensor& bias) {
  const char* op = "gemm_add";
  const int64_t n = need_gemm(op, a, trans_a, b, trans_b, c).second;
  need_defined(op, "r", r);
  HP_CHECK(r.shape() == c.shape() && r.dtype() == c.dtype(), op, ": r ", r.desc(), " must match c ",
           c.desc());
  HP_CHECK(r.raw() != c.raw(), op, ": r must not alias c");
  if (bias.defined()) need_shape(op, "bias", bias, {n});
  do_gemm_add(a, trans_a, b, trans_b, r, c, bias);
}

void Backend::gemm_group(const std::vector<GemmProblem>& problems, bool trans_a, bool trans_b,
                         double beta) {
  need_gemm_group("gemm_group", problems, trans_a, trans_b, beta);
  do_gemm_group(problems, trans_a, trans_b, beta);
}

void Backend::gemm_fp8(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                       double beta, const Tensor& bias, const Tensor& r, const Fp8Gemm& spec) {
  const char* op = "gemm_fp8";
  const int64_t n = need_gemm(op, a, trans_a, b, trans_b, c).second;
  if (bias.defined()) need_shape(op, "bias", bias, {n});
  if (r.defined()) {
    HP_CHECK(r.shape() == c.shape() && r.dtype() == c.dtype(), op, ": r ", r.desc(),
             " must match c ", c.desc());
    HP_CHECK(r.raw() != c.raw(), op, ": r must not alias c");
  }
  HP_CHECK(beta == 0 || (!bias.defined() && !r.defined()), op,
           ": a bias or r needs beta == 0, got ", beta);
  do_gemm_fp8(a, trans_a, b, trans_b, c, beta, bias, r, spec);
}

void Backend::gemm_fp8_group(const std::vector<GemmProblem>& problems, bool trans_a, bool trans_b,
                             double beta, const Fp8Gemm& spec) {
  need_gemm_group("gemm_fp8_group", problems, trans_a, trans_b, beta);
  do_gemm_fp8_group(problems, trans_a, trans_b, beta, spec);
}

void Backend::hold_fp8_weights(const std::vector<Tensor>& weights, const Fp8Gemm& spec) {
  for (size_t i = 0; i < weights.size(); ++i) {
    const Tensor& w = weights[i];
    HP_CHECK(w.defined() && w.ndim() == 2, "hold_fp8_weights: weight ", i,
             " must be a 2-D tensor, got ", w.defined() ? w.desc() : std::string("none"));
    HP_CHECK(w.dtype() == DType::kF32 || w.dtype() == DType::kBF16, "hold_fp8_weights: weight ", i,
             " must be f32 or bf16, got ", w.desc());
  }
  do_hold_fp8_weights(weights, spec);
}

void Backend::do_gemm_fp8(const Tensor&, bool, const Tensor&, bool, Tensor&, double, const Tensor&,
                          const Tensor&, const Fp8Gemm&) {
  HP_FAIL(ErrorKind::kInternal, "backend ", name(),
          " has no FP8 GEMMs (config key precision=fp8 needs the CPU backend's emulation or a "
          "CUDA device of compute capability 9.x or 10.x)");
}

void Backend::do_gemm_fp8_group(const std::vector<GemmProblem>& problems, bool trans_a,
                                bool trans_b, double beta, const Fp8Gemm& spec) {
  for (const GemmProblem& p : problems) {
    Tensor c = p.c;
    do_gemm_fp8(p.a, trans_a, p.b, trans_b, c, beta, p.bias, Tensor(), spec);
  }
}

void Backend::add_bias(Tensor& y, const Tensor& bias) {
  need_ndim("add_bias", "y", y, 2);
  need_shape("add_bias", "bias", bias, {y.dim(1)});
  do_add_bias(y, bias);
}

void Backend::bias_grad(const Tensor& dy, Tensor& db) {
  need_ndim("bias_grad", "dy", dy, 2);
  need_shape("bias_grad", "db", db, {dy.dim(1)});
  do_bias_grad(dy, db);
}

void Backend::bias_grad_segments(const Tensor& dy, const std::vector<RowSegment>& segments) {
  const char* op = "bias_grad_segments";
  need_ndim(op, "dy", dy, 2);
  for (const RowSegment& g : segments) {
    HP_CHECK(g.begin >= 0 && g.rows >= 0 && g.begin + g.rows <= dy.dim(0), op, ": rows [", g.begin,
             ", ", g.begin + g.rows, ") outside dy ", dy.desc());
    need_shape(op, "db", g.db, {dy.dim(1)});
  }
  do_bias_grad_segments(dy, segments);
}

void Backend::add(const Tensor& a, const Tensor& b, Tensor& out) {
  need_same_numel("add", "a", a, "b", b);
  need_same_numel("add", "a", a, "out", out);
  do_add(a, b, out);
}

void Backend::axpy(double alpha, const Tensor& x, Tensor& y) {
  need_same_numel("axpy", "x", x, "y", y);
  do_axpy(alpha, x, y);
}

// ---- normalization and position -------------------------------------------------------------

void Backend::rmsnorm_fwd(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const char* op = "rmsnorm_fwd";
  need_ndim(op, "x", x, 2);
  const int64_t m = x.dim(0), d = x.dim(1);
  HP_CHECK(d > 0 && eps >= 0, op, ": needs a positive width and eps >= 0, got x ", x.desc(),
           ", eps ", eps);
  need_shape(op, "w", w, {d});
  need_shape(op, "y", y, {m, d});
  need_shape(op, "rstd", rstd, {m});
  do_rmsnorm_fwd(x, w, eps, y, rstd);
}

void Backend::rmsnorm_bwd(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                          Tensor& dx, Tensor& dw, bool accumulate_dx) {
  const char* op = "rmsnorm_bwd";
  need_ndim(op, "x", x, 2);
  const int64_t m = x.dim(0), d = x.dim(1);
  need_shape(op, "w", w, {d});
  need_shape(op, "rstd", rstd, {m});
  need_shape(op, "dy", dy, {m, d});
  need_shape(op, "dx", dx, {m, d});
  need_shape(op, "dw", dw, {d});
  do_rmsnorm_bwd(x, w, rstd, dy, dx, dw, accumulate_dx);
}

void Backend::rope(Tensor& x, int n_rot_heads, const Tensor& positions, const RopeTable& table,
                   bool inverse) {
  const char* op = "rope";
  need_ndim(op, "x", x, 3);
  const int64_t n = x.dim(0), h = x.dim(1), d = x.dim(2);
  HP_CHECK(d % 2 == 0 && n_rot_heads >= 0 && n_rot_heads <= h, op,
           ": needs an even head_dim and 0 <= n_rot_heads <= heads, got x ", x.desc(),
           ", n_rot_heads ", n_rot_heads);
  need_rope_table(op, n, d, positions, table);
  do_rope(x, n_rot_heads, positions, table, inverse);
}

void Backend::qk_norm_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                          int64_t n_kv_heads, double eps, Tensor& out, Tensor& rstd) {
  const char* op = "qk_norm_fwd";
  const int64_t n = need_qk_norm(op, qkv, qw, kw, n_heads, n_kv_heads);
  need_shape(op, "out", out, qkv.shape());
  need_shape(op, "rstd", rstd, {n, n_heads + n_kv_heads});
  do_qk_norm_fwd(qkv, qw, kw, n_heads, n_kv_heads, eps, out, rstd);
}

void Backend::qk_norm_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw, int64_t n_heads,
                          int64_t n_kv_heads, const Tensor& rstd, const Tensor& dout, Tensor& din,
                          Tensor& dqw, Tensor& dkw) {
  const char* op = "qk_norm_bwd";
  const int64_t n = need_qk_norm(op, qkv, qw, kw, n_heads, n_kv_heads);
  need_shape(op, "rstd", rstd, {n, n_heads + n_kv_heads});
  need_shape(op, "dout", dout, qkv.shape());
  need_shape(op, "din", din, qkv.shape());
  need_shape(op, "dqw", dqw, {qkv.dim(2)});
  need_shape(op, "dkw", dkw, {qkv.dim(2)});
  HP_CHECK(!overlaps(dqw, dkw), op, ": dqw and dkw must not overlap (each adds its own sums)");
  do_qk_norm_bwd(qkv, qw, kw, n_heads, n_kv_heads, rstd, dout, din, dqw, dkw);
}

void Backend::qk_norm_rope_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                               int64_t n_heads, int64_t n_kv_heads, double eps,
                               const Tensor& positions, const RopeTable& table, Tensor& out,
                               Tensor& rstd) {
  const char* op = "qk_norm_rope_fwd";
  const int64_t n = need_qk_norm_rope(op, qkv, qw, kw, n_heads, n_kv_heads, positions, table);
  need_shape(op, "out", out, qkv.shape());
  need_shape(op, "rstd", rstd, {n, n_heads + n_kv_heads});
  HP_CHECK(!overlaps(out, qkv), op, ": out must not overlap qkv");
  do_qk_norm_rope_fwd(qkv, qw, kw, n_heads, n_kv_heads, eps, positions, table, out, rstd);
}

void Backend::qk_norm_rope_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                               int64_t n_heads, int64_t n_kv_heads, const Tensor& rstd,
                               const Tensor& positions, const RopeTable& table, const Tensor& dout,
                               Tensor& din, Tensor& dqw, Tensor& dkw) {
  const char* op = "qk_norm_rope_bwd";
  const int64_t n = need_qk_norm_rope(op, qkv, qw, kw, n_heads, n_kv_heads, positions, table);
  need_shape(op, "rstd", rstd, {n, n_heads + n_kv_heads});
  need_shape(op, "dout", dout, qkv.shape());
  need_shape(op, "din", din, qkv.shape());
  need_shape(op, "dqw", dqw, {qkv.dim(2)});
  need_shape(op, "dkw", dkw, {qkv.dim(2)});
  HP_CHECK(!overlaps(dqw, dkw), op, ": dqw and dkw must not overlap (each adds its own sums)");
  HP_CHECK(din.raw() == dout.raw() || !overlaps(din, dout), op,
           ": din must be dout itself or not overlap it");
  HP_CHECK(!overlaps(din, qkv), op, ": din must not overlap qkv");
  do_qk_norm_rope_bwd(qkv, qw, kw, n_heads, n_kv_heads, rstd, positions, table, dout, din, dqw,
                      dkw);
}

void Backend::do_qk_norm_rope_fwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                                  int64_t n_heads, int64_t n_kv_heads, double eps,
                                  const Tensor& positions, const RopeTable& table, Tensor& out,
                                  Tensor& rstd) {
  qk_norm_fwd(qkv, qw, kw, n_heads, n_kv_heads, eps, out, rstd);
  rope(out, static_cast<int>(n_heads + n_kv_heads), positions, table, false);
}

void Backend::do_qk_norm_rope_bwd(const Tensor& qkv, const Tensor& qw, const Tensor& kw,
                                  int64_t n_heads, int64_t n_kv_heads, const Tensor& rstd,
                                  const Tensor& positions, const RopeTable& table,
                                  const Tensor& dout, Tensor& din, Tensor& dqw, Tensor& dkw) {
  if (din.raw() != dout.raw()) copy(dout, din);
  rope(din, static_cast<int>(n_heads + n_kv_heads), positions, table, true);
  qk_norm_bwd(qkv, qw, kw, n_heads, n_kv_heads, rstd, din, din, dqw, dkw);
}

void Backend::do_qk_norm_fwd(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, double,
                             Tensor&, Tensor&) {
  HP_FAIL(ErrorKind::kInternal, "backend ", name(), " has no qk_norm_fwd (config key qk_norm)");
}

void Backend::do_qk_norm_bwd(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                             const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&) {
  HP_FAIL(ErrorKind::kInternal, "backend ", name(), " has no qk_norm_bwd (config key qk_norm)");
}

// ---- attention ------------------------------------------------------------------------------

void Backend::attention_fwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                            const AttentionShape& shape, Tensor& out, Tensor& lse) {
  const char* op = "attention_fwd";
  const int64_t n = need_attention(op, qkv, sinks, meta, shape);
  need_shape(op, "out", out, {n, shape.n_heads, shape.head_dim});
  need_shape(op, "lse", lse, {n, shape.n_heads});
  do_attention_fwd(qkv, sinks, meta, shape, out, lse);
}

void Backend::attention_bwd(const Tensor& qkv, const Tensor& sinks, const BatchMeta& meta,
                            const AttentionShape& shape, const Tensor& out, const Tensor& lse,
                            const Tensor& dout, Tensor& dqkv, Tensor& dsinks) {
  const char* op = "attention_bwd";
  const int64_t n = need_attention(op, qkv, sinks, meta, shape);
  need_shape(op, "out", out, {n, shape.n_heads, shape.head_dim});
  need_shape(op, "lse", lse, {n, shape.n_heads});
  need_shape(op, "dout", dout, {n, shape.n_heads, shape.head_dim});
  need_shape(op, "dqkv", dqkv, qkv.shape());
  HP_CHECK(dqkv.raw() != qkv.raw(), op, ": dqkv must not alias qkv");
  if (sinks.defined()) need_shape(op, "dsinks", dsinks, {shape.n_heads});
  do_attention_bwd(qkv, sinks, meta, shape, out, lse, dout, dqkv, dsinks);
}

// ---- feed-forward activations ---------------------------------------------------------------

void Backend::glu_fwd(const Tensor& h, const GluParams& p, Tensor& a) {
  const char* op = "glu_fwd";
  need_ndim(op, "h", h, 2);
  HP_CHECK(h.dim(1) % 2 == 0, op, ": h ", h.desc(), " needs an even width [g | u]");
  need_shape(op, "a", a, {h.dim(0), h.dim(1) / 2});
  do_glu_fwd(h, p, a);
}

void Backend::glu_bwd(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh) {
  const char* op = "glu_bwd";
  need_ndim(op, "h", h, 2);
  HP_CHECK(h.dim(1) % 2 == 0, op, ": h ", h.desc(), " needs an even width [g | u]");
  need_shape(op, "da", da, {h.dim(0), h.dim(1) / 2});
  need_shape(op, "dh", dh, h.shape());
  do_glu_bwd(h, da, p, dh);
}

void Backend::glu_fwd_fp8(const Tensor& h, const GluParams& p, Tensor& a, const Fp8Gemm& spec) {
  const char* op = "glu_fwd_fp8";
  need_ndim(op, "h", h, 2);
  HP_CHECK(h.dim(1) % 2 == 0, op, ": h ", h.desc(), " needs an even width [g | u]");
  need_shape(op, "a", a, {h.dim(0), h.dim(1) / 2});
  do_glu_fwd_fp8(h, p, a, spec);
}

void Backend::glu_bwd_fp8(const Tensor& h, const Tensor& da, const GluParams& p, Tensor& dh,
                          const Fp8Gemm& spec) {
  const char* op = "glu_bwd_fp8";
  need_ndim(op, "h", h, 2);
  HP_CHECK(h.dim(1) % 2 == 0, op, ": h ", h.desc(), " needs an even width [g | u]");
  need_shape(op, "da", da, {h.dim(0), h.dim(1) / 2});
  need_shape(op, "dh", dh, h.shape());
  do_glu_bwd_fp8(h, da, p, dh, spec);
}

// ---- mixture-of-experts routing -------------------------------------------------------------

void Backend::router_topk(const Tensor& logits, int k, Tensor& idx, Tensor& w) {
  const char* op = "router_topk";
  need_ndim(op, "logits", logits, 2);
  const int64_t n = logits.dim(0), e = logits.dim(1);
  HP_CHECK(k >= 1 && k <= e, op, ": k = ", k, " must lie in [1, ", e, "] for logits ",
           logits.desc());
  need_shape(op, "idx", idx, {n, k});
  need_shape(op, "w", w, {n, k});
  do_router_topk(logits, k, idx, w);
}

void Backend::router_topk_bwd(const Tensor& idx, const Tensor& w, const Tensor& dw,
                              Tensor& dlogits) {
  const char* op = "router_topk_bwd";
  need_ndim(op, "idx", idx, 2);
  const int64_t n = idx.dim(0), k = idx.dim(1);
  need_shape(op, "w", w, {n, k});
  need_shape(op, "dw", dw, {n, k});
  need_ndim(op, "dlogits", dlogits, 2);
  need_shape(op, "dlogits", dlogits, {n, dlogits.dim(1)});
  do_router_topk_bwd(idx, w, dw, dlogits);
}

void Backend::router_aux_loss(const Tensor& logits, const Tensor& counts, int k, double coef,
                              Tensor& loss, Tensor& dlogits) {
  const char* op = "router_aux_loss";
  need_ndim(op, "logits", logits, 2);
  const int64_t n = logits.dim(0), e = logits.dim(1);
  HP_CHECK(k >= 1, op, ": k = ", k, " must be positive");
  need_shape(op, "counts", counts, {e});
  need_shape(op, "loss", loss, {1});
  need_shape(op, "dlogits", dlogits, {n, e});
  do_router_aux_loss(logits, counts, k, coef, loss, dlogits);
}

void Backend::histogram(const Tensor& ids, int n_bins, Tensor& counts) {
  const char* op = "histogram";
  need_ndim(op, "ids", ids, 1);
  HP_CHECK(n_bins >= 0, op, ": n_bins = ", n_bins, " is negative");
  need_shape(op, "counts", counts, {n_bins});
  do_histogram(ids, n_bins, counts);
}

void Backend::exclusive_scan(const Tensor& counts, Tensor& offsets) {
  const char* op = "exclusive_scan";
  need_ndim(op, "counts", counts, 1);
  need_shape(op, "offsets", offsets, {counts.numel() + 1});
  do_exclusive_scan(counts, offsets);
}

void Backend::sort_by_id(const Tensor& ids, const Tensor& offsets, Tensor& sorted_to_assign,
                         Tensor& assign_to_sorted) {
  const char* op = "sort_by_id";
  need_ndim(op, "ids", ids, 1);
  const int64_t m = ids.numel();
  need_ndim(op, "offsets", offsets, 1);
  HP_CHECK(offsets.numel() >= 1, op, ": offsets ", offsets.desc(), " needs n_bins + 1 entries");
  need_shape(op, "sorted_to_assign", sorted_to_assign, {m});
  need_shape(op, "assign_to_sorted", assign_to_sorted, {m});
  do_sort_by_id(ids, offsets, sorted_to_assign, assign_to_sorted);
}

void Backend::permute_rows(const Tensor& x, const Tensor& sorted_to_assign, int k, Tensor& out) {
  const char* op = "permute_rows";
  need_ndim(op, "x", x, 2);
  HP_CHECK(k >= 1, op, ": k = ", k, " must be positive");
  need_ndim(op, "sorted_to_assign", sorted_to_assign, 1);
  need_shape(op, "out", out, {sorted_to_assign.numel(), x.dim(1)});
  do_permute_rows(x, sorted_to_assign, k, out);
}

void Backend::permute_rows_bwd(const Tensor& dout, const Tensor& sorted_to_assign, int k,
                               Tensor& dx) {
  const char* op = "permute_rows_bwd";
  need_ndim(op, "dx", dx, 2);
  HP_CHECK(k >= 1, op, ": k = ", k, " must be positive");
  need_ndim(op, "sorted_to_assign", sorted_to_assign, 1);
  need_shape(op, "dout", dout, {sorted_to_assign.numel(), dx.dim(1)});
  do_permute_rows_bwd(dout, sorted_to_assign, k, dx);
}

void Backend::unpermute_combine(const Tensor& y, const Tensor& assign_to_sorted, const Tensor& w,
                                Tensor& out) {
  const char* op = "unpermute_combine";
  need_ndim(op, "y", y, 2);
  need_ndim(op, "w", w, 2);
  const int64_t d = y.dim(1), n = w.dim(0), k = w.dim(1);
  need_shape(op, "assign_to_sorted", assign_to_sorted, {n * k});
  need_shape(op, "out", out, {n, d});
  do_unpermute_combine(y, assign_to_sorted, w, out);
}

void Backend::unpermute_combine_bwd(const Tensor& dout, const Tensor& y,
                                    const Tensor& assign_to_sorted, const Tensor& w, Tensor& dy,
                                    Tensor& dw) {
  const char* op = "unpermute_combine_bwd";
  need_ndim(op, "y", y, 2);
  need_ndim(op, "w", w, 2);
  const int64_t m = y.dim(0), d = y.dim(1), n = w.dim(0), k = w.dim(1);
  need_shape(op, "dout", dout, {n, d});
  need_shape(op, "assign_to_sorted", assign_to_sorted, {n * k});
  need_shape(op, "dy", dy, {m, d});
  need_shape(op, "dw", dw, {n, k});
  do_unpermute_combine_bwd(dout, y, assign_to_sorted, w, dy, dw);
}

// ---- embedding and loss ---------------------------------------------------------------------

void Backend::embedding_fwd(const Tensor& table, const Tensor& ids, Tensor& out) {
  const char* op = "embedding_fwd";
  need_ndim(op, "table", table, 2);
  need_ndim(op, "ids", ids, 1);
  need_shape(op, "out", out, {ids.numel(), table.dim(1)});
  do_embedding_fwd(table, ids, out);
}

void Backend::embedding_bwd(const Tensor& dout, const Tensor& ids, Tensor& dtable) {
  const char* op = "embedding_bwd";
  need_ndim(op, "dtable", dtable, 2);
  need_ndim(op, "ids", ids, 1);
  need_shape(op, "dout", dout, {ids.numel(), dtable.dim(1)});
  do_embedding_bwd(dout, ids, dtable);
}

void Backend::cross_entropy(Tensor& logits, const Tensor& targets, double grad_scale,
                            Tensor& loss) {
  const char* op = "cross_entropy";
  need_ndim(op, "logits", logits, 2);
  need_shape(op, "targets", targets, {logits.dim(0)});
  need_shape(op, "loss", loss, {1});
  do_cross_entropy(logits, targets, grad_scale, loss);
}

void Backend::cross_entropy_fp8(Tensor& logits, const Tensor& targets, double grad_scale,
                                Tensor& loss, const Fp8Gemm& spec) {
  const char* op = "cross_entropy_fp8";
  need_ndim(op, "logits", logits, 2);
  need_shape(op, "targets", targets, {logits.dim(0)});
  need_shape(op, "loss", loss, {1});
  do_cross_entropy_fp8(logits, targets, grad_scale, loss, spec);
}

// ---- optimizer ------------------------------------------------------------------------------

void Backend::sum_squares(const Tensor& x, Tensor& acc) {
  need_defined("sum_squares", "x", x);
  need_shape("sum_squares", "acc", acc, {1});
  do_sum_squares(x, acc);
}

void Backend::adamw(Tensor& master, const Tensor& grad, Tensor& m, Tensor& v, const AdamWParams& p,
                    Tensor& working) {
  const char* op = "adamw";
  need_defined(op, "master", master);
  need_shape(op, "grad", grad, master.shape());
  need_shape(op, "m", m, master.shape());
  need_shape(op, "v", v, master.shape());
  HP_CHECK(p.step >= 1, op, ": step ", p.step, " must be >= 1 (it is 1-based)");
  if (working.defined()) need_same_numel(op, "working", working, "master", master);
  if (p.check_flag != nullptr) {
    need_defined(op, "check_flag", *p.check_flag);
    HP_CHECK(p.check_flag->numel() >= 1, op, ": check_flag ", p.check_flag->desc(),
             " needs at least one element");
    HP_CHECK(p.gate == nullptr, op, ": check_flag and gate are both set; a check is not gated");
  }
  if (p.gate != nullptr) need_gate(op, *p.gate);
  do_adamw(master, grad, m, v, p, working);
}

void Backend::update_gate(const Tensor& checked, const Tensor& sumsq, double max_norm,
                          Tensor& gate) {
  const char* op = "update_gate";
  need_defined(op, "checked", checked);
  need_defined(op, "sumsq", sumsq);
  HP_CHECK(checked.numel() >= 1 && sumsq.numel() >= 1, op, ": checked ", checked.desc(),
           " and sumsq ", sumsq.desc(), " need at least one element each");
  need_gate(op, gate);
  do_update_gate(checked, sumsq, max_norm, gate);
}

void Backend::sum_squares_many(const std::vector<Tensor>& xs, Tensor& acc,
                               const std::vector<char>& unwritten) {
  const char* op = "sum_squares_many";
  for (size_t i = 0; i < xs.size(); ++i) {
    HP_CHECK(xs[i].defined(), op, ": tensor 'xs[", i, "]' is undefined");
  }
  HP_CHECK(unwritten.empty() || unwritten.size() == xs.size(), op, ": 'unwritten' has ",
           unwritten.size(), " flags for ", xs.size(), " tensors (give one per tensor, or none)");
  need_shape(op, "acc", acc, {1});
  do_sum_squares_many(xs, acc, unwritten);
}

void Backend::adamw_many(const std::vector<AdamWEntry>& entries, const AdamWParams& p) {
  HP_CHECK(p.step >= 1, "adamw_many: step ", p.step, " must be >= 1 (it is 1-based)");
  HP_CHECK(p.check_flag == nullptr,
           "adamw_many: has no check-only mode (check_flag is set); use adamw per tensor");
  if (p.gate != nullptr) need_gate("adamw_many", *p.gate);
  // What the checks below depend on, entry by entry: a list equal to the last checked one holds
  // the contract as that one did.
  std::vector<int64_t> key;
  key.reserve(entries.size() * 16);
  for (const AdamWEntry& e : entries)
    for (const Tensor* t : {&e.master, &e.grad, &e.m, &e.v, &e.working}) {
      key.push_back(t->defined() ? static_cast<int64_t>(reinterpret_cast<uintptr_t>(t->raw())) : -1);
      if (!t->defined()) continue;
      key.push_back(static_cast<int64_t>(t->dtype()));
      key.push_back(t->ndim());
      for (int64_t d : t->shape()) key.push_back(d);
    }
  if (key == adamw_many_checked_) {
    do_adamw_many(entries, p);
    return;
  }
  adamw_many_checked_.clear();
  for (size_t i = 0; i < entries.size(); ++i) {
    const std::string where = "adamw_many: entry " + std::to_string(i);
    const char* op = where.c_str();
    const AdamWEntry& e = entries[i];
    need_defined(op, "master", e.master);
    need_shape(op, "grad", e.grad, e.master.shape());
    need_shape(op, "m", e.m, e.master.shape());
    need_shape(op, "v", e.v, e.master.shape());
    if (e.working.defined()) need_same_numel(op, "working", e.working, "master", e.master);
  }
  need_entries_apart(entries);
  adamw_many_checked_ = std::move(key);
  do_adamw_many(entries, p);
}

// ---- default implementations ----------------------------------------------------------------

void Backend::do_gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                           const Tensor& bias) {
  gemm(a, trans_a, b, trans_b, c, 1.0, 0.0);
  add_bias(c, bias);
}

void Backend::do_gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                          const Tensor& r, Tensor& c, const Tensor& bias) {
  if (bias.defined())
    gemm_bias(a, trans_a, b, trans_b, c, bias);
  else
    gemm(a, trans_a, b, trans_b, c, 1.0, 0.0);
  add(c, r, c);
}

void Backend::do_bias_grad_segments(const Tensor& dy, const std::vector<RowSegment>& segments) {
  for (const RowSegment& g : segments) {
    if (g.rows == 0) continue;
    Tensor db = g.db;
    bias_grad(dy.slice(g.begin, g.begin + g.rows), db);
  }
}

void Backend::do_sum_squares_many(const std::vector<Tensor>& xs, Tensor& acc,
                                  const std::vector<char>& unwritten) {
  // A flagged x's sum would be +0, and s + (+0) is s for every s but -0 (which a sum of squares
  // never is).
  for (size_t i = 0; i < xs.size(); ++i)
    if (unwritten.empty() || !unwritten[i]) sum_squares(xs[i], acc);
}

void Backend::do_adamw_many(const std::vector<AdamWEntry>& entries, const AdamWParams& p) {
  AdamWParams q = p;
  for (const AdamWEntry& e : entries) {
    Tensor master = e.master, m = e.m, v = e.v, working = e.working;
    q.weight_decay = e.weight_decay ? p.weight_decay : 0.0;
    adamw(master, e.grad_zero ? zeros(e.grad.shape(), e.grad.dtype()) : e.grad, m, v, q, working);
  }
}

void Backend::do_gemm_group(const std::vector<GemmProblem>& problems, bool trans_a, bool trans_b,
                            double beta) {
  for (const GemmProblem& p : problems) {
    Tensor c = p.c;
    if (p.bias.defined()) {
      gemm_bias(p.a, trans_a, p.b, trans_b, c, p.bias);
    } else {
      gemm(p.a, trans_a, p.b, trans_b, c, 1.0, beta);
    }
  }
}

}  // namespace hp
