// Fused AdamW: one pass updates master weights and moments and writes the working copy.
#include <cstring>
#include <vector>

#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"
#include "framework/core/clip.h"

namespace hp {
namespace cuda {

namespace {

// A gated update's go-ahead; its scale replaces s.grad_scale. Every thread of a launch reads the
// same gate and takes the same branch.
__device__ __forceinline__ bool gate_open(AdamWScalars& s) {
  if (s.gate == nullptr) return true;
  if (s.gate[1] == 0.0) return false;
  s.grad_scale = static_cast<float>(s.gate[0]);
  return true;
}

__global__ void update_gate_kernel(const float* checked, int64_t n_checked, const float* sumsq,
                                   int64_t n_sumsq, double max_norm, double* gate) {
  bool ok = true;
  for (int64_t i = 0; i < n_checked; ++i) ok = ok && isfinite(checked[i]);
  double ss = 0;
  for (int64_t i = 0; i < n_sumsq; ++i) ss += static_cast<double>(sumsq[i]);
  gate[0] = clip_coefficient(sqrt(ss), max_norm);
  gate[1] = ok ? 1.0 : 0.0;
}

// One element of the update: moments, bias correction, decoupled weight decay.
__device__ __forceinline__ void adamw_element(float grad, const AdamWScalars& s, float& m,
                                              float& v, float& p) {
  const float g = grad * s.grad_scale;
  m = s.beta1 * m + (1.f - s.beta1) * g;
  v = s.beta2 * v + (1.f - s.beta2) * g * g;
  const float mhat = m / s.bias_correction1;
  const float vhat = v / s.bias_correction2;
  p -= s.lr * (mhat / (sqrtf(vhat) + s.eps) + s.weight_decay * p);
}

// Element i of one tensor (working may be null; grad null: a zero gradient, not read).
template <typename W>
__device__ __forceinline__ void adamw_at(float* master, const float* grad, float* m, float* v,
                                         int64_t i, const AdamWScalars& s, W* working) {
  adamw_element(grad ? grad[i] : 0.f, s, m[i], v[i], master[i]);
  if (working) working[i] = from_f32<W>(master[i]);
}

// Elements 4i..4i+3 of one tensor with 16-byte loads (the working copy's 4 elements stored at
// once); the same adamw_element as adamw_at, so results are bitwise the same (grad null: zeros).
template <typename W>
__device__ __forceinline__ void adamw_x4_at(float4* master, const float4* grad, float4* m,
                                            float4* v, int64_t i, const AdamWScalars& s,
                                            W* working) {
  const float4 g4 = grad ? grad[i] : make_float4(0.f, 0.f, 0.f, 0.f);
  float4 m4 = m[i], v4 = v[i], p4 = master[i];
  const float* gp = reinterpret_cast<const float*>(&g4);
  float* mp = reinterpret_cast<float*>(&m4);
  float* vp = reinterpret_cast<float*>(&v4);
  float* pp = reinterpret_cast<float*>(&p4);
  W out[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    adamw_element(gp[j], s, mp[j], vp[j], pp[j]);
    out[j] = from_f32<W>(pp[j]);
  }
  m[i] = m4;
  v[i] = v4;
  master[i] = p4;
  if (working) {
    if constexpr (sizeof(W) == 2) {
      uint2 packed;
      std::memcpy(&packed, out, 8);
      reinterpret_cast<uint2*>(working)[i] = packed;
    } else {
      float4 w4;
      std::memcpy(&w4, out, 16);
      reinterpret_cast<float4*>(working)[i] = w4;
    }
  }
}

template <typename W>
__global__ void adamw_fwd_kernel(float* master, const float* grad, float* m, float* v, int64_t n,
                                 AdamWScalars s, W* working) {
  if (!gate_open(s)) return;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    adamw_at(master, grad, m, v, i, s, working);
  }
}

// Four elements per thread with 16-byte loads: AdamW moves 30 bytes a parameter (master, m, v
// read and written, grad read, bf16 working copy written) and is bound by device bandwidth.
template <typename W>
__global__ void adamw_x4_kernel(float4* master, const float4* grad, float4* m, float4* v,
                                int64_t n4, AdamWScalars s, W* working) {
  if (!gate_open(s)) return;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4;
       i += (int64_t)gridDim.x * blockDim.x) {
    adamw_x4_at(master, grad, m, v, i, s, working);
  }
}

// ---- many tensors a launch (launch_adamw_many) ----
constexpr int kManyThreads = 256;
constexpr int kManyChunk = 4 * 4 * kManyThreads;  // elements a block: 4 float4s a thread
constexpr int kManyMax = 64;                      // entries a launch (the table is ~3.4 KB)
constexpr int32_t kManyMaxBlocks = 1 << 30;       // blocks a launch, within the grid's limit
constexpr uint8_t kDecay = 1, kVector = 2;

// The entries of one launch, passed by value in the kernel's parameters. Entry e owns blocks
// [first_block[e], first_block[e + 1]), one chunk of kManyChunk elements each.
struct AdamWTable {
  float* master[kManyMax];
  const float* grad[kManyMax];
  float* m[kManyMax];
  float* v[kManyMax];
  void* working[kManyMax];
  int64_t n[kManyMax];
  int32_t first_block[kManyMax + 1];
  uint8_t flags[kManyMax];  // kDecay: weight decay applies; kVector: 16-byte accesses fit
  int32_t count;
};
static_assert(sizeof(AdamWTable) + sizeof(AdamWScalars) <= 4000,
              "the table must fit a kernel's 4 KB of parameters");

// One chunk of one entry per block: float4s where the entry's pointers allow (then its last
// n % 4 elements one by one), else element by element; each element through adamw_element as
// launch_adamw computes it.
template <typename W>
__global__ void __launch_bounds__(kManyThreads)
    adamw_many_kernel(const AdamWTable t, const AdamWScalars s0) {
  const int32_t b = static_cast<int32_t>(blockIdx.x);
  const int e = entry_of_block(t.first_block, t.count, b);
  AdamWScalars s = s0;
  if (!gate_open(s)) return;
  if (!(t.flags[e] & kDecay)) s.weight_decay = 0.f;
  float* master = t.master[e];
  const float* grad = t.grad[e];
  float* m = t.m[e];
  float* v = t.v[e];
  W* working = static_cast<W*>(t.working[e]);
  const int64_t n = t.n[e];
  const int64_t begin = static_cast<int64_t>(b - t.first_block[e]) * kManyChunk;
  const int64_t end = min(n, begin + kManyChunk);
  int64_t scalar_begin = begin;
  if (t.flags[e] & kVector) {
    const int64_t n4 = n / 4;
    const int64_t q_end = min(n4, end / 4);  // begin is a multiple of 4
    for (int64_t q = begin / 4 + threadIdx.x; q < q_end; q += kManyThreads) {
      adamw_x4_at(reinterpret_cast<float4*>(master), reinterpret_cast<const float4*>(grad),
                  reinterpret_cast<float4*>(m), reinterpret_cast<float4*>(v), q, s, working);
    }
    scalar_begin = max(begin, 4 * n4);
  }
  for (int64_t i = scalar_begin + threadIdx.x; i < end; i += kManyThreads) {
    adamw_at(master, grad, m, v, i, s, working);
  }
}

template <typename W>
void adamw_many_group(const std::vector<const AdamWRef*>& entries, const AdamWScalars& s,
                      cudaStream_t stream) {
  auto aligned = [](const void* q, uintptr_t a) { return reinterpret_cast<uintptr_t>(q) % a == 0; };
  size_t i = 0;
  while (i < entries.size()) {
    AdamWTable t{};
    int32_t blocks = 0;
    for (; i < entries.size() && t.count < kManyMax; ++i) {
      const AdamWRef& r = *entries[i];
      const int64_t chunks = (r.n + kManyChunk - 1) / kManyChunk;
      HP_CHECK(chunks <= kManyMaxBlocks, "launch_adamw_many: a tensor of ", r.n,
               " elements is too large");
      if (blocks + chunks > kManyMaxBlocks) break;
      const int c = t.count++;
      t.master[c] = r.master;
      t.grad[c] = r.grad;
      t.m[c] = r.m;
      t.v[c] = r.v;
      t.working[c] = r.working;
      t.n[c] = r.n;
      t.first_block[c] = blocks;
      const bool vec = aligned(r.master, 16) && aligned(r.grad, 16) && aligned(r.m, 16) &&
                       aligned(r.v, 16) &&
                       (r.working == nullptr || aligned(r.working, 4 * sizeof(W)));
      t.flags[c] = static_cast<uint8_t>((r.weight_decay ? kDecay : 0) | (vec ? kVector : 0));
      blocks += static_cast<int32_t>(chunks);
    }
    t.first_block[t.count] = blocks;
    adamw_many_kernel<W><<<static_cast<unsigned>(blocks), kManyThreads, 0, stream>>>(t, s);
    CUDA_CHECK_LAUNCH();
  }
}

// Check only: the same adamw_element on copies, nothing written but *flag = 1 where a new m, v
// or master (or the master in the working dtype W) would not be finite.
template <typename W>
__global__ void adamw_check_kernel(const float* master, const float* grad, const float* m,
                                   const float* v, int64_t n, AdamWScalars s, float* flag) {
  bool bad = false;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    float mi = m[i], vi = v[i], pi = master[i];
    adamw_element(grad[i], s, mi, vi, pi);
    const float wi = to_f32(from_f32<W>(pi));
    bad = bad || !(isfinite(mi) && isfinite(vi) && isfinite(pi) && isfinite(wi));
  }
  if (bad) *flag = 1.f;  // every writer writes the same value
}

}  // namespace

void launch_adamw_check(const float* master, const float* grad, const float* m, const float* v,
                        int64_t n, const AdamWScalars& s, DType working_t, float* flag,
                        cudaStream_t stream) {
  if (n == 0) return;
  const unsigned grid = grid_for(n, 256, 8192);
  dispatch_float(working_t, [&](auto ws) {
    using W = decltype(ws);
    adamw_check_kernel<W><<<grid, 256, 0, stream>>>(master, grad, m, v, n, s, flag);
  });
  CUDA_CHECK_LAUNCH();
}

void launch_update_gate(const float* checked, int64_t n_checked, const float* sumsq,
                        int64_t n_sumsq, double max_norm, double* gate, cudaStream_t stream) {
  update_gate_kernel<<<1, 1, 0, stream>>>(checked, n_checked, sumsq, n_sumsq, max_norm, gate);
  CUDA_CHECK_LAUNCH();
}

void launch_adamw_many(const std::vector<AdamWRef>& entries, const AdamWScalars& s,
                       cudaStream_t stream) {
  // Two groups by the working copy's element type: none or f32 (float), and bf16.
  std::vector<const AdamWRef*> groups[2];
  for (const AdamWRef& r : entries) {
    if (r.n == 0) continue;
    HP_CHECK(r.working == nullptr || r.working_t == DType::kF32 || r.working_t == DType::kBF16,
             "launch_adamw_many: working dtype ", dtype_name(r.working_t), " is not f32 or bf16");
    groups[r.working != nullptr && r.working_t == DType::kBF16 ? 1 : 0].push_back(&r);
  }
  adamw_many_group<float>(groups[0], s, stream);
  adamw_many_group<bf16_t>(groups[1], s, stream);
}

void launch_adamw(float* master, const float* grad, float* m, float* v, int64_t n,
                  const AdamWScalars& s, void* working, DType working_t, cudaStream_t stream) {
  if (n == 0) return;
  auto aligned = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  if (n % 4 == 0 && aligned(master) && aligned(grad) && aligned(m) && aligned(v) &&
      (working == nullptr ||
       reinterpret_cast<uintptr_t>(working) % (working_t == DType::kBF16 ? 8 : 16) == 0)) {
    const unsigned grid4 = grid_for(n / 4, 256, 16384);
    auto run = [&](auto* w) {
      adamw_x4_kernel<<<grid4, 256, 0, stream>>>(
          reinterpret_cast<float4*>(master), reinterpret_cast<const float4*>(grad),
          reinterpret_cast<float4*>(m), reinterpret_cast<float4*>(v), n / 4, s, w);
    };
    if (working == nullptr) {
      run(static_cast<float*>(nullptr));
    } else {
      dispatch_float(working_t, [&](auto ws) { run(static_cast<decltype(ws)*>(working)); });
    }
    CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned grid = grid_for(n, 256, 8192);
  if (working == nullptr) {
    adamw_fwd_kernel<float><<<grid, 256, 0, stream>>>(master, grad, m, v, n, s, nullptr);
  } else {
    dispatch_float(working_t, [&](auto ws) {
      using W = decltype(ws);
      adamw_fwd_kernel<<<grid, 256, 0, stream>>>(master, grad, m, v, n, s,
                                                 static_cast<W*>(working));
    });
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace cuda
}  // namespace hp
