// The CUDA backend's q/k RMSNorm + rope (qk_norm_rope_fwd, fused into one kernel; and
// qk_norm_rope_bwd, the two ops in turn): bit for bit the two ops on the same backend
// (qk_norm_fwd then rope; rope inverse in place then qk_norm_bwd), in place and out of place,
// and within the consistency tests' tolerance of the CPU reference. Qwen3-0.6B's heads (16 q, 8
// kv, 128 wide) over packed sequences, a small odd shape, f32 activations, and shapes the fused
// kernel does not take (the two ops then).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "framework/backend/backend.h"
#include "framework/backend/cuda/cuda_backend.h"
#include "framework/backend/cuda/cuda_kernels.h"
#include "framework/core/rng.h"
#include "framework/model/rope_table.h"
#include "tests/gpu/gpu_fixtures.h"

namespace hp {
namespace {

constexpr double kTol = 1e-2;  // tests/gpu/cuda_consistency_test.cpp's for qk_norm and rope

struct Shape4 {
  int64_t hq, hkv, d;
  std::vector<int> seqs;  // packed sequence lengths; positions restart at 0 in each
};

class CudaQkNormRope : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0)
      GTEST_SKIP() << "no CUDA device: GPU tests run on the GPU machine";
    cpu_ = make_cpu_backend(DType::kF32);
    gpu_ = make_cuda_backend(0);
  }

  // Host f32 tensor of N(offset, scale^2) values rounded to bf16 (both backends see the same
  // numbers).
  static Tensor rand(const Shape& shape, uint64_t seed, double scale = 1.0, double offset = 0.0) {
    Philox rng(seed, "qk-norm-rope");
    Tensor t = Tensor::host(shape, DType::kF32);
    float* p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i)
      p[i] = static_cast<float>(bf16(static_cast<float>(offset + scale * rng.normal(i))));
    return t;
  }

  Tensor on_gpu(const Tensor& host, DType dt) {
    if (host.dtype() == DType::kI32 || dt == DType::kF32) return gpu_->upload(host);
    Tensor f = gpu_->upload(host);
    Tensor t = gpu_->empty(host.shape(), dt);
    gpu_->convert(f, t);
    return t;
  }
  Tensor gpu_clone(const Tensor& t) {
    Tensor c = gpu_->empty(t.shape(), t.dtype());
    gpu_->copy(t, c);
    return c;
  }
  // The bytes of a GPU tensor.
  std::vector<unsigned char> bytes(const Tensor& t) {
    Tensor h = Tensor::host(t.shape(), t.dtype());
    gpu_->read_to_host(t, h, SyncCause::kOther);
    const auto* p = static_cast<const unsigned char*>(h.raw());
    return std::vector<unsigned char>(p, p + h.nbytes());
  }
  std::vector<double> values(const Tensor& t) { return gpu_test::device_values(*gpu_, t); }

  void expect_same_bits(const char* what, const Tensor& a, const Tensor& b) {
    const std::vector<unsigned char> x = bytes(a), y = bytes(b);
    ASSERT_EQ(x.size(), y.size()) << what;
    const size_t elem = dtype_size(a.dtype());
    int64_t diff = 0;
    for (size_t i = 0; i < x.size(); i += elem) diff += std::memcmp(&x[i], &y[i], elem) != 0;
    EXPECT_EQ(diff, 0) << what << ": " << diff << " of " << x.size() / elem << " elements differ";
  }

  void expect_close(const char* what, const Tensor& g, const Tensor& c) {
    const std::vector<double> a = values(g), b = to_double_vector(c);
    ASSERT_EQ(a.size(), b.size()) << what;
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      num += (a[i] - b[i]) * (a[i] - b[i]);
      den += b[i] * b[i];
    }
    ASSERT_GT(den, 0) << what << " is all zeros";
    EXPECT_LE(std::sqrt(num / den), kTol) << what << ": relative error " << std::sqrt(num / den);
  }

  // Fused vs the two ops on the GPU (bitwise), and the fused GPU result vs the CPU reference's.
  void check(const Shape4& s, DType act);

  std::unique_ptr<Backend> cpu_, gpu_;
};

Tensor positions_of(const std::vector<int>& seqs) {
  std::vector<int32_t> pos;
  for (int len : seqs)
    for (int i = 0; i < len; ++i) pos.push_back(i);
  return Tensor::host_from(pos, DType::kI32);
}

void CudaQkNormRope::check(const Shape4& s, DType act) {
  const Tensor hpos = positions_of(s.seqs);
  const int64_t n = hpos.numel(), h = s.hq + 2 * s.hkv, d = s.d, hn = s.hq + s.hkv;
  int max_len = 0;
  for (int len : s.seqs) max_len = std::max(max_len, len);
  const Tensor x = rand({n, h, d}, 1, 1.5), qw = rand({d}, 2, 0.3, 1.0),
               kw = rand({d}, 3, 0.3, 1.0);
  const Tensor dout = rand({n, h, d}, 4), dqw0 = rand({d}, 5), dkw0 = rand({d}, 6);
  const RopeTable gt = make_rope_table(*gpu_, static_cast<int>(d), max_len, 1e6);
  const RopeTable ct = make_rope_table(*cpu_, static_cast<int>(d), max_len, 1e6);
  const Tensor gx = on_gpu(x, act), gqw = on_gpu(qw, act), gkw = on_gpu(kw, act);
  const Tensor gpos = gpu_->upload(hpos), gdout = on_gpu(dout, act);
  const std::vector<unsigned char> dout_bits = bytes(gdout);

  // Forward: fused vs qk_norm_fwd then rope.
  Tensor out = gpu_->empty({n, h, d}, act), rstd = gpu_->empty({n, hn}, DType::kF32);
  gpu_->qk_norm_rope_fwd(gx, gqw, gkw, s.hq, s.hkv, 1e-6, gpos, gt, out, rstd);
  Tensor out2 = gpu_->empty({n, h, d}, act), rstd2 = gpu_->empty({n, hn}, DType::kF32);
  gpu_->qk_norm_fwd(gx, gqw, gkw, s.hq, s.hkv, 1e-6, out2, rstd2);
  gpu_->rope(out2, static_cast<int>(hn), gpos, gt, false);
  expect_same_bits("out", out, out2);
  expect_same_bits("rstd", rstd, rstd2);

  // Backward: fused, out of place and in place, vs rope inverse in place then qk_norm_bwd.
  Tensor din = gpu_->empty({n, h, d}, act);
  Tensor dqw = on_gpu(dqw0, DType::kF32), dkw = on_gpu(dkw0, DType::kF32);
  gpu_->qk_norm_rope_bwd(gx, gqw, gkw, s.hq, s.hkv, rstd, gpos, gt, gdout, din, dqw, dkw);
  EXPECT_TRUE(bytes(gdout) == dout_bits) << "dout was written out of place";
  Tensor rotated = gpu_clone(gdout), din2 = gpu_->empty({n, h, d}, act);
  Tensor dqw2 = on_gpu(dqw0, DType::kF32), dkw2 = on_gpu(dkw0, DType::kF32);
  gpu_->rope(rotated, static_cast<int>(hn), gpos, gt, true);
  gpu_->qk_norm_bwd(gx, gqw, gkw, s.hq, s.hkv, rstd2, rotated, din2, dqw2, dkw2);
  expect_same_bits("din", din, din2);
  expect_same_bits("dqw", dqw, dqw2);
  expect_same_bits("dkw", dkw, dkw2);
  Tensor din3 = gpu_clone(gdout);
  Tensor dqw3 = on_gpu(dqw0, DType::kF32), dkw3 = on_gpu(dkw0, DType::kF32);
  gpu_->qk_norm_rope_bwd(gx, gqw, gkw, s.hq, s.hkv, rstd, gpos, gt, din3, din3, dqw3, dkw3);
  expect_same_bits("din in place", din3, din2);
  expect_same_bits("dqw in place", dqw3, dqw2);
  expect_same_bits("dkw in place", dkw3, dkw2);

  // The CPU reference (f32, the same bf16-rounded inputs).
  const Tensor cpos = cpu_->upload(hpos);
  Tensor cout = cpu_->empty({n, h, d}, DType::kF32), crstd = cpu_->empty({n, hn}, DType::kF32);
  cpu_->qk_norm_rope_fwd(cpu_->upload(x), cpu_->upload(qw), cpu_->upload(kw), s.hq, s.hkv, 1e-6,
                         cpos, ct, cout, crstd);
  Tensor cdin = cpu_->empty({n, h, d}, DType::kF32);
  Tensor cdqw = cpu_->upload(dqw0), cdkw = cpu_->upload(dkw0);
  cpu_->qk_norm_rope_bwd(cpu_->upload(x), cpu_->upload(qw), cpu_->upload(kw), s.hq, s.hkv, crstd,
                         cpos, ct, cpu_->upload(dout), cdin, cdqw, cdkw);
  expect_close("out", out, cout);
  expect_close("rstd", rstd, crstd);
  expect_close("din", din, cdin);
  expect_close("dqw", dqw, cdqw);
  expect_close("dkw", dkw, cdkw);
}

// Qwen3-0.6B's attention heads over 3000 tokens of four packed sequences.
TEST_F(CudaQkNormRope, Qwen3ShapeBitwiseAndNearCpu) {
  check({16, 8, 128, {1200, 37, 900, 863}}, DType::kBF16);
}

// 4 q and 2 kv heads of 64 (8 lanes a head) over 33 tokens: the last warp partly full.
TEST_F(CudaQkNormRope, SmallOddShapeBitwiseAndNearCpu) {
  check({4, 2, 64, {5, 17, 11}}, DType::kBF16);
  check({3, 1, 32, {9, 4}}, DType::kF32);  // f32 rows: 4 elements a lane, 8 lanes a head
}

// Heads the fused kernels do not take (40 wide: 5 vectors; 8 wide: one vector, no lane to pair
// with): the two ops, the same bits.
TEST_F(CudaQkNormRope, FallbackShapesBitwiseAndNearCpu) {
  check({2, 1, 40, {7, 6}}, DType::kBF16);
  check({2, 1, 8, {13}}, DType::kBF16);
}

// The fused forward kernel runs for Qwen3's heads (its launcher says whether it did), and refuses
// the fallback shapes without writing anything.
TEST_F(CudaQkNormRope, Qwen3HeadsTakeTheFusedForwardKernel) {
  for (const int64_t d : {int64_t{128}, int64_t{64}, int64_t{40}, int64_t{8}}) {
    SCOPED_TRACE("head_dim " + std::to_string(d));
    const bool fused = d == 128 || d == 64;
    const int64_t n = 5, hq = 16, hkv = 8, h = hq + 2 * hkv;
    const Tensor gx = on_gpu(rand({n, h, d}, 11), DType::kBF16);
    const Tensor gw = on_gpu(rand({d}, 12, 0.3, 1.0), DType::kBF16);
    const Tensor gpos = gpu_->upload(positions_of({n}));
    const RopeTable gt = make_rope_table(*gpu_, static_cast<int>(d), n, 1e6);
    Tensor out = gpu_->zeros({n, h, d}, DType::kBF16),
           rstd = gpu_->zeros({n, hq + hkv}, DType::kF32);
    cudaStream_t stream = cuda_compute_stream(*gpu_);  // where the backend's ops run
    EXPECT_EQ(cuda::launch_qk_norm_rope_fwd(
                  gx.raw(), DType::kBF16, gw.raw(), gw.raw(), DType::kBF16, n, static_cast<int>(h),
                  static_cast<int>(hq), static_cast<int>(hkv), static_cast<int>(d), 1e-6f,
                  gpos.data<int32_t>(), gt.cos.data<float>(), gt.sin.data<float>(), n, out.raw(),
                  rstd.data<float>(), stream),
              fused);
    // What ran wrote something; what refused wrote nothing.
    int64_t nonzero = 0;
    for (const Tensor* t : {&out, &rstd})
      for (double v : values(*t)) nonzero += v != 0;
    if (fused)
      EXPECT_GT(nonzero, 0);
    else
      EXPECT_EQ(nonzero, 0);
  }
}

}  // namespace
}  // namespace hp
