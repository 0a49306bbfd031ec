// Attention backward, FlashAttention-2 style, without atomics (deterministic):
//  1. attention_bwd_pre_kernel: D_i = rowsum(dO_i * O_i) per (token, head), and each row's share
//     of the sink gradient, -exp(s_h - lse_i) * D_i (summed per head in a fixed order after).
//  2. attention_bwd_dkdv_kernel: a block owns 64 keys of one kv head, loops over the query heads
//     of its group and the query chunks that see those keys; recomputes P^T from lse and
//     accumulates dV = P^T dO and dK = dS^T Q in registers.
//  3. attention_bwd_dq_kernel: a block owns 64 queries of one head, loops over the key tiles it
//     sees and accumulates dQ = dS K in registers.
// Both recompute S and dP; the price of determinism is one extra pair of matrix products.
#include "framework/backend/cuda/attention_common.cuh"

namespace hp {
namespace cuda {

namespace {

using namespace attn;

constexpr int kWarps = 4;
constexpr int kQ = kAttnTile;     // dq kernel: queries per block
constexpr int kN = 64;            // dq kernel: keys per tile
constexpr int kKeys = kAttnTile;  // dkdv kernel: keys per block
constexpr int kQc = 32;           // dkdv kernel: queries per chunk

// One warp per (token, head).
__global__ void attention_bwd_pre_kernel(const bf16_t* __restrict__ out,
                                         const bf16_t* __restrict__ dout,
                                         const float* __restrict__ lse, const void* sinks,
                                         int sinks_f32, int64_t rows, int hq, int d,
                                         float* __restrict__ dvec, float* __restrict__ dsink_rows) {
  const int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  float acc = 0.f;
  for (int i = lane; i < d; i += 32)
    acc += __bfloat162float(out[row * d + i]) * __bfloat162float(dout[row * d + i]);
  acc = warp_sum(acc);
  if (lane == 0) {
    dvec[row] = acc;
    if (sinks) {
      const int h = static_cast<int>(row % hq);
      const float sv = sinks_f32 ? static_cast<const float*>(sinks)[h]
                                 : __bfloat162float(static_cast<const bf16_t*>(sinks)[h]);
      dsink_rows[row] = -__expf(sv - lse[row]) * acc;
    }
  }
}

template <int D>
constexpr int dq_smem_bytes() {
  return (2 * kQ + 4 * kN) * (D + 8) * 2;  // Q, dO, two stages of K and V
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    attention_bwd_dq_kernel(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ dvec,
                            const AttnTile* __restrict__ tiles, int hq, int hkv, int window,
                            float scale, bf16_t* __restrict__ dqkv) {
  constexpr int kS = D + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t* sQ = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sdO = sQ + kQ * kS;
  auto sK = [&](int b) { return sdO + (kQ + 2 * b * kN) * kS; };
  auto sV = [&](int b) { return sdO + (kQ + (2 * b + 1) * kN) * kS; };

  const AttnTile tile = tiles[blockIdx.x];
  const int h = blockIdx.y;
  const int g = h / (hq / hkv);
  const int64_t ld = static_cast<int64_t>(hq + 2 * hkv) * D;
  const bf16_t* q_head = qkv + static_cast<int64_t>(h) * D;
  const bf16_t* k_head = qkv + static_cast<int64_t>(hq + g) * D;
  const bf16_t* v_head = qkv + static_cast<int64_t>(hq + hkv + g) * D;
  const bf16_t* do_head = dout + static_cast<int64_t>(h) * D;
  const int64_t ld_do = static_cast<int64_t>(hq) * D;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad = lane & 3, group = lane >> 2;
  const int qi0 = tile.begin + warp * 16 + group, qi1 = qi0 + 8;
  const float sl2 = scale * kLog2e;
  const float lse0 = qi0 < tile.end ? lse[static_cast<int64_t>(qi0) * hq + h] * kLog2e : 0.f;
  const float lse1 = qi1 < tile.end ? lse[static_cast<int64_t>(qi1) * hq + h] * kLog2e : 0.f;
  const float dv0 = qi0 < tile.end ? dvec[static_cast<int64_t>(qi0) * hq + h] : 0.f;
  const float dv1 = qi1 < tile.end ? dvec[static_cast<int64_t>(qi1) * hq + h] : 0.f;

  int k_lo = tile.seq_begin;
  if (window > 0 && tile.begin - window + 1 > k_lo) {
    k_lo = tile.seq_begin + ((tile.begin - window + 1 - tile.seq_begin) / kN) * kN;
  }
  const int k_hi = tile.end;

  const int n_kt = (k_hi - k_lo + kN - 1) / kN;
  load_rows_async<D, kQ>(sQ, q_head, ld, tile.begin, tile.end);
  load_rows_async<D, kQ>(sdO, do_head, ld_do, tile.begin, tile.end);
  load_rows_async<D, kN>(sK(0), k_head, ld, k_lo, k_hi);
  load_rows_async<D, kN>(sV(0), v_head, ld, k_lo, k_hi);
  cp_async_commit();

  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

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
    const bf16_t* cK = sK(buf);
    const bf16_t* cV = sV(buf);

    float s[kN / 8][4], dp[kN / 8][4];
#pragma unroll
    for (int i = 0; i < kN / 8; ++i) {
      s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
      dp[i][0] = dp[i][1] = dp[i][2] = dp[i][3] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t aq[4], ado[4];
      load_a(aq, sQ, kS, warp * 16, ks * 16, lane);
      load_a(ado, sdO, kS, warp * 16, ks * 16, lane);
#pragma unroll
      for (int nn = 0; nn < kN / 16; ++nn) {
        uint32_t b[4];
        load_b_rows_n(b, cK, kS, nn * 16, ks * 16, lane);
        mma_16816(s[2 * nn], aq, b[0], b[1]);
        mma_16816(s[2 * nn + 1], aq, b[2], b[3]);
        load_b_rows_n(b, cV, kS, nn * 16, ks * 16, lane);
        mma_16816(dp[2 * nn], ado, b[0], b[1]);
        mma_16816(dp[2 * nn + 1], ado, b[2], b[3]);
      }
    }

    // P = exp(S - lse), dS = P (dP - D). Rows past the tile end hold garbage that is never
    // written; inside the tile only the diagonal and window-edge tiles need the mask.
    const bool need_mask = kt + kN - 1 > tile.begin || (window > 0 && kt < tile.end - window);
#pragma unroll
    for (int nt = 0; nt < kN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        bool ok = true;
        if (need_mask) {
          const int key = kt + nt * 8 + quad * 2 + (e & 1);
          const int qi = e < 2 ? qi0 : qi1;
          ok = key <= qi && (window <= 0 || key > qi - window);
        }
        const float p = ok ? fast_exp2(s[nt][e] * sl2 - (e < 2 ? lse0 : lse1)) : 0.f;
        dp[nt][e] = p * (dp[nt][e] - (e < 2 ? dv0 : dv1));
      }
    }

    // dQ += dS K.
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
      a[1] = pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
      a[2] = pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      a[3] = pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t b[4];
        load_b_rows_k(b, cK, kS, kk * 16, dn * 16, lane);
        mma_16816(dq[2 * dn], a, b[0], b[1]);
        mma_16816(dq[2 * dn + 1], a, b[2], b[3]);
      }
    }
    __syncthreads();  // all warps are done with this stage before it is refilled
  }

  const int64_t ld_out = ld;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int col = nt * 8 + quad * 2;
    if (qi0 < tile.end) {
      *reinterpret_cast<__nv_bfloat162*>(dqkv + qi0 * ld_out + static_cast<int64_t>(h) * D + col) =
          __floats2bfloat162_rn(dq[nt][0] * scale, dq[nt][1] * scale);
    }
    if (qi1 < tile.end) {
      *reinterpret_cast<__nv_bfloat162*>(dqkv + qi1 * ld_out + static_cast<int64_t>(h) * D + col) =
          __floats2bfloat162_rn(dq[nt][2] * scale, dq[nt][3] * scale);
    }
  }
}

template <int D>
constexpr int dkdv_smem_bytes() {
  return (2 * kKeys + 4 * kQc) * (D + 8) * 2 + 4 * kQc * 4;  // K, V, two stages of Q, dO, lse, D
}

template <int D>
__global__ void __launch_bounds__(kWarps * 32)
    attention_bwd_dkdv_kernel(const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ dout,
                              const float* __restrict__ lse, const float* __restrict__ dvec,
                              const AttnTile* __restrict__ tiles, int hq, int hkv, int window,
                              float scale, bf16_t* __restrict__ dqkv) {
  constexpr int kS = D + 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16_t* sK = reinterpret_cast<bf16_t*>(smem_raw);
  bf16_t* sV = sK + kKeys * kS;
  bf16_t* stage0 = sV + kKeys * kS;  // stage b: Q, dO at stage0 + 2 b kQc kS, + kQc kS
  float* sStats = reinterpret_cast<float*>(stage0 + 4 * kQc * kS);  // stage b: lse, D at 2 b kQc
  auto sQ = [&](int b) { return stage0 + 2 * b * kQc * kS; };
  auto sdO = [&](int b) { return stage0 + (2 * b + 1) * kQc * kS; };

  const AttnTile tile = tiles[blockIdx.x];  // a tile of keys
  const int g = blockIdx.y;
  const int group_size = hq / hkv;
  const int64_t ld = static_cast<int64_t>(hq + 2 * hkv) * D;
  const int64_t ld_do = static_cast<int64_t>(hq) * D;
  const bf16_t* k_head = qkv + static_cast<int64_t>(hq + g) * D;
  const bf16_t* v_head = qkv + static_cast<int64_t>(hq + hkv + g) * D;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int quad = lane & 3, group = lane >> 2;
  const int kj0 = tile.begin + warp * 16 + group, kj1 = kj0 + 8;  // this thread's key rows
  const float sl2 = scale * kLog2e;

  // Queries that see these keys: [begin, end - 1 + W) within the sequence.
  const int q_lo = tile.begin;
  int q_hi = tile.seq_end;
  if (window > 0 && tile.end - 1 + window < q_hi) q_hi = tile.end - 1 + window;

  // The (query head, query chunk) pairs of this block, flattened so that chunk c + 1 loads
  // while chunk c computes.
  const int n_qc = (q_hi - q_lo + kQc - 1) / kQc;
  const int n_chunks = group_size * n_qc;
  auto issue = [&](int c, int b) {
    const int h = g * group_size + c / n_qc;
    const int qc = q_lo + (c % n_qc) * kQc;
    load_rows_async<D, kQc>(sQ(b), qkv + static_cast<int64_t>(h) * D, ld, qc, q_hi);
    load_rows_async<D, kQc>(sdO(b), dout + static_cast<int64_t>(h) * D, ld_do, qc, q_hi);
    if (threadIdx.x < kQc) {
      const int qi = qc + threadIdx.x;
      float* st = sStats + 2 * b * kQc;
      st[threadIdx.x] = qi < q_hi ? lse[static_cast<int64_t>(qi) * hq + h] * kLog2e : 0.f;
      st[kQc + threadIdx.x] = qi < q_hi ? dvec[static_cast<int64_t>(qi) * hq + h] : 0.f;
    }
  };

  load_rows_async<D, kKeys>(sK, k_head, ld, tile.begin, tile.end);
  load_rows_async<D, kKeys>(sV, v_head, ld, tile.begin, tile.end);
  issue(0, 0);
  cp_async_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
    dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
  }

  for (int c = 0; c < n_chunks; ++c) {
    const int b = c & 1;
    const int qc = q_lo + (c % n_qc) * kQc;
    if (c + 1 < n_chunks) {
      issue(c + 1, b ^ 1);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const bf16_t* cQ = sQ(b);
    const bf16_t* cdO = sdO(b);
    const float* sLse = sStats + 2 * b * kQc;
    const float* sDv = sLse + kQc;

    // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x 32 queries.
    float st[kQc / 8][4], dpt[kQc / 8][4];
#pragma unroll
    for (int i = 0; i < kQc / 8; ++i) {
      st[i][0] = st[i][1] = st[i][2] = st[i][3] = 0.f;
      dpt[i][0] = dpt[i][1] = dpt[i][2] = dpt[i][3] = 0.f;
    }
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t ak[4], av[4];
      load_a(ak, sK, kS, warp * 16, ks * 16, lane);
      load_a(av, sV, kS, warp * 16, ks * 16, lane);
#pragma unroll
      for (int nn = 0; nn < kQc / 16; ++nn) {
        uint32_t bb[4];
        load_b_rows_n(bb, cQ, kS, nn * 16, ks * 16, lane);
        mma_16816(st[2 * nn], ak, bb[0], bb[1]);
        mma_16816(st[2 * nn + 1], ak, bb[2], bb[3]);
        load_b_rows_n(bb, cdO, kS, nn * 16, ks * 16, lane);
        mma_16816(dpt[2 * nn], av, bb[0], bb[1]);
        mma_16816(dpt[2 * nn + 1], av, bb[2], bb[3]);
      }
    }

    // P^T = exp(S^T - lse), dS^T = P^T (dP^T - D). Query rows past q_hi are zero (with lse and
    // D zero), so they add nothing; key rows past the tile end are never written. Only chunks
    // on the diagonal or the window edge need the mask.
    const bool need_mask = qc < tile.end || (window > 0 && qc + kQc - 1 >= tile.begin + window);
#pragma unroll
    for (int nt = 0; nt < kQc / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int qcol = nt * 8 + quad * 2 + (e & 1);
        bool ok = true;
        if (need_mask) {
          const int qi = qc + qcol;
          const int kj = e < 2 ? kj0 : kj1;
          ok = kj <= qi && qi < q_hi && (window <= 0 || qi < kj + window);
        }
        const float p = ok ? fast_exp2(st[nt][e] * sl2 - sLse[qcol]) : 0.f;
        st[nt][e] = p;
        dpt[nt][e] = p * (dpt[nt][e] - sDv[qcol]);
      }
    }

    // dV += P^T dO, dK += dS^T Q.
#pragma unroll
    for (int kk = 0; kk < kQc / 16; ++kk) {
      uint32_t ap[4], ads[4];
      ap[0] = pack_bf16(st[2 * kk][0], st[2 * kk][1]);
      ap[1] = pack_bf16(st[2 * kk][2], st[2 * kk][3]);
      ap[2] = pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      ap[3] = pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3]);
      ads[0] = pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]);
      ads[1] = pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]);
      ads[2] = pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      ads[3] = pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
      for (int dn = 0; dn < D / 16; ++dn) {
        uint32_t bb[4];
        load_b_rows_k(bb, cdO, kS, kk * 16, dn * 16, lane);
        mma_16816(dv[2 * dn], ap, bb[0], bb[1]);
        mma_16816(dv[2 * dn + 1], ap, bb[2], bb[3]);
        load_b_rows_k(bb, cQ, kS, kk * 16, dn * 16, lane);
        mma_16816(dk[2 * dn], ads, bb[0], bb[1]);
        mma_16816(dk[2 * dn + 1], ads, bb[2], bb[3]);
      }
    }
    __syncthreads();  // all warps are done with this stage before it is refilled
  }

  bf16_t* dk_head = dqkv + static_cast<int64_t>(hq + g) * D;
  bf16_t* dv_head = dqkv + static_cast<int64_t>(hq + hkv + g) * D;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    const int col = nt * 8 + quad * 2;
    if (kj0 < tile.end) {
      *reinterpret_cast<__nv_bfloat162*>(dk_head + kj0 * ld + col) =
          __floats2bfloat162_rn(dk[nt][0] * scale, dk[nt][1] * scale);
      *reinterpret_cast<__nv_bfloat162*>(dv_head + kj0 * ld + col) =
          __floats2bfloat162_rn(dv[nt][0], dv[nt][1]);
    }
    if (kj1 < tile.end) {
      *reinterpret_cast<__nv_bfloat162*>(dk_head + kj1 * ld + col) =
          __floats2bfloat162_rn(dk[nt][2] * scale, dk[nt][3] * scale);
      *reinterpret_cast<__nv_bfloat162*>(dv_head + kj1 * ld + col) =
          __floats2bfloat162_rn(dv[nt][2], dv[nt][3]);
    }
  }
}

template <int D>
void launch_bwd_main(const AttnArgs& a, const void* dout, const float* lse, const float* dvec,
                     void* dqkv, cudaStream_t stream) {
  constexpr int smem_dq = dq_smem_bytes<D>();
  constexpr int smem_dkdv = dkdv_smem_bytes<D>();
  set_smem_limit_once(attention_bwd_dq_kernel<D>, smem_dq);
  set_smem_limit_once(attention_bwd_dkdv_kernel<D>, smem_dkdv);
  const bf16_t* qkv = static_cast<const bf16_t*>(a.qkv);
  const bf16_t* dO = static_cast<const bf16_t*>(dout);
  bf16_t* dst = static_cast<bf16_t*>(dqkv);
  attention_bwd_dkdv_kernel<D><<<dim3(a.n_tiles, a.hkv), kWarps * 32, smem_dkdv, stream>>>(
      qkv, dO, lse, dvec, a.tiles, a.hq, a.hkv, a.window, a.scale, dst);
  CUDA_CHECK_LAUNCH();
  attention_bwd_dq_kernel<D><<<dim3(a.n_tiles, a.hq), kWarps * 32, smem_dq, stream>>>(
      qkv, dO, lse, dvec, a.tiles, a.hq, a.hkv, a.window, a.scale, dst);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void launch_attention_bwd(const AttnArgs& a, const void* out, const float* lse, const void* dout,
                          void* dqkv, float* dsinks, Allocator& alloc, cudaStream_t stream) {
  if (a.n_tiles == 0) return;
  const int64_t rows = a.n_tokens * a.hq;
  Tensor dvec = Tensor::empty(alloc, {rows}, DType::kF32);
  Tensor dsink_rows;
  const bool with_sinks = a.sinks != nullptr && dsinks != nullptr;
  if (with_sinks) dsink_rows = Tensor::empty(alloc, {rows}, DType::kF32);
  attention_bwd_pre_kernel<<<grid_for(rows, 8, 1ll << 30), 256, 0, stream>>>(
      static_cast<const bf16_t*>(out), static_cast<const bf16_t*>(dout), lse,
      with_sinks ? a.sinks : nullptr, a.sinks_t == DType::kF32 ? 1 : 0, rows, a.hq, a.head_dim,
      dvec.data<float>(), with_sinks ? dsink_rows.data<float>() : nullptr);
  CUDA_CHECK_LAUNCH();
  if (with_sinks) {
    launch_column_sum_add(dsink_rows.data<float>(), a.n_tokens, a.hq, 1.f, dsinks, alloc, stream);
  }
  switch (a.force_simple ? 0 : a.head_dim) {
    case 64:
      launch_bwd_main<64>(a, dout, lse, dvec.data<float>(), dqkv, stream);
      break;
    case 128:
      launch_bwd_main<128>(a, dout, lse, dvec.data<float>(), dqkv, stream);
      break;
    default:
      launch_attention_simple_bwd(a, dout, lse, dvec.data<float>(), dqkv, stream);
      break;
  }
}

}  // namespace cuda
}  // namespace hp
