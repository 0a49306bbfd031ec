#include "framework/backend/backend.h"

namespace hp {

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
