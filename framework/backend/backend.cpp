#include "framework/backend/backend.h"

namespace hp {

Tensor Backend::zeros(Shape shape, DType dtype) {
  Tensor t = empty(std::move(shape), dtype);
  fill(t, 0.0);
  return t;
}

Tensor Backend::upload(const Tensor& host) {
  Tensor t = empty(host.shape(), host.dtype());
  copy(host, t);
  return t;
}

}  // namespace hp
