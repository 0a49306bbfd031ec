#include "framework/backend/cuda/cuda_allocator.h"

#include <cuda_runtime.h>

#include <memory>

#include "framework/backend/cuda/cuda_check.h"

namespace hp {

namespace {

// Restores the calling thread's current device on scope exit.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) CUDA_CHECK(cudaSetDevice(device));
    changed_ = prev_ != device;
  }
  ~DeviceGuard() {
    if (changed_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0;
  bool changed_ = false;
};

}  // namespace

size_t CudaCachingAllocator::bucket_size(size_t bytes) {
  if (bytes == 0) bytes = 1;
  constexpr size_t kSmall = 1 << 20;
  if (bytes <= kSmall) return (bytes + 511) / 512 * 512;
  size_t p = 1;
  while (p * 2 <= bytes) p *= 2;  // largest power of two <= bytes
  size_t step = p / 4;
  return (bytes + step - 1) / step * step;
}

CudaCachingAllocator::~CudaCachingAllocator() {
  // Process exit: the driver may already be shutting down, so errors are ignored here.
  for (auto& kv : free_)
    for (void* p : kv.second) cudaFree(p);
}

void* CudaCachingAllocator::allocate(size_t bytes) {
  const size_t size = bucket_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  void* p = nullptr;
  auto it = free_.find(size);
  if (it != free_.end() && !it->second.empty()) {
    p = it->second.back();
    it->second.pop_back();
    stats_.bytes_cached -= size;
    ++stats_.cache_hits;
  } else {
    DeviceGuard guard(device_);
    cudaError_t err = cudaMalloc(&p, size);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the sticky-free error state of the runtime
      release_cached_locked();
      err = cudaMalloc(&p, size);
    }
    if (err != cudaSuccess) {
      cudaGetLastError();
      HP_FAIL(ErrorKind::kCuda, "cudaMalloc(", size, " bytes) on device ", device_,
              " failed: ", cudaGetErrorString(err), " (in use ", stats_.bytes_in_use,
              " bytes, peak ", stats_.peak_in_use, ")");
    }
    ++stats_.device_mallocs;
  }
  live_[p] = size;
  stats_.bytes_in_use += size;
  if (stats_.bytes_in_use > stats_.peak_in_use) stats_.peak_in_use = stats_.bytes_in_use;
  return p;
}

void CudaCachingAllocator::deallocate(void* p, size_t) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = live_.find(p);
  HP_CHECK(it != live_.end(), "deallocate of a pointer this allocator did not hand out");
  const size_t size = it->second;
  live_.erase(it);
  free_[size].push_back(p);
  stats_.bytes_in_use -= size;
  stats_.bytes_cached += size;
}

void CudaCachingAllocator::release_cached() {
  std::lock_guard<std::mutex> lock(mu_);
  release_cached_locked();
}

void CudaCachingAllocator::release_cached_locked() {
  DeviceGuard guard(device_);
  for (auto& kv : free_)
    for (void* p : kv.second) CUDA_CHECK(cudaFree(p));
  free_.clear();
  stats_.bytes_cached = 0;
}

CudaAllocatorStats CudaCachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

CudaCachingAllocator& cuda_device_allocator(int device_ordinal) {
  static std::mutex mu;
  static std::map<int, CudaCachingAllocator*> allocators;  // never destroyed: see header
  std::lock_guard<std::mutex> lock(mu);
  auto& a = allocators[device_ordinal];
  if (!a) a = new CudaCachingAllocator(device_ordinal);
  return *a;
}

}  // namespace hp
