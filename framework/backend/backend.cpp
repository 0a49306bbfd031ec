#include "framework/backend/backend.h"

#include "framework/core/error.h"

namespace hp {

Tensor Backend::zeros(Shape shape, DType dtype) {
  Tensor t = empty(std::move(shape), dtype);
  fill(t, 0.0);
  return t;
}

std::shared_ptr<Storage> Backend::pinned_host_storage(size_t bytes) {
  return std::make_shared<Storage>(&host_allocator(), bytes);
}

void Backend::gemm_bias(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                        const Tensor& bias) {
  gemm(a, trans_a, b, trans_b, c, 1.0, 0.0);
  add_bias(c, bias);
}

void Backend::gemm_add(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                       const Tensor& r, Tensor& c, const Tensor& bias) {
  HP_CHECK(r.shape() == c.shape() && r.dtype() == c.dtype(), "gemm_add: r ", r.desc(),
           " must match c ", c.desc());
  HP_CHECK(r.raw() != c.raw(), "gemm_add: r must not alias c");
  if (bias.defined())
    gemm_bias(a, trans_a, b, trans_b, c, bias);
  else
    gemm(a, trans_a, b, trans_b, c, 1.0, 0.0);
  add(c, r, c);
}

void Backend::bias_grad_segments(const Tensor& dy, const std::vector<RowSegment>& segments) {
  for (const RowSegment& g : segments) {
    if (g.rows == 0) continue;
    Tensor db = g.db;
    bias_grad(dy.slice(g.begin, g.begin + g.rows), db);
  }
}

void Backend::gemm_group(const std::vector<GemmProblem>& problems, bool trans_a, bool trans_b,
                         double beta) {
  for (const GemmProblem& p : problems) {
    Tensor c = p.c;
    if (p.bias.defined()) {
      HP_CHECK(beta == 0, "gemm_group: a bias needs beta == 0, got ", beta);
      gemm_bias(p.a, trans_a, p.b, trans_b, c, p.bias);
    } else {
      gemm(p.a, trans_a, p.b, trans_b, c, 1.0, beta);
    }
  }
}

Tensor Backend::upload(const Tensor& host) {
  Tensor t = empty(host.shape(), host.dtype());
  copy(host, t);
  return t;
}

}  // namespace hp

namespace hp {

void Backend::qk_norm_fwd(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, double,
                          Tensor&, Tensor&) {
  HP_FAIL(ErrorKind::kInternal, "backend ", name(), " has no qk_norm_fwd (config key qk_norm)");
}

void Backend::qk_norm_bwd(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t,
                          const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor&) {
  HP_FAIL(ErrorKind::kInternal, "backend ", name(), " has no qk_norm_bwd (config key qk_norm)");
}

}  // namespace hp
