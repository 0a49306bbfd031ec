// Attention forward, FlashAttention-2 style: a block owns 64 queries of one sequence and one head
// (4 warps x 16 rows), streams the key/value tiles of that sequence that the causal mask and the
// sliding window leave (double-buffered cp.async), computes S = QK^T and O += PV on tensor cores
// and keeps the softmax online in f32. The score matrix never leaves registers.
#include "framework/backend/cuda/attention_common.cuh"

namespace hp {
namespace cuda {

namespace {

using namespace attn;

constexpr int kM = kAttnTile;  // queries per block
constexpr int kN = 64;         // keys per tile
constexpr int kWarps = 4;

template <int D>
constexpr int fwd_smem_bytes() {
  return (kM + 4 * kN) * (D + 8) * 2;
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    attention_fwd_kernel(const bf16_t* __restrict__ qkv, const void* sinks, int sinks_f32,
                         const AttnTile* __restrict__ tiles, int hq, int hkv, int window,
                         float scale, bf16_t* __restrict__ out, float* __restrict__ lse) {
  constexpr int kS = D + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_raw);
  // Then K and V of two stages: stage b at sQ + (kM + 2 b kN) kS (K) and + kN kS (V).
  auto sK = [&](int b) { return sQ + (kM + 2 * b * kN) * kS; };
  auto sV = [&](int b) { return sQ + (kM + (2 * b + 1) * kN) * kS; };

  const AttnTile tile = tiles[blockIdx.x];
  const int h = blockIdx.y;
  const int g = h / (hq / hkv);
  const int64_t ld = static_cast<int64_t>(hq + 2 * hkv) * D;
  const bf16_t* q_head = qkv + static_cast<int64_t>(h) * D;
  const bf16_t* k_head = qkv + static_cast<int64_t>(hq + g) * D;
  const bf16_t* v_head = qkv + static_cast<int64_t>(hq + hkv + g) * D;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad = lane & 3, group = lane >> 2;
  const int qi0 = tile.begin + warp * 16 + group;  // this thread's rows: qi0 and qi0 + 8
  const int qi1 = qi0 + 8;

  // Key tiles: aligned to the sequence start, from the first one the window reaches to the
  // diagonal.
  int k_lo = tile.seq_begin;
  if (window > 0 && tile.begin - window + 1 > k_lo) {
    k_lo = tile.seq_begin + ((tile.begin - window + 1 - tile.seq_begin) / kN) * kN;
  }
  const int k_hi = tile.end;
  const int n_kt = (k_hi - k_lo + kN - 1) / kN;

  load_rows_async<D, kM>(sQ, q_head, ld, tile.begin, tile.end);
  load_rows_async<D, kN>(sK(0), k_head, ld, k_lo, k_hi);
  load_rows_async<D, kN>(sV(0), v_head, ld, k_lo, k_hi);
  cp_async_commit();

  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  const float sl2 = scale * kLog2e;

  for (int it = 0; it < n_kt; ++it) {
    const int kt = k_lo + it * kN;
    const int buf = it & 1;
    if (it + 1 < n_kt) {
      load_rows_async<D, kN>(sK(buf ^ 1), k_head, ld, kt + kN, k_hi);
      load_rows_async<D, kN>(sV(buf ^ 1), v_head, ld, kt + kN, k_hi);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    // S = Q K^T for this warp's 16 rows x 64 keys.
    float s[kN / 8][4];
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t a[4];
      load_a(a, sQ, kS, warp * 16, ks * 16, lane);
#pragma unroll
      for (int nn = 0; nn < kN / 16; ++nn) {
        uint32_t b[4];
        load_b_rows_n(b, sK(buf), kS, nn * 16, ks * 16, lane);
        mma_16816(s[2 * nn], a, b[0], b[1]);
        mma_16816(s[2 * nn + 1], a, b[2], b[3]);
      }
    }

    // Scale to log2 units and mask: causal (key <= query), window (key > query - W).
    const bool need_mask = kt + kN - 1 > tile.begin || (window > 0 && kt < tile.end - window);
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float v = s[nt][e] * sl2;
        if (need_mask) {
          const int key = kt + nt * 8 + quad * 2 + (e & 1);
          const int qi = e < 2 ? qi0 : qi1;
          const bool ok = key <= qi && key < k_hi && (window <= 0 || key > qi - window);
          v = ok ? v : -INFINITY;
        }
        s[nt][e] = v;
      }
      mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
      mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == -INFINITY ? 0.f : mn0, mu1 = mn1 == -INFINITY ? 0.f : mn1;
    const float alpha0 = fast_exp2(m0 - mu0), alpha1 = fast_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    float rs0 = 0.f, rs1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) {
      s[nt][0] = fast_exp2(s[nt][0] - mu0);
      s[nt][1] = fast_exp2(s[nt][1] - mu0);
      s[nt][2] = fast_exp2(s[nt][2] - mu1);
      s[nt][3] = fast_exp2(s[nt][3] - mu1);
      rs0 += s[nt][0] + s[nt][1];
      rs1 += s[nt][2] + s[nt][3];
    }
    l0 = l0 * alpha0 + rs0;
    l1 = l1 * alpha1 + rs1;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][0] *= alpha0;
      o[i][1] *= alpha0;
      o[i][2] *= alpha1;
      o[i][3] *= alpha1;
    }

    // O += P V.
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
      a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
      a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t b[4];
        load_b_rows_k(b, sV(buf), kS, kk * 16, dn * 16, lane);
        mma_16816(o[2 * dn], a, b[0], b[1]);
        mma_16816(o[2 * dn + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // all warps are done with this buffer before it is refilled
  }

  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);

  // Fold the sink into the denominator: sum = l * 2^m + 2^(sink * log2e).
  float f0, f1, lse0, lse1;
  {
    float sink2 = -INFINITY;
    if (sinks) {
      const float sv = sinks_f32 ? static_cast<const float*>(sinks)[h]
                                 : __bfloat162float(static_cast<const bf16_t*>(sinks)[h]);
      sink2 = sv * kLog2e;
    }
    const float M0 = fmaxf(m0, sink2), M1 = fmaxf(m1, sink2);
    const float d0 = l0 * exp2f(m0 - M0) + exp2f(sink2 - M0);
    const float d1 = l1 * exp2f(m1 - M1) + exp2f(sink2 - M1);
    f0 = exp2f(m0 - M0) / d0;
    f1 = exp2f(m1 - M1) / d1;
    lse0 = (M0 + __log2f(d0)) * kLn2;
    lse1 = (M1 + __log2f(d1)) * kLn2;
  }

#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int col = nt * 8 + quad * 2;
    if (qi0 < tile.end) {
      *reinterpret_cast<__nv_bfloat162*>(out + (static_cast<int64_t>(qi0) * hq + h) * D + col) =
          __floats2bfloat162_rn(o[nt][0] * f0, o[nt][1] * f0);
    }
    if (qi1 < tile.end) {
      *reinterpret_cast<__nv_bfloat162*>(out + (static_cast<int64_t>(qi1) * hq + h) * D + col) =
          __floats2bfloat162_rn(o[nt][2] * f1, o[nt][3] * f1);
    }
  }
  if (quad == 0) {
    if (qi0 < tile.end) lse[static_cast<int64_t>(qi0) * hq + h] = lse0;
    if (qi1 < tile.end) lse[static_cast<int64_t>(qi1) * hq + h] = lse1;
  }
}

template <int D>
void launch_fwd(const AttnArgs& a, void* out, float* lse, cudaStream_t stream) {
  constexpr int smem = fwd_smem_bytes<D>();
  set_smem_limit_once(attention_fwd_kernel<D>, smem);
  dim3 grid(static_cast<unsigned>(a.n_tiles), static_cast<unsigned>(a.hq));
  attention_fwd_kernel<D><<<grid, kWarps * 32, smem, stream>>>(
      static_cast<const bf16_t*>(a.qkv), a.sinks, a.sinks_t == DType::kF32 ? 1 : 0, a.tiles, a.hq,
      a.hkv, a.window, a.scale, static_cast<bf16_t*>(out), lse);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool attention_head_dim_fast(int head_dim) { return head_dim == 64 || head_dim == 128; }

void launch_attention_fwd(const AttnArgs& a, void* out, float* lse, cudaStream_t stream) {
  if (a.n_tiles == 0) return;
  switch (a.force_simple ? 0 : a.head_dim) {
    case 64:
      launch_fwd<64>(a, out, lse, stream);
      break;
    case 128:
      launch_fwd<128>(a, out, lse, stream);
      break;
    default:
      launch_attention_simple_fwd(a, out, lse, stream);
      break;
  }
}

}  // namespace cuda
}  // namespace hp
