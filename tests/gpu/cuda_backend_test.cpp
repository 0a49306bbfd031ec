// CUDA backend infrastructure: the caching allocator, error reporting, the batch upload, and
// (disabled by default, run by launch/gpu_suite.sh) attention timings.
#include "framework/backend/cuda/cuda_backend.h"

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/cuda/cuda_allocator.h"
#include "framework/backend/cuda/cuda_check.h"
#include "framework/backend/profile.h"
#include "framework/core/rng.h"
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
  gpu->profile_begin();
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
  EXPECT_GE(p.kernels, 3);  // the axpy, the copy, the fill
}

// ---- timings (not a test of behaviour: run explicitly)
// ----------------------------------------------

struct PerfCase {
  const char* name;
  int hq, hkv, d, window;
  std::vector<int> docs;  // document lengths, packed into one batch
};
// Packed documents of realistic lengths (64..4096), 16,384 tokens: as attention_vs_torch.py.
const std::vector<int> kDocs = {3100, 517, 2048, 4000, 1290, 3777, 1652};

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

TEST(CudaPerf, DISABLED_Attention) {
  HP_SKIP_WITHOUT_GPU();
  const std::vector<int> four(4, 4096);
  const PerfCase cases[] = {
      {"gpt-oss d64 full", 64, 8, 64, 0, four},
      {"gpt-oss d64 window128", 64, 8, 64, 128, four},
      {"d128 full", 32, 8, 128, 0, four},
      {"d128 full 16k", 32, 8, 128, 0, {16384}},
      {"gpt-oss d64 docs", 64, 8, 64, 0, kDocs},
      {"gpt-oss d64 docs window128", 64, 8, 64, 128, kDocs},
      {"d128 docs", 32, 8, 128, 0, kDocs},
  };
  // Every attention path: the tiled kernels, cuDNN (deterministic backward), cuDNN (fast).
  struct Path {
    const char* name;
    AttentionImpl impl;
    bool deterministic;
  };
  for (const Path path :
       {Path{"tiled", AttentionImpl::kTiled, true}, Path{"cudnn", AttentionImpl::kCudnn, true},
        Path{"cudnn-fast", AttentionImpl::kCudnn, false}}) {
    std::unique_ptr<Backend> gpu;
    try {
      gpu = make_cuda_backend(0, CudaBackendOptions{path.impl, path.deterministic});
    } catch (const UserError& e) {
      std::printf("attention path %s unavailable: %s\n", path.name, e.what());
      continue;
    }
    cudaStream_t stream = cuda_compute_stream(*gpu);
    // A block of random values, tiled over the inputs (values repeat; timing does not care).
    Philox rng(1, "cuda-perf");
    const int64_t kBlock = 1 << 20;
    Tensor host = Tensor::host({kBlock}, DType::kF32);
    for (int64_t i = 0; i < kBlock; ++i) host.data<float>()[i] = static_cast<float>(rng.normal(i));
    Tensor block32 = gpu->upload(host);
    Tensor block = gpu->empty({kBlock}, DType::kBF16);
    gpu->convert(block32, block);
    auto randomize = [&](Tensor& t) {
      Tensor flat = t.reshape({-1});
      for (int64_t s = 0; s < flat.numel(); s += kBlock) {
        const int64_t c = std::min(kBlock, flat.numel() - s);
        Tensor dst = flat.flat_view(s, c);
        gpu->copy(block.flat_view(0, c), dst);
      }
    };

    std::printf("%-40s %10s %10s %12s %12s\n", "attention [path]", "fwd ms", "bwd ms",
                "fwd TFLOP/s", "bwd TFLOP/s");
    for (const PerfCase& c : cases) {
      std::vector<int32_t> pos;
      for (int len : c.docs)
        for (int i = 0; i < len; ++i) pos.push_back(i);
      std::vector<int32_t> ids(pos.size(), 1);
      const int64_t n = static_cast<int64_t>(pos.size());
      const PackedBatch batch = PackedBatch::from_tokens(ids, ids, pos, n);
      BatchMeta meta = gpu->upload_batch(batch);
      const int64_t h = c.hq + 2 * c.hkv;
      AttentionShape shape{c.hq, c.hkv, c.d, c.window, 1.0 / std::sqrt(static_cast<double>(c.d))};
      Tensor qkv = gpu->empty({n, h, c.d}, DType::kBF16),
             dout = gpu->empty({n, c.hq, c.d}, DType::kBF16);
      randomize(qkv);
      randomize(dout);
      Tensor sinks = gpu->zeros({c.hq}, DType::kBF16), dsinks = gpu->zeros({c.hq}, DType::kF32);
      Tensor out = gpu->empty({n, c.hq, c.d}, DType::kBF16),
             lse = gpu->empty({n, c.hq}, DType::kF32);
      Tensor dqkv = gpu->empty({n, h, c.d}, DType::kBF16);
      cudaEvent_t e0, e1, e2;
      CUDA_CHECK(cudaEventCreate(&e0));
      CUDA_CHECK(cudaEventCreate(&e1));
      CUDA_CHECK(cudaEventCreate(&e2));
      std::vector<float> tf, tb;
      for (int it = 0; it < 12; ++it) {
        CUDA_CHECK(cudaEventRecord(e0, stream));
        gpu->attention_fwd(qkv, sinks, meta, shape, out, lse);
        CUDA_CHECK(cudaEventRecord(e1, stream));
        gpu->attention_bwd(qkv, sinks, meta, shape, out, lse, dout, dqkv, dsinks);
        CUDA_CHECK(cudaEventRecord(e2, stream));
        CUDA_CHECK(cudaEventSynchronize(e2));
        float f = 0, b = 0;
        CUDA_CHECK(cudaEventElapsedTime(&f, e0, e1));
        CUDA_CHECK(cudaEventElapsedTime(&b, e1, e2));
        if (it >= 2) {  // warm-up
          tf.push_back(f);
          tb.push_back(b);
        }
      }
      const double pairs = batch.attention_pairs(c.window);
      const double fwd_flops = 4.0 * pairs * c.d * c.hq;  // QK^T and PV
      const double bwd_flops = 2.5 * fwd_flops;           // five products of the same size
      const float f = median(tf), b = median(tb);
      const std::string label = std::string(c.name) + " [" + path.name + "]";
      std::printf("%-40s %10.3f %10.3f %12.1f %12.1f\n", label.c_str(), f, b, fwd_flops / (f * 1e9),
                  bwd_flops / (b * 1e9));
      CUDA_CHECK(cudaEventDestroy(e0));
      CUDA_CHECK(cudaEventDestroy(e1));
      CUDA_CHECK(cudaEventDestroy(e2));
    }
  }
}

}  // namespace
}  // namespace hp
