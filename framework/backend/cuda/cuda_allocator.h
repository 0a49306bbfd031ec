// Caching device allocator: size-bucketed free lists over cudaMalloc.
//
// A freed block goes back to its bucket and is handed out again without cudaMalloc/cudaFree
// (both of which synchronize the device): to a request of its bucket, or of a bucket down to half
// its size when that bucket has no free block (the smallest such block is taken, and returns to
// its own bucket when freed). Reuse is safe for work on one compute stream: stream
// order puts every use of the old tensor before every use of the new one. A tensor used on
// another stream must keep its storage alive (or be ordered by an event) until that use is done.
// On a cudaMalloc failure the cache is emptied (cudaFree) and the allocation retried once.
//
// Shutdown: at process exit (an atexit handler registered once the CUDA runtime is up, so it
// runs before the runtime's own teardown) every device allocator returns every block to the
// driver, cached and still handed out alike, and frees any block given back after that at once.
// So nothing the allocator obtained is left allocated when the process ends, and a leak check
// (compute-sanitizer --leak-check full) reports only memory obtained elsewhere. Blocks still in
// use at exit are counted in the log line "cuda allocator: ... still in use at exit".
// Thread safety: every member may be called from any thread.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "framework/core/tensor.h"

namespace hp {

struct CudaAllocatorStats {
  size_t bytes_in_use = 0;  // handed out, rounded to buckets
  size_t bytes_cached = 0;  // free blocks held in the cache
  size_t peak_in_use = 0;
  int64_t device_mallocs = 0;  // cudaMalloc calls (cache misses)
  int64_t device_frees = 0;    // cudaFree calls
  int64_t failed_frees = 0;    // of those at shutdown, the ones that failed
  int64_t cache_hits = 0;
};

class CudaCachingAllocator final : public Allocator {
 public:
  explicit CudaCachingAllocator(int device_ordinal) : device_(device_ordinal) {}
  ~CudaCachingAllocator() override;

  void* allocate(size_t bytes) override;
  void deallocate(void* p, size_t bytes) override;
  Device device() const override { return Device::kCUDA; }

  // Returns every cached (free) block to the driver.
  void release_cached();
  // Returns every block to the driver, handed out or cached; blocks given back afterwards are
  // freed at once, and allocate() fails. Returns the number of blocks that were still handed out.
  // The exit handler calls it; tests call it on allocators of their own.
  int64_t shut_down();
  CudaAllocatorStats stats() const;
  int device_ordinal() const { return device_; }
  // The cudaError_t of the last failed cudaFree at shutdown (0: none).
  cudaError_t last_free_error() const;

  // Bucket size for a request: 512-byte granularity below 1 MiB, then four buckets per power of
  // two (at most 25% slack).
  static size_t bucket_size(size_t bytes);

 private:
  void release_cached_locked();
  void free_block(void* p, bool check);

  int device_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;  // bucket size -> free blocks
  std::unordered_map<void*, size_t> live_;     // handed-out block -> bucket size
  CudaAllocatorStats stats_;
  bool shut_down_ = false;
  int last_free_error_ = 0;
};

// The process-wide allocator of one device (lives until exit, so tensors may outlive backends;
// shut down by the exit handler described above).
CudaCachingAllocator& cuda_device_allocator(int device_ordinal);

}  // namespace hp
