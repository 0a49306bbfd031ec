// Internal to the CPU backend: small vector helpers and the attention kernels, which live in their
// own file because they are the largest and the most performance-sensitive ops of the reference.
#pragma once

#include <cstdint>

#include "framework/core/dtype.h"

namespace hp::cpu {

template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType kValue = DType::kF32;
};
template <>
struct DTypeOf<double> {
  static constexpr DType kValue = DType::kF64;
};

// The simd reduction lets the compiler vectorize; its summation order is fixed by the generated
// code, so results stay bitwise reproducible run to run.
template <typename T>
inline T dot(const T* a, const T* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += alpha * x
template <typename T>
inline void axpy(T alpha, const T* x, T* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Packed varlen attention geometry. The caller has validated every field: cu_seqlens holds
// n_seqs + 1 nondecreasing offsets from 0 to n_tokens, hq % hkv == 0, window >= 0.
struct AttnLayout {
  int64_t n_tokens = 0;
  int64_t n_seqs = 0;
  const int32_t* cu_seqlens = nullptr;
  int hq = 0;
  int hkv = 0;
  int d = 0;
  int window = 0;  // 0: full causal
  double scale = 0;

  int64_t row() const { return static_cast<int64_t>(hq + 2 * hkv) * d; }
  // The first key query i may see, within the sequence that starts at `begin`.
  int64_t first_key(int64_t i, int64_t begin) const {
    if (window <= 0) return begin;
    return i - window + 1 > begin ? i - window + 1 : begin;
  }
};

// out[N,hq,d], lse[N,hq]; sinks may be null.
template <typename T>
void attention_fwd(const AttnLayout& layout, const T* qkv, const T* sinks, T* out, T* lse);

// dqkv[N, hq+2hkv, d] written; dsinks[hq] += (both sinks and dsinks may be null).
template <typename T>
void attention_bwd(const AttnLayout& layout, const T* qkv, const T* sinks, const T* out,
                   const T* lse, const T* dout, T* dqkv, T* dsinks);

}  // namespace hp::cpu
