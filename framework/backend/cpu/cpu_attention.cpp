// Packed varlen attention on the CPU: causal within each sequence, optional sliding window, sinks
// and GQA.
//
// Work is split into independent tasks: one per (sequence, q head) in the forward, one per
// (sequence, kv head) in the backward (see there). Inside a task, queries go in blocks
// of kBlockRows; a block sees one contiguous key range, so scores, probabilities and their
// gradients are small dense tiles (block rows x keys, never N x N) multiplied by a register-tiled
// kernel over K/V copies packed contiguously for the sequence. Every sum runs in a fixed order.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "framework/backend/cpu/cpu_kernels.h"

namespace hp::cpu {
namespace {

constexpr int64_t kBlockRows = 16;         // queries per block
constexpr int64_t kParallelMin = 1 << 14;  // fewer qkv elements than this: one thread
constexpr int kTileRows = 4;               // register tile of tile_gemm: rows ...

template <typename T>
constexpr int tile_cols() {  // ... and columns: two 16-byte vectors
  return static_cast<int>(32 / sizeof(T));
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 16-byte vectors of the compiler's vector extension: plain SIMD arithmetic without intrinsics.
template <typename T>
struct Vec16;
template <>
struct Vec16<float> {
  typedef float Type __attribute__((vector_size(16)));
};
template <>
struct Vec16<double> {
  typedef double Type __attribute__((vector_size(16)));
};

// Rows r0 .. r0+kRows-1 of tile_gemm. The accumulators are explicit 16-byte vectors (two per
// row), so they stay in registers and every column step is one vector multiply-add.
template <typename T, int kRows>
void tile_gemm_rows(int64_t r0, int64_t n, int64_t k, const T* a, int64_t lda, const T* b,
                    int64_t ldb, T* c, int64_t ldc, bool accumulate) {
  using Vec = typename Vec16<T>::Type;
  constexpr int kLanes = static_cast<int>(16 / sizeof(T));
  constexpr int kCols = tile_cols<T>();
  static_assert(kCols == 2 * kLanes, "a register tile row is two vectors");
  for (int64_t c0 = 0; c0 < n; c0 += kCols) {
    Vec acc0[kRows], acc1[kRows];
    for (int r = 0; r < kRows; ++r) acc0[r] = acc1[r] = Vec{};
    for (int64_t kk = 0; kk < k; ++kk) {
      Vec b0, b1;
      std::memcpy(&b0, b + kk * ldb + c0, sizeof(Vec));
      std::memcpy(&b1, b + kk * ldb + c0 + kLanes, sizeof(Vec));
      for (int r = 0; r < kRows; ++r) {
        const Vec av = Vec{} + a[(r0 + r) * lda + kk];
        acc0[r] += av * b0;
        acc1[r] += av * b1;
      }
    }
    const int cols = static_cast<int>(std::min<int64_t>(kCols, n - c0));
    for (int r = 0; r < kRows; ++r) {
      T tile[kCols];
      std::memcpy(tile, &acc0[r], sizeof(Vec));
      std::memcpy(tile + kLanes, &acc1[r], sizeof(Vec));
      T* cr = c + (r0 + r) * ldc + c0;
      if (accumulate) {
        for (int w = 0; w < cols; ++w) cr[w] += tile[w];
      } else {
        for (int w = 0; w < cols; ++w) cr[w] = tile[w];
      }
    }
  }
}

// c[m x n] = (or +=) a[m x k] . b[k x n], row-major with leading dimensions. Each row of b must
// be readable up to column round_up(n, tile_cols) - 1 (callers pad their packed copies with
// zeros); the extra columns are computed and dropped.
template <typename T>
void tile_gemm(int64_t m, int64_t n, int64_t k, const T* a, int64_t lda, const T* b, int64_t ldb,
               T* c, int64_t ldc, bool accumulate) {
  int64_t r0 = 0;
  for (; r0 + kTileRows <= m; r0 += kTileRows) {
    tile_gemm_rows<T, kTileRows>(r0, n, k, a, lda, b, ldb, c, ldc, accumulate);
  }
  for (; r0 < m; ++r0) tile_gemm_rows<T, 1>(r0, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

// Contiguous, zero-padded copies of one kv head's keys and values over one sequence.
template <typename T>
struct PackedKv {
  int64_t len = 0;      // sequence length L
  int64_t len_pad = 0;  // padded row length of the transposed copies
  int64_t d_pad = 0;    // padded row length of the row-major copies
  std::vector<T> kt;    // [d][len_pad]: keys transposed
  std::vector<T> vt;    // [d][len_pad]: values transposed (backward only)
  std::vector<T> k;     // [len][d_pad]: keys (backward only)
  std::vector<T> v;     // [len][d_pad]: values (forward only)

  void pack(const T* qkv, int64_t row, int64_t begin, int64_t len_, int d, int64_t k_col,
            int64_t v_col, bool backward) {
    len = len_;
    len_pad = len + tile_cols<T>();
    d_pad = round_up(d, tile_cols<T>());
    kt.assign(static_cast<size_t>(d * len_pad), T(0));
    if (backward) {
      vt.assign(static_cast<size_t>(d * len_pad), T(0));
      k.assign(static_cast<size_t>(len * d_pad), T(0));
    } else {
      v.assign(static_cast<size_t>(len * d_pad), T(0));
    }
    for (int64_t j = 0; j < len; ++j) {
      const T* kr = qkv + (begin + j) * row + k_col;
      const T* vr = qkv + (begin + j) * row + v_col;
      for (int c = 0; c < d; ++c) kt[c * len_pad + j] = kr[c];
      if (backward) {
        for (int c = 0; c < d; ++c) vt[c * len_pad + j] = vr[c];
        std::memcpy(&k[j * d_pad], kr, static_cast<size_t>(d) * sizeof(T));
      } else {
        std::memcpy(&v[j * d_pad], vr, static_cast<size_t>(d) * sizeof(T));
      }
    }
  }
};

}  // namespace

template <typename T>
void attention_fwd(const AttnLayout& layout, const T* qkv, const T* sinks, T* out, T* lse) {
  const int64_t row = layout.row();
  const int hq = layout.hq;
  const int d = layout.d;
  const int group = layout.hq / layout.hkv;
  const T scale = static_cast<T>(layout.scale);
  const int64_t n_tasks = layout.n_seqs * hq;

#pragma omp parallel if (layout.n_tokens * row >= kParallelMin)
  {
    PackedKv<T> kv;
    std::vector<T> s;  // [kBlockRows][len]: scores, then probabilities
    std::vector<T> o;  // [kBlockRows][d_pad]
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_tasks; ++task) {
      const int64_t seq = task / hq;
      const int h = static_cast<int>(task % hq);
      const int64_t begin = layout.cu_seqlens[seq];
      const int64_t len = layout.cu_seqlens[seq + 1] - begin;
      if (len == 0) continue;
      kv.pack(qkv, row, begin, len, d, static_cast<int64_t>(hq + h / group) * d,
              static_cast<int64_t>(hq + layout.hkv + h / group) * d, false);
      s.resize(static_cast<size_t>(kBlockRows * len));
      o.resize(static_cast<size_t>(kBlockRows * kv.d_pad));

      for (int64_t i0 = 0; i0 < len; i0 += kBlockRows) {
        const int64_t rows = std::min(kBlockRows, len - i0);
        const int64_t lo = layout.first_key(begin + i0, begin) - begin;  // block's first key
        const int64_t nk = i0 + rows - lo;                               // keys lo .. i0+rows-1
        tile_gemm(rows, nk, d, qkv + (begin + i0) * row + static_cast<int64_t>(h) * d, row,
                  kv.kt.data() + lo, kv.len_pad, s.data(), len, false);
        T inv[kBlockRows];
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = begin + i0 + r;
          const int64_t j0 = layout.first_key(i, begin) - begin - lo;
          const int64_t j1 = i0 + r - lo;  // inclusive
          T* sr = s.data() + r * len;
          T mx = sinks ? sinks[h] : -std::numeric_limits<T>::infinity();
          for (int64_t j = j0; j <= j1; ++j) {
            sr[j] *= scale;
            mx = std::max(mx, sr[j]);
          }
          double denom = sinks ? std::exp(static_cast<double>(sinks[h] - mx)) : 0.0;
          std::fill(sr, sr + j0, T(0));
          for (int64_t j = j0; j <= j1; ++j) {
            sr[j] = std::exp(sr[j] - mx);
            denom += sr[j];
          }
          std::fill(sr + j1 + 1, sr + nk, T(0));
          inv[r] = static_cast<T>(1.0 / denom);
          lse[i * hq + h] = mx + static_cast<T>(std::log(denom));
        }
        tile_gemm(rows, d, nk, s.data(), len, kv.v.data() + lo * kv.d_pad, kv.d_pad, o.data(),
                  kv.d_pad, false);
        for (int64_t r = 0; r < rows; ++r) {
          T* orow = out + ((begin + i0 + r) * hq + h) * d;
          for (int c = 0; c < d; ++c) orow[c] = o[r * kv.d_pad + c] * inv[r];
        }
      }
    }
  }
}

// For query i, key j: p = exp(z - lse_i), dp = dout_i . v_j, dz = p (dp - D_i) with
// D_i = dout_i . out_i; dq_i += scale dz k_j, dk_j += scale dz q_i, dv_j += p dout_i. The sink's
// logit has no value row, so its gradient is sum_i p_sink(i) (0 - D_i).
//
// One task per (sequence, kv head): the q heads of its GQA group run inside the task in order, so
// the dk/dv rows a task accumulates belong to it alone (no atomics), and the result does not
// depend on the thread count.
template <typename T>
void attention_bwd(const AttnLayout& layout, const T* qkv, const T* sinks, const T* out,
                   const T* lse, const T* dout, T* dqkv, T* dsinks) {
  const int64_t row = layout.row();
  const int hq = layout.hq;
  const int hkv = layout.hkv;
  const int d = layout.d;
  const int group = hq / hkv;
  const T scale = static_cast<T>(layout.scale);
  const int64_t n_tasks = layout.n_seqs * hkv;
  const bool with_sinks = sinks != nullptr && dsinks != nullptr;
  // Per (sequence, q head) partial sink gradients, summed in sequence order at the end.
  std::vector<double> sink_part(with_sinks ? static_cast<size_t>(layout.n_seqs * hq) : 0);

  std::memset(dqkv, 0, static_cast<size_t>(layout.n_tokens * row) * sizeof(T));

#pragma omp parallel if (layout.n_tokens * row >= kParallelMin)
  {
    PackedKv<T> kv;
    std::vector<T> p, dp, pt, dst;  // [rows][len] tiles and [len][rows] transposes
    std::vector<T> qb, dob, dq;     // [rows][d_pad]: packed q and dout blocks, dq of the block
    std::vector<T> dk, dv;          // [len][d_pad]: accumulated over the group's heads
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < n_tasks; ++task) {
      const int64_t seq = task / hkv;
      const int g = static_cast<int>(task % hkv);
      const int64_t begin = layout.cu_seqlens[seq];
      const int64_t len = layout.cu_seqlens[seq + 1] - begin;
      if (len == 0) continue;
      const int64_t k_col = static_cast<int64_t>(hq + g) * d;
      const int64_t v_col = static_cast<int64_t>(hq + hkv + g) * d;
      kv.pack(qkv, row, begin, len, d, k_col, v_col, true);
      const int64_t dpad = kv.d_pad;
      p.resize(static_cast<size_t>(kBlockRows * len));
      dp.resize(static_cast<size_t>(kBlockRows * len));
      pt.resize(static_cast<size_t>(len * kBlockRows));
      dst.resize(static_cast<size_t>(len * kBlockRows));
      qb.assign(static_cast<size_t>(kBlockRows * dpad), T(0));
      dob.assign(static_cast<size_t>(kBlockRows * dpad), T(0));
      dq.resize(static_cast<size_t>(kBlockRows * dpad));
      dk.assign(static_cast<size_t>(len * dpad), T(0));
      dv.assign(static_cast<size_t>(len * dpad), T(0));

      for (int h = g * group; h < (g + 1) * group; ++h) {
        double sink_acc = 0;
        for (int64_t i0 = 0; i0 < len; i0 += kBlockRows) {
          const int64_t rows = std::min(kBlockRows, len - i0);
          const int64_t lo = layout.first_key(begin + i0, begin) - begin;
          const int64_t nk = i0 + rows - lo;
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = begin + i0 + r;
            std::memcpy(&qb[r * dpad], qkv + i * row + static_cast<int64_t>(h) * d,
                        static_cast<size_t>(d) * sizeof(T));
            std::memcpy(&dob[r * dpad], dout + (i * hq + h) * d,
                        static_cast<size_t>(d) * sizeof(T));
          }
          tile_gemm(rows, nk, d, qb.data(), dpad, kv.kt.data() + lo, kv.len_pad, p.data(), len,
                    false);
          tile_gemm(rows, nk, d, dob.data(), dpad, kv.vt.data() + lo, kv.len_pad, dp.data(), len,
                    false);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = begin + i0 + r;
            const int64_t j0 = layout.first_key(i, begin) - begin - lo;
            const int64_t j1 = i0 + r - lo;  // inclusive
            const T lse_i = lse[i * hq + h];
            const T delta = dot(dout + (i * hq + h) * d, out + (i * hq + h) * d, d);
            T* pr = p.data() + r * len;
            T* dpr = dp.data() + r * len;
            for (int64_t j = 0; j < nk; ++j) {
              T pj = 0, dz = 0;
              if (j >= j0 && j <= j1) {
                pj = std::exp(scale * pr[j] - lse_i);
                dz = scale * pj * (dpr[j] - delta);
              }
              pr[j] = pj;
              dpr[j] = dz;
              pt[j * kBlockRows + r] = pj;
              dst[j * kBlockRows + r] = dz;
            }
            if (with_sinks) sink_acc -= std::exp(static_cast<double>(sinks[h] - lse_i)) * delta;
          }
          // dq = dz . k, dk += dz^T . q, dv += p^T . dout (dz already carries the scale).
          tile_gemm(rows, d, nk, dp.data(), len, kv.k.data() + lo * dpad, dpad, dq.data(), dpad,
                    false);
          for (int64_t r = 0; r < rows; ++r) {
            std::memcpy(dqkv + (begin + i0 + r) * row + static_cast<int64_t>(h) * d, &dq[r * dpad],
                        static_cast<size_t>(d) * sizeof(T));
          }
          tile_gemm(nk, d, rows, dst.data(), kBlockRows, qb.data(), dpad, dk.data() + lo * dpad,
                    dpad, true);
          tile_gemm(nk, d, rows, pt.data(), kBlockRows, dob.data(), dpad, dv.data() + lo * dpad,
                    dpad, true);
        }
        if (with_sinks) sink_part[static_cast<size_t>(seq * hq + h)] = sink_acc;
      }
      for (int64_t j = 0; j < len; ++j) {
        std::memcpy(dqkv + (begin + j) * row + k_col, &dk[j * dpad],
                    static_cast<size_t>(d) * sizeof(T));
        std::memcpy(dqkv + (begin + j) * row + v_col, &dv[j * dpad],
                    static_cast<size_t>(d) * sizeof(T));
      }
    }
  }

  if (with_sinks) {
    for (int h = 0; h < hq; ++h) {
      double s = 0;
      for (int64_t seq = 0; seq < layout.n_seqs; ++seq) s += sink_part[seq * hq + h];
      dsinks[h] += static_cast<T>(s);
    }
  }
}

template void attention_fwd<float>(const AttnLayout&, const float*, const float*, float*, float*);
template void attention_fwd<double>(const AttnLayout&, const double*, const double*, double*,
                                    double*);
template void attention_bwd<float>(const AttnLayout&, const float*, const float*, const float*,
                                   const float*, const float*, float*, float*);
template void attention_bwd<double>(const AttnLayout&, const double*, const double*, const double*,
                                    const double*, const double*, double*, double*);

}  // namespace hp::cpu
