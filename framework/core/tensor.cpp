#include "framework/core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

namespace hp {

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

namespace {
class HostAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    size_t rounded = ((bytes + 63) / 64) * 64;
    if (rounded == 0) rounded = 64;
    void* p = std::aligned_alloc(64, rounded);
    if (!p) HP_FAIL(ErrorKind::kInternal, "host allocation of ", bytes, " bytes failed");
    std::memset(p, 0, rounded);
    return p;
  }
  void deallocate(void* p, size_t) override { std::free(p); }
  Device device() const override { return Device::kCPU; }
};
}  // namespace

Allocator& host_allocator() {
  static HostAllocator a;
  return a;
}

Storage::Storage(Allocator* alloc, size_t bytes)
    : alloc_(alloc), ptr_(alloc->allocate(bytes)), bytes_(bytes), device_(alloc->device()) {}

Storage::Storage(void* ptr, size_t bytes, Device device, std::function<void()> release)
    : ptr_(ptr), bytes_(bytes), device_(device), release_(std::move(release)) {}

Storage::~Storage() {
  if (alloc_) alloc_->deallocate(ptr_, bytes_);
  if (release_) release_();
}

Tensor::Tensor(std::shared_ptr<Storage> storage, int64_t offset_elems, Shape shape, DType dtype)
    : storage_(std::move(storage)), offset_(offset_elems), shape_(std::move(shape)), dtype_(dtype) {
  numel_ = shape_numel(shape_);
  HP_CHECK(numel_ >= 0, "negative shape ", shape_str(shape_));
  if (storage_) {
    HP_CHECK((offset_ + numel_) * static_cast<int64_t>(dtype_size(dtype_)) <=
                 static_cast<int64_t>(storage_->bytes()),
             "view ", shape_str(shape_), " at offset ", offset_, " exceeds storage of ",
             storage_->bytes(), " bytes");
  }
}

Tensor Tensor::empty(Allocator& alloc, Shape shape, DType dtype) {
  int64_t n = shape_numel(shape);
  HP_CHECK(n >= 0, "negative shape ", shape_str(shape));
  auto st = std::make_shared<Storage>(&alloc, static_cast<size_t>(n) * dtype_size(dtype));
  return Tensor(std::move(st), 0, std::move(shape), dtype);
}

Tensor Tensor::host(Shape shape, DType dtype) {
  return empty(host_allocator(), std::move(shape), dtype);
}

int64_t Tensor::dim(int i) const {
  if (i < 0) i += ndim();
  HP_CHECK(i >= 0 && i < ndim(), "dim ", i, " of tensor ", desc());
  return shape_[static_cast<size_t>(i)];
}

void* Tensor::raw() const {
  HP_CHECK(storage_ != nullptr, "data of an undefined tensor");
  return static_cast<char*>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::reshape(Shape shape) const {
  int64_t known = 1;
  int neg = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      HP_CHECK(neg < 0, "reshape with two -1 dims");
      neg = static_cast<int>(i);
    } else {
      known *= shape[i];
    }
  }
  if (neg >= 0) {
    HP_CHECK(known > 0 && numel_ % known == 0, "cannot reshape ", desc(), " to ", shape_str(shape));
    shape[static_cast<size_t>(neg)] = numel_ / known;
  }
  HP_CHECK(shape_numel(shape) == numel_, "cannot reshape ", desc(), " to ", shape_str(shape));
  return Tensor(storage_, offset_, std::move(shape), dtype_);
}

Tensor Tensor::slice(int64_t begin, int64_t end) const {
  HP_CHECK(ndim() >= 1 && begin >= 0 && begin <= end && end <= shape_[0], "slice [", begin, ", ",
           end, ") of ", desc());
  int64_t row = numel_ / (shape_[0] == 0 ? 1 : shape_[0]);
  if (shape_[0] == 0) row = shape_numel(Shape(shape_.begin() + 1, shape_.end()));
  Shape s = shape_;
  s[0] = end - begin;
  return Tensor(storage_, offset_ + begin * row, std::move(s), dtype_);
}

Tensor Tensor::operator[](int64_t i) const {
  Tensor t = slice(i, i + 1);
  Shape s(shape_.begin() + 1, shape_.end());
  return Tensor(t.storage_, t.offset_, std::move(s), dtype_);
}

Tensor Tensor::flat_view(int64_t start, int64_t count) const {
  HP_CHECK(start >= 0 && count >= 0 && start + count <= numel_, "flat_view out of range of ",
           desc());
  return Tensor(storage_, offset_ + start, {count}, dtype_);
}

std::string Tensor::desc() const {
  return str_cat(dtype_name(dtype_), shape_str(shape_), "@", device_name(device()));
}

std::vector<double> to_double_vector(const Tensor& t) {
  HP_CHECK(t.device() == Device::kCPU, "to_double_vector needs a host tensor, got ", t.desc());
  std::vector<double> out(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case DType::kF32:
        out[i] = t.data<float>()[i];
        break;
      case DType::kF64:
        out[i] = t.data<double>()[i];
        break;
      case DType::kBF16:
        out[i] = static_cast<float>(t.data<bf16>()[i]);
        break;
      case DType::kI32:
        out[i] = t.data<int32_t>()[i];
        break;
      case DType::kI64:
        out[i] = static_cast<double>(t.data<int64_t>()[i]);
        break;
    }
  }
  return out;
}

}  // namespace hp
