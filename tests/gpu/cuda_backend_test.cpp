// CUDA backend infrastructure: the caching allocator, error reporting, the batch upload, events
// and the profile.
#include "framework/backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/cuda/cuda_allocator.h"
#include "framework/backend/cuda/cuda_check.h"
#include "framework/backend/profile.h"
#include "framework/data/packed_batch.h"

namespace hp {
namespace {

#define HP_SKIP_WITHOUT_GPU()                                             \
  do {                                                                    \
    if (cuda_device_count() == 0) {                                       \
      GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machine"; \
    }                                                                     \
  } while (0)

TEST(CudaAllocator, BucketsAndReuse) {
  EXPECT_EQ(CudaCachingAllocator::bucket_size(1), 512u);
  EXPECT_EQ(CudaCachingAllocator::bucket_size(513), 1024u);
  EXPECT_EQ(CudaCachingAllocator::bucket_size((1u << 20) + 1), (1u << 20) + (1u << 18));
  HP_SKIP_WITHOUT_GPU();
  CudaCachingAllocator& a = cuda_device_allocator(0);
  void* p = a.allocate(3000);
  const CudaAllocatorStats s0 = a.stats();
  a.deallocate(p, 3000);
  void* q = a.allocate(2900);  // same bucket: served from the cache
  EXPECT_EQ(q, p);
  EXPECT_EQ(a.stats().cache_hits, s0.cache_hits + 1);
  EXPECT_EQ(a.stats().device_mallocs, s0.device_mallocs);
  a.deallocate(q, 2900);
}

// A request whose bucket has no free block takes the smallest cached block up to twice its size
// (no cudaMalloc), which goes back to its own bucket; a larger block is not taken.
TEST(CudaAllocator, ReusesTheSmallestCachedBlockUpToTwiceTheRequest) {
  HP_SKIP_WITHOUT_GPU();
  CudaCachingAllocator a(0);
  const size_t big = 3 << 20, mid = 5 << 19;  // buckets of 3 MiB and 2.5 MiB
  void* pb = a.allocate(big);
  void* pm = a.allocate(mid);
  a.deallocate(pb, big);
  a.deallocate(pm, mid);
  CudaAllocatorStats s0 = a.stats();
  EXPECT_EQ(s0.device_mallocs, 2);
  void* q = a.allocate(2 << 20);  // bucket 2 MiB: none free; 2.5 MiB is the smallest that fits
  EXPECT_EQ(q, pm);
  EXPECT_EQ(a.stats().device_mallocs, 2);
  EXPECT_EQ(a.stats().bytes_in_use, CudaCachingAllocator::bucket_size(mid));
  void* r = a.allocate(1 << 20);  // 1 MiB: the 3 MiB block is more than twice it
  EXPECT_NE(r, pb);
  EXPECT_EQ(a.stats().device_mallocs, 3);
  a.deallocate(q, 2 << 20);
  EXPECT_EQ(a.allocate(mid), pm);  // back in its own bucket
  EXPECT_EQ(a.stats().device_mallocs, 3);
  a.deallocate(pm, mid);
  a.deallocate(r, 1 << 20);
  EXPECT_EQ(a.stats().bytes_in_use, 0u);
  EXPECT_EQ(a.shut_down(), 0);
}

TEST(CudaBackend, ErrorsNameTheStatement) {
  HP_SKIP_WITHOUT_GPU();
  try {
    CUDA_CHECK(cudaSetDevice(12345));
    FAIL() << "no exception";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kCuda);
    EXPECT_NE(what.find("cudaSetDevice(12345)"), std::string::npos) << what;
    EXPECT_NE(what.find("cuda_backend_test.cpp"), std::string::npos) << what;
  }
  cudaGetLastError();
}

TEST(CudaBackend, ShapeMismatchThrows) {
  HP_SKIP_WITHOUT_GPU();
  auto gpu = make_cuda_backend(0);
  Tensor a = gpu->zeros({4, 5}, DType::kBF16), b = gpu->zeros({6, 7}, DType::kBF16);
  Tensor c = gpu->zeros({4, 7}, DType::kBF16);
  EXPECT_THROW(gpu->gemm(a, false, b, false, c, 1.0, 0.0), Error);
}

TEST(CudaBackend, UploadBatchDoesNotSync) {
  HP_SKIP_WITHOUT_GPU();
  auto gpu = make_cuda_backend(0);
  std::vector<int32_t> pos;
  for (int s : {5, 100, 1, 150}) {
    for (int i = 0; i < s; ++i) pos.push_back(i);
  }
  std::vector<int32_t> ids(pos.size(), 7);
  const PackedBatch batch =
      PackedBatch::from_tokens(ids, ids, pos, static_cast<int64_t>(pos.size()));
  for (int rep = 0; rep < 20; ++rep) {  // reuses and grows the staging ring
    BatchMeta m = gpu->upload_batch(batch);
    EXPECT_EQ(m.n_seqs, 4);
  }
  EXPECT_EQ(gpu->syncs().total(), 0);
}

TEST(CudaBackend, EventsOrderStreams) {
  HP_SKIP_WITHOUT_GPU();
  auto gpu = make_cuda_backend(0);
  Tensor t = gpu->empty({1 << 20}, DType::kF32);
  gpu->set_stream(Backend::StreamKind::kCopy);
  gpu->fill(t, 2.0);
  auto done = gpu->record_event(Backend::StreamKind::kCopy);
  gpu->set_stream(Backend::StreamKind::kCompute);
  gpu->wait_event(Backend::StreamKind::kCompute, *done);
  gpu->axpy(1.0, t, t);  // 4 everywhere, only if the fill came first
  auto after = gpu->record_event(Backend::StreamKind::kCompute);
  gpu->event_synchronize(*after, SyncCause::kOffload);
  EXPECT_EQ(gpu->syncs().get(SyncCause::kOffload), 1);
  Tensor h = Tensor::host({1 << 20}, DType::kF32);
  gpu->read_to_host(t, h, SyncCause::kOther);
  for (int64_t i = 0; i < h.numel(); i += 4097) ASSERT_EQ(h.data<float>()[i], 4.0f) << i;
}

// A host wait between two kernels leaves the device idle; the profile names that gap by the work
// around it (and the gaps it lists are part of the idle time, never more).
TEST(CudaBackend, ProfileNamesTheWorkAroundEachIdleGap) {
  HP_SKIP_WITHOUT_GPU();
  auto gpu = make_cuda_backend(0);
  Tensor t = gpu->empty({1 << 20}, DType::kF32);
  gpu->fill(t, 1.0);
  Tensor h = Tensor::host({1}, DType::kF32);
  gpu->synchronize(SyncCause::kOther);
  gpu->profile_begin();
  // The host does nothing for a while before the first op: the window spans its recorded work
  // only, so no gap opens it.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  gpu->axpy(1.0, t, t);
  gpu->read_to_host(t.slice(0, 1), h, SyncCause::kOther);  // the device drains; the host waits
  gpu->fill(t, 3.0);
  const StepProfile p = gpu->profile_end();
  ASSERT_FALSE(p.idle_gaps.empty());
  double listed = 0;
  for (const StepProfile::IdleGap& g : p.idle_gaps) {
    EXPECT_GT(g.count, 0);
    EXPECT_GT(g.ms, 0);
    listed += g.ms;
  }
  EXPECT_LE(listed, p.idle_ms + 1e-6);
  const auto it = std::find_if(p.idle_gaps.begin(), p.idle_gaps.end(), [](const auto& g) {
    return g.before == "(memcpy)" && g.after.find("fill") != std::string::npos;
  });
  ASSERT_NE(it, p.idle_gaps.end()) << "no gap between the read and the fill";
  EXPECT_EQ(it->count, 1);
  for (const StepProfile::IdleGap& g : p.idle_gaps) EXPECT_NE(g.before, "(profile start)");
  EXPECT_GE(p.kernels, 3);  // the axpy, the copy, the fill
}

}  // namespace
}  // namespace hp
