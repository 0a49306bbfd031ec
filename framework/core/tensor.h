// Tensor: a typed, contiguous, row-major view into reference-counted storage on one device.
//
// Views share storage: slicing along the leading dimension and reshaping never copy. Memory
// comes from an Allocator (the backend's caching allocator on the GPU, aligned host memory on the
// CPU); the storage returns it to that allocator when the last view goes away. Tensors carry no
// stream: the backend op that writes or reads one is ordered by the stream it runs on.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "framework/core/dtype.h"
#include "framework/core/error.h"

namespace hp {

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

// Hands out raw memory of one device. Thread safety: implementations say.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  virtual Device device() const = 0;
};

// Aligned host memory (64 bytes), zero-initialised; used by the CPU backend and host tensors.
Allocator& host_allocator();

class Storage {
 public:
  Storage(Allocator* alloc, size_t bytes);
  // Wraps memory owned elsewhere; `release` runs when the storage dies (may be empty).
  Storage(void* ptr, size_t bytes, Device device, std::function<void()> release);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return device_; }

 private:
  Allocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  Device device_ = Device::kCPU;
  std::function<void()> release_;
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<Storage> storage, int64_t offset_elems, Shape shape, DType dtype);

  // New tensor from an allocator (contents: whatever the allocator gives; host: zeros).
  static Tensor empty(Allocator& alloc, Shape shape, DType dtype);
  // New zeroed host tensor.
  static Tensor host(Shape shape, DType dtype);
  template <typename T>
  static Tensor host_from(const std::vector<T>& v, DType dtype, Shape shape = {});

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device() : Device::kCPU; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  int64_t offset() const { return offset_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }

  void* raw() const;
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw());
  }

  // Same elements, new shape (numel must match; one dimension may be -1).
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) of the leading dimension.
  Tensor slice(int64_t begin, int64_t end) const;
  // Row i of the leading dimension, with that dimension dropped.
  Tensor operator[](int64_t i) const;
  // A flat view of numel elements starting at element `start`.
  Tensor flat_view(int64_t start, int64_t count) const;

  std::string desc() const;

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::kF32;
};

template <typename T>
Tensor Tensor::host_from(const std::vector<T>& v, DType dtype, Shape shape) {
  if (shape.empty()) shape = {static_cast<int64_t>(v.size())};
  Tensor t = host(shape, dtype);
  HP_CHECK(static_cast<size_t>(t.numel()) == v.size(), "host_from size mismatch");
  HP_CHECK(dtype_size(dtype) == sizeof(T), "host_from dtype size mismatch");
  std::memcpy(t.raw(), v.data(), v.size() * sizeof(T));
  return t;
}

// Reads a host tensor of a floating type as doubles (for tests and logs).
std::vector<double> to_double_vector(const Tensor& host_tensor);

}  // namespace hp
