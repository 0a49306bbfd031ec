#include "framework/backend/cuda/cuda_allocator.h"

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
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

std::mutex& registry_mutex() {
  static std::mutex mu;
  return mu;
}
// Never destroyed (see the header): the exit handler shuts each down instead.
std::map<int, CudaCachingAllocator*>& registry() {
  static auto* m = new std::map<int, CudaCachingAllocator*>();
  return *m;
}

void shut_down_device_allocators() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (auto& [device, a] : registry()) {
    const CudaAllocatorStats before = a->stats();
    const int64_t live = a->shut_down();
    if (live > 0)
      std::fprintf(stderr,
                   "[hotpath] cuda allocator: %lld blocks (%zu bytes) of device %d still in use at "
                   "exit; returned to the driver\n",
                   static_cast<long long>(live), before.bytes_in_use, device);
    const CudaAllocatorStats after = a->stats();
    if (after.failed_frees > 0)
      std::fprintf(stderr, "[hotpath] cuda allocator: %lld cudaFree calls failed at exit: %s\n",
                   static_cast<long long>(after.failed_frees),
                   cudaGetErrorString(a->last_free_error()));
  }
}

// Registers the exit handler once, after the first CUDA call of the process: handlers run in
// reverse order of registration, so this one runs before the CUDA runtime's own teardown.
void register_exit_handler() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(shut_down_device_allocators); });
}

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
  // The driver may already be shutting down, so errors are ignored here.
  shut_down();
}

int64_t CudaCachingAllocator::shut_down() {
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) return 0;
  shut_down_ = true;
  const int64_t live = static_cast<int64_t>(live_.size());
  if (free_.empty() && live_.empty()) return 0;
  // Not DeviceGuard: at exit a failure is counted, never thrown.
  int prev = -1;
  const bool switched = cudaGetDevice(&prev) == cudaSuccess && prev != device_ &&
                        cudaSetDevice(device_) == cudaSuccess;
  for (auto& kv : free_)
    for (void* p : kv.second) free_block(p, false);
  for (auto& kv : live_) free_block(kv.first, false);
  free_.clear();
  live_.clear();
  stats_.bytes_cached = 0;
  stats_.bytes_in_use = 0;
  if (switched && cudaSetDevice(prev) != cudaSuccess) cudaGetLastError();
  return live;
}

void CudaCachingAllocator::free_block(void* p, bool check) {
  ++stats_.device_frees;
  if (check) {
    CUDA_CHECK(cudaFree(p));
    return;
  }
  const cudaError_t err = cudaFree(p);
  // A runtime already unloading has released the context, and the block with it.
  if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
    ++stats_.failed_frees;
    last_free_error_ = static_cast<int>(err);
  }
  if (err != cudaSuccess) cudaGetLastError();
}

void* CudaCachingAllocator::allocate(size_t bytes) {
  const size_t size = bucket_size(bytes);
  std::lock_guard<std::mutex> lock(mu_);
  HP_CHECK(!shut_down_, "cuda allocator of device ", device_, ": allocate after shutdown");
  void* p = nullptr;
  // The smallest cached block of the request's bucket up to twice its size: sizes that follow
  // the data (expert rows, FP8 operands) then reuse what an earlier step freed instead of
  // calling cudaMalloc, which stalls the device.
  size_t block = size;
  auto it = free_.lower_bound(size);
  while (it != free_.end() && it->first <= 2 * size && it->second.empty()) ++it;
  if (it != free_.end() && it->first <= 2 * size) {
    block = it->first;
    p = it->second.back();
    it->second.pop_back();
    stats_.bytes_cached -= block;
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
    register_exit_handler();
  }
  live_[p] = block;
  stats_.bytes_in_use += block;
  if (stats_.bytes_in_use > stats_.peak_in_use) stats_.peak_in_use = stats_.bytes_in_use;
  return p;
}

void CudaCachingAllocator::deallocate(void* p, size_t) {
  if (!p) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (shut_down_) return;  // a tensor that outlived the shutdown: its block is already freed
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
    for (void* p : kv.second) free_block(p, true);
  free_.clear();
  stats_.bytes_cached = 0;
}

cudaError_t CudaCachingAllocator::last_free_error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<cudaError_t>(last_free_error_);
}

CudaAllocatorStats CudaCachingAllocator::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

CudaCachingAllocator& cuda_device_allocator(int device_ordinal) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto& a = registry()[device_ordinal];
  if (!a) a = new CudaCachingAllocator(device_ordinal);
  return *a;
}

}  // namespace hp
