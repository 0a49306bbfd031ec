// The caching allocator's shutdown (run at process exit for the device allocators): every block
// it obtained goes back to the driver, handed out or cached, so a leak check sees none of them.
#include "framework/backend/cuda/cuda_allocator.h"

#include <gtest/gtest.h>

#include "framework/core/error.h"
#include "tests/gpu/gpu_fixtures.h"

namespace hp {
namespace {

TEST(CudaAllocator, ShutDownReturnsEveryBlockCachedOrHandedOut) {
  HP_REQUIRE_GPU();
  CudaCachingAllocator a(0);
  void* cached = a.allocate(1 << 20);
  void* live1 = a.allocate(3 << 20);
  void* live2 = a.allocate(5000);
  a.deallocate(cached, 1 << 20);
  CudaAllocatorStats s = a.stats();
  EXPECT_EQ(s.device_mallocs, 3);
  EXPECT_EQ(s.device_frees, 0);
  EXPECT_GT(s.bytes_cached, 0u);

  EXPECT_EQ(a.shut_down(), 2);  // two blocks were still handed out
  s = a.stats();
  EXPECT_EQ(s.device_frees, s.device_mallocs);
  EXPECT_EQ(s.failed_frees, 0);
  EXPECT_EQ(s.bytes_in_use, 0u);
  EXPECT_EQ(s.bytes_cached, 0u);

  // A tensor that outlives the shutdown gives its block back without a second cudaFree.
  a.deallocate(live1, 3 << 20);
  a.deallocate(live2, 5000);
  EXPECT_EQ(a.stats().device_frees, 3);
  EXPECT_EQ(a.shut_down(), 0);  // once only
  EXPECT_THROW(a.allocate(512), Error);
}

TEST(CudaAllocator, ReleaseCachedKeepsHandedOutBlocks) {
  HP_REQUIRE_GPU();
  CudaCachingAllocator a(0);
  void* p = a.allocate(4096);
  void* q = a.allocate(8192);
  a.deallocate(p, 4096);
  a.release_cached();
  CudaAllocatorStats s = a.stats();
  EXPECT_EQ(s.device_frees, 1);
  EXPECT_EQ(s.bytes_cached, 0u);
  EXPECT_EQ(s.bytes_in_use, CudaCachingAllocator::bucket_size(8192));
  a.deallocate(q, 8192);
  EXPECT_EQ(a.shut_down(), 0);
  EXPECT_EQ(a.stats().device_frees, 2);
}

}  // namespace
}  // namespace hp
