// Host-side launchers of the CUDA backend's kernels. Each enqueues its work on `stream` and
// returns without waiting. Pointers are device pointers; `DType` arguments pick the element type
// of untyped (void*) arguments: kBF16 or kF32 unless noted. Launchers that need scratch memory
// take it from `alloc`; it goes back to the cache when the launcher returns, which is safe for
// work ordered on the same stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "framework/core/dtype.h"
#include "framework/core/tensor.h"

namespace hp {
namespace cuda {

// ---- elementwise.cu ----------------------------------------------------------------------------
// Any dtype (integers too).
void launch_fill(void* p, DType t, int64_t n, double value, cudaStream_t stream);
void launch_convert(const void* src, DType src_t, void* dst, DType dst_t, int64_t n,
                    cudaStream_t stream);
// p[i] = std * philox_normal(key, offset + i), t: kF32 or kF64 (Backend::fill_normal).
void launch_fill_normal(void* p, DType t, int64_t n, uint64_t key, int64_t offset, double std,
                        cudaStream_t stream);
void launch_add(const void* a, const void* b, void* out, DType t, int64_t n, cudaStream_t stream);
void launch_axpy(double alpha, const void* x, DType x_t, void* y, DType y_t, int64_t n,
                 cudaStream_t stream);
void launch_add_bias(void* y, DType y_t, const void* bias, DType bias_t, int64_t rows, int64_t cols,
                     cudaStream_t stream);
// out[0..n) = host_ptrs[0..n) (n <= kMaxStoredPointers), stream-ordered: the pointers travel in
// the kernel's parameters, so the host array may be reused as soon as the call returns.
constexpr int kMaxStoredPointers = 480;
void launch_store_pointers(const void* const* host_ptrs, int n, void** out, cudaStream_t stream);
// kind: 0 SwiGLU, 1 GPT-OSS. h[rows, 2f], a[rows, f], all of dtype t.
void launch_glu_fwd(const void* h, void* a, DType t, int64_t rows, int64_t f, int kind, float alpha,
                    float limit, cudaStream_t stream);
void launch_glu_bwd(const void* h, const void* da, void* dh, DType t, int64_t rows, int64_t f,
                    int kind, float alpha, float limit, cudaStream_t stream);

// ---- reduce.cu (deterministic: fixed partition, fixed order) -----------------------------------
// db[c] += sum_r dy[r, c].
void launch_bias_grad(const void* dy, DType t, int64_t rows, int64_t cols, float* db,
                      Allocator& alloc, cudaStream_t stream);
// For each segment: out[c] += sum over rows [begin, begin + rows) of dy[r, c], bitwise as
// launch_bias_grad over those rows alone, one after another in the given order; two launches for
// up to 32 segments with distinct outputs.
struct RowSegmentRef {
  int64_t begin, rows;
  float* out;
};
void launch_bias_grad_segments(const void* dy, DType t, int64_t cols,
                               const std::vector<RowSegmentRef>& segments, Allocator& alloc,
                               cudaStream_t stream);
// acc[0] += sum x^2.
void launch_sum_squares(const void* x, DType t, int64_t n, float* acc, Allocator& alloc,
                        cudaStream_t stream);
// acc[0] += the sum of x^2 over every element of every x (each of dtype t, f32 or bf16): per
// block partials over a fixed partition of the list (chunks of 16384 elements, each thread's
// elements in a fixed order whatever the alignment), then one block sums them in a fixed order:
// the same bits for the same list of values, in 1 + one launch per 128 tensors.
struct SumSquaresRef {
  const void* x;  // null: n zeros, not read (the bits of n zeros)
  DType t;
  int64_t n;
};
void launch_sum_squares_many(const std::vector<SumSquaresRef>& xs, float* acc, Allocator& alloc,
                             cudaStream_t stream);
// acc[0] += scale * sum x.
void launch_reduce_sum_add(const float* x, int64_t n, float scale, float* acc, Allocator& alloc,
                           cudaStream_t stream);
// out[c] += scale * sum_r x[r, c] for an f32 matrix x[rows, cols].
void launch_column_sum_add(const float* x, int64_t rows, int64_t cols, float scale, float* out,
                           Allocator& alloc, cudaStream_t stream);

// ---- norm_rope.cu ------------------------------------------------------------------------------
// x, y, dy, dx have dtype t; w has dtype w_t; rstd and dw are f32. add_dx: dx += the gradient
// (added in f32, rounded once).
void launch_rmsnorm_fwd(const void* x, DType t, const void* w, DType w_t, float eps, void* y,
                        float* rstd, int64_t rows, int64_t d, cudaStream_t stream);
// The backward adds the weight gradient's column sums to dw. Rows of 32 V 16-byte vectors (V from
// 1 to 8) take one kernel that forms them as it computes dx, then a finishing sum; fold_dw = false
// (for tests: dx has the same bits either way) takes the separate column-sum pass instead.
void launch_rmsnorm_bwd(const void* x, DType t, const void* w, DType w_t, const float* rstd,
                        const void* dy, void* dx, float* dw, int64_t rows, int64_t d, bool add_dx,
                        Allocator& alloc, cudaStream_t stream, bool fold_dw = true);
// Per-head RMSNorm of the first hq_norm + hkv_norm heads of x[n, h, d] (q heads use qw, the next
// hkv_norm heads kw); the remaining heads are copied. rstd[n, hq_norm + hkv_norm] f32.
void launch_qk_norm_fwd(const void* x, DType t, const void* qw, const void* kw, DType w_t,
                        int64_t n, int h, int hq_norm, int hkv_norm, int d, float eps, void* out,
                        float* rstd, cudaStream_t stream);
// din written (copied heads: dout copied); dqw, dkw (f32) +=.
void launch_qk_norm_bwd(const void* x, DType t, const void* qw, const void* kw, DType w_t,
                        int64_t n, int h, int hq_norm, int hkv_norm, int d, const float* rstd,
                        const void* dout, void* din, float* dqw, float* dkw, Allocator& alloc,
                        cudaStream_t stream);
// launch_qk_norm_fwd, then launch_rope of out's first hq_norm + hkv_norm heads (forward), in
// one pass with the same bits. false, with nothing launched, where the heads are not 16-byte
// rows of 2 to 32 vectors (a power of two) at 16-byte aligned x, out and tables: then the two
// launches are the caller's.
bool launch_qk_norm_rope_fwd(const void* x, DType t, const void* qw, const void* kw, DType w_t,
                             int64_t n, int h, int hq_norm, int hkv_norm, int d, float eps,
                             const int32_t* positions, const float* cos_table,
                             const float* sin_table, int64_t max_pos, void* out, float* rstd,
                             cudaStream_t stream);
// x[n_tokens, n_heads, head_dim] in place, first n_rot_heads heads; tables [max_pos, head_dim/2].
void launch_rope(void* x, DType t, int64_t n_tokens, int n_heads, int n_rot_heads, int head_dim,
                 const int32_t* positions, const float* cos_table, const float* sin_table,
                 int64_t max_pos, bool inverse, cudaStream_t stream);

// ---- attention ---------------------------------------------------------------------------------
// Queries (and keys) are cut into tiles of kAttnTile tokens that never cross a sequence; the
// tile map lists them, built on the host by upload_batch or on the device by rebuild_metadata.
constexpr int kAttnTile = 64;
struct AttnTile {
  int32_t begin;      // first token of the tile
  int32_t end;        // one past its last token (<= begin + kAttnTile)
  int32_t seq_begin;  // the tile's sequence
  int32_t seq_end;
};

struct AttnArgs {
  const void* qkv = nullptr;    // bf16 [n_tokens, hq + 2 hkv, head_dim]
  const void* sinks = nullptr;  // [hq] of sinks_t, or null
  DType sinks_t = DType::kBF16;
  const AttnTile* tiles = nullptr;
  int n_tiles = 0;
  int64_t n_tokens = 0;
  int hq = 0, hkv = 0, head_dim = 0, window = 0;
  float scale = 0;
  bool force_simple = false;  // use the simple kernels even where a tensor-core one exists
};
// out bf16 [n_tokens, hq, head_dim]; lse f32 [n_tokens, hq].
void launch_attention_fwd(const AttnArgs& a, void* out, float* lse, cudaStream_t stream);
// dqkv bf16 written; dsinks f32 [hq] += (when sinks and dsinks are set).
void launch_attention_bwd(const AttnArgs& a, const void* out, const float* lse, const void* dout,
                          void* dqkv, float* dsinks, Allocator& alloc, cudaStream_t stream);
bool attention_head_dim_fast(int head_dim);  // tensor-core path (else the simple kernels)
// The simple kernels (any head_dim <= 256), also a cross-check of the tensor-core path. dvec is
// D_i = rowsum(dO * O) [n_tokens, hq]; sinks are left to launch_attention_bwd.
void launch_attention_simple_fwd(const AttnArgs& a, void* out, float* lse, cudaStream_t stream);
void launch_attention_simple_bwd(const AttnArgs& a, const void* dout, const float* lse,
                                 const float* dvec, void* dqkv, cudaStream_t stream);

// ---- metadata.cu -------------------------------------------------------------------------------
// From positions[n] (a sequence starts where the position is 0 or does not continue the previous
// one): cu_seqlens[0..n_seqs], tiles[0..n_tiles) and info = {n_seqs, max_seqlen, n_tiles}, all on
// the device. cu_seqlens has room for n+1 entries and tiles for n.
void launch_rebuild_metadata(const int32_t* positions, int64_t n, int32_t* cu_seqlens,
                             AttnTile* tiles, int32_t* info, Allocator& alloc, cudaStream_t stream);

// ---- routing.cu --------------------------------------------------------------------------------
void launch_router_topk(const void* logits, DType t, int64_t n, int e, int k, int32_t* idx, void* w,
                        DType w_t, cudaStream_t stream);
// w and dw have dtype w_t; dlogits has dtype t.
void launch_router_topk_bwd(const int32_t* idx, const void* w, const void* dw, DType w_t, int64_t n,
                            int e, int k, void* dlogits, DType t, cudaStream_t stream);
void launch_router_aux_loss(const void* logits, DType t, const int32_t* counts, int64_t n, int e,
                            int k, float coef, float* loss, void* dlogits, Allocator& alloc,
                            cudaStream_t stream);
void launch_histogram(const int32_t* ids, int64_t m, int n_bins, int32_t* counts,
                      cudaStream_t stream);
void launch_exclusive_scan(const int32_t* counts, int64_t n, int32_t* offsets, Allocator& alloc,
                           cudaStream_t stream);
void launch_sort_by_id(const int32_t* ids, int64_t m, int n_bins, int32_t* sorted_to_assign,
                       int32_t* assign_to_sorted, Allocator& alloc, cudaStream_t stream);
void launch_permute_rows(const void* x, DType t, int64_t d, const int32_t* sorted_to_assign,
                         int64_t m, int k, void* out, cudaStream_t stream);
void launch_permute_rows_bwd(const void* dout, DType t, int64_t d, const int32_t* sorted_to_assign,
                             int64_t m, int k, int64_t n, void* dx, Allocator& alloc,
                             cudaStream_t stream);
void launch_unpermute_combine(const void* y, DType t, int64_t d, const int32_t* assign_to_sorted,
                              int64_t m, const void* w, DType w_t, int64_t n, int k, void* out,
                              cudaStream_t stream);
void launch_unpermute_combine_bwd(const void* dout, const void* y, DType t, int64_t d,
                                  const int32_t* assign_to_sorted, int64_t m, const void* w,
                                  DType w_t, int64_t n, int k, void* dy, void* dw,
                                  cudaStream_t stream);

// ---- embedding_loss.cu -------------------------------------------------------------------------
void launch_embedding_fwd(const void* table, DType table_t, int64_t v, const int32_t* ids,
                          int64_t n, int64_t d, void* out, DType out_t, cudaStream_t stream);
void launch_embedding_bwd(const void* dout, DType t, const int32_t* ids, int64_t n, int64_t d,
                          int64_t v, float* dtable, Allocator& alloc, cudaStream_t stream);
void launch_cross_entropy(void* logits, DType t, const int32_t* targets, int64_t n, int64_t v,
                          float grad_scale, float* loss, Allocator& alloc, cudaStream_t stream);

// ---- optim.cu ----------------------------------------------------------------------------------
struct AdamWScalars {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float bias_correction1, bias_correction2;  // 1 - beta^step
  // A gated update (AdamWParams::gate): device f64 [2], gate[0] replaces grad_scale (rounded to
  // f32 as the host rounds grad_scale), nothing is written where gate[1] is 0. Null: none.
  const double* gate = nullptr;
};
// The gate of a gated update (Backend::update_gate): one thread, f64 arithmetic of
// framework/core/clip.h.
void launch_update_gate(const float* checked, int64_t n_checked, const float* sumsq,
                        int64_t n_sumsq, double max_norm, double* gate, cudaStream_t stream);
// working (dtype working_t) may be null.
void launch_adamw(float* master, const float* grad, float* m, float* v, int64_t n,
                  const AdamWScalars& s, void* working, DType working_t, cudaStream_t stream);
// launch_adamw on every entry with s (s.weight_decay where the entry's weight_decay is set, else
// 0), each entry bitwise as launch_adamw on it alone, in few launches: one per 64 entries of a
// working dtype (none and f32 together, bf16). Any alignment and numel (aligned entries take
// 16-byte accesses, their last numel % 4 elements one by one). Entries must not overlap.
struct AdamWRef {
  float* master;
  const float* grad;  // null: a zero gradient, not read (the bits of n zeros)
  float* m;
  float* v;
  void* working;  // null: none
  DType working_t;
  int64_t n;
  bool weight_decay;
};
void launch_adamw_many(const std::vector<AdamWRef>& entries, const AdamWScalars& s,
                       cudaStream_t stream);
// Check only: the update launch_adamw would make, nothing written; *flag = 1 when a new m, v or
// master, or the master in working_t, would not be finite (flag is never cleared here).
void launch_adamw_check(const float* master, const float* grad, const float* m, const float* v,
                        int64_t n, const AdamWScalars& s, DType working_t, float* flag,
                        cudaStream_t stream);

}  // namespace cuda
}  // namespace hp
