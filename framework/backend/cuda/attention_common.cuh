// Building blocks of the tensor-core attention kernels: bf16 mma.sync m16n8k16 with f32
// accumulation, ldmatrix fragment loads, cp.async tile copies.
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16): lane = 4 * group + quad.
//   A (16x16, row-major): a0 = (group, 2quad..+1), a1 = (group+8, 2quad..), a2 = (group,
//   8+2quad..),
//                         a3 = (group+8, 8+2quad..).
//   B (16x8, k-major):    b0 = (k = 2quad..+1, n = group), b1 = (k = 8+2quad.., n = group).
//   C (16x8, f32):        c0,c1 = (group, 2quad..+1), c2,c3 = (group+8, 2quad..+1).
// Two adjacent C tiles (n = 0..15) hold exactly an A fragment's elements, which is how P =
// softmax(S) feeds P·V without leaving registers.
#pragma once

#include <mutex>
#include <set>
#include <utility>

#include "framework/backend/cuda/cuda_common.cuh"
#include "framework/backend/cuda/cuda_kernels.h"

namespace hp {
namespace cuda {
namespace attn {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane i supplies the address of row i%8 of matrix i/8.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
      "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// 2^x with the hardware approximation (about 2 ulp; 2^-inf = 0), for the softmax probabilities.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// A fragment of rows [row0, row0+16) x cols [col0, col0+16) of a row-major smem tile.
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16_t* s, int stride, int row0,
                                       int col0, int lane) {
  const int mi = lane >> 3, r = lane & 7;
  ldsm_x4(a, smem_addr(s + (row0 + r + (mi & 1) * 8) * stride + col0 + (mi >> 1) * 8));
}

// B fragments of two n-tiles, B(k, n) = s[n][k] (rows of s are the n index): b[0], b[1] for
// n in [n0, n0+8), b[2], b[3] for [n0+8, n0+16); k in [k0, k0+16).
__device__ __forceinline__ void load_b_rows_n(uint32_t (&b)[4], const bf16_t* s, int stride, int n0,
                                              int k0, int lane) {
  const int mi = lane >> 3, r = lane & 7;
  ldsm_x4(b, smem_addr(s + (n0 + r + (mi >> 1) * 8) * stride + k0 + (mi & 1) * 8));
}

// B fragments of two n-tiles, B(k, n) = s[k][n] (rows of s are the k index).
__device__ __forceinline__ void load_b_rows_k(uint32_t (&b)[4], const bf16_t* s, int stride, int k0,
                                              int n0, int lane) {
  const int mi = lane >> 3, r = lane & 7;
  ldsm_x4_trans(b, smem_addr(s + (k0 + r + (mi & 1) * 8) * stride + n0 + (mi >> 1) * 8));
}

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Copies rows [row0, row0 + R) of one head (head_ptr: the head's first element of token 0, token
// stride ld) into s[R][D + 8]; rows at or past row_end are zero-filled.
template <int D, int R>
__device__ __forceinline__ void load_rows_async(bf16_t* s, const bf16_t* head_ptr, int64_t ld,
                                                int row0, int row_end) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < R * kChunks; i += blockDim.x) {
    const int r = i / kChunks, c = i - (i / kChunks) * kChunks;
    const bool valid = row0 + r < row_end;
    const bf16_t* src = valid ? head_ptr + (int64_t)(row0 + r) * ld + c * 8 : head_ptr;
    cp_async_16(s + r * (D + 8) + c * 8, src, valid);
  }
}

// Raises a kernel's dynamic shared memory limit on the current device (once per kernel and
// device).
template <typename K>
void set_smem_limit_once(K* kernel, int bytes) {
  static std::mutex mu;
  static std::set<std::pair<int, const void*>> done;
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(mu);
  if (!done.insert({dev, reinterpret_cast<const void*>(kernel)}).second) return;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

}  // namespace attn
}  // namespace cuda
}  // namespace hp
